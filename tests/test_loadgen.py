"""The benchmark load generator against a real local Triton: counts match the server's, errors are named."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from sklearn.ensemble import GradientBoostingClassifier
from skl2onnx import to_onnx

from conftest import LocalTriton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loadgen

N_FEATURES = 30
CONFIG = """
name: "gb"
backend: "onnxruntime"
max_batch_size: 16
input [{ name: "X" data_type: TYPE_FP32 dims: [30] }]
output [{ name: "probabilities" data_type: TYPE_FP32 dims: [2] }]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [{ count: 1 kind: KIND_CPU }]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, server_environment):
    root = tmp_path_factory.mktemp("loadgen_repo")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, N_FEATURES)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    model = GradientBoostingClassifier(n_estimators=10, max_depth=2, random_state=0).fit(X, y)
    onx = to_onnx(model, X[:1], options={id(model): {"zipmap": False}})
    (root / "gb" / "1").mkdir(parents=True)
    (root / "gb" / "1" / "model.onnx").write_bytes(onx.SerializeToString())
    (root / "gb" / "config.pbtxt").write_text(CONFIG)
    with LocalTriton(root, server_env=server_environment) as s:
        yield s


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(8, N_FEATURES)).astype(np.float32)


@pytest.fixture(scope="module")
def gen():
    g = loadgen.LoadGenerator(workers=1)
    yield g
    g.close()


def _served(server: LocalTriton) -> int:
    """Requests Triton answered successfully for model gb, by its own statistics."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/gb/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def _served_settles_at(server: LocalTriton, before: int, expected: int) -> int:
    """Requests served since `before`, re-read for up to 2 s until it reaches `expected` (Triton may answer a request a
    moment before counting it); the caller asserts the value, so an over-count fails too."""
    now = _served(server) - before
    for _ in range(100):
        if now >= expected:
            break
        time.sleep(0.02)
        now = _served(server) - before
    return now


def _check_counts_and_order(r: loadgen.Result) -> None:
    assert r.errors == {} and r.dropped == 0
    assert r.ok == r.sent > 0
    assert r.p50_ms <= r.p90_ms <= r.p99_ms <= r.p999_ms <= r.max_ms
    assert r.throughput == pytest.approx(r.ok / r.duration_s)
    assert 0 < r.client_cpu_cores < os.cpu_count() + 0.5
    assert r.server_cpu_us_per_request is not None and r.server_cpu_us_per_request > 0


def test_closed_loop_counts_match_the_server(server, rows, gen):
    target = loadgen.grpc_target("gb", server.grpc_url, "gb", "X", rows)
    before = _served(server)
    r = gen.closed(target, concurrency=4, duration_s=2.0, warmup_s=0.3, server_pids=lambda: [server.process.pid])
    _check_counts_and_order(r)
    assert r.mode == "closed" and r.concurrency == 4
    # Triton served exactly what was sent: the warm-up and measured requests plus one preflight per worker.
    assert _served_settles_at(server, before, r.sent_total + gen.workers) == r.sent_total + gen.workers
    assert r.sent_total > r.sent


def test_open_loop_keeps_a_low_rate_and_is_pinned_when_asked(server, rows):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    target = loadgen.grpc_target("gb", server.grpc_url, "gb", "X", rows)
    before = _served(server)
    with loadgen.LoadGenerator(workers=1, cpus=[cpu]) as pinned:
        r = pinned.open(target, rate=150.0, duration_s=2.0, warmup_s=0.3, seed=7)
    assert r.errors == {} and r.dropped == 0
    assert r.ok == r.sent == r.scheduled > 0
    assert r.p50_ms <= r.p90_ms <= r.p99_ms <= r.p999_ms <= r.max_ms
    # Poisson arrivals from a seeded generator: the count in the window is fixed by the seed, near rate x duration.
    assert r.achieved_rate == pytest.approx(150.0, rel=0.15)
    assert _served_settles_at(server, before, r.sent_total + 1) == r.sent_total + 1
    assert r.workers[0]["affinity"] == [cpu] and r.workers[0]["last_cpu"] == cpu


def test_http_json_against_triton_http(server, rows, gen):
    bodies = [{"inputs": [{"name": "X", "shape": [1, N_FEATURES], "datatype": "FP32", "data": row.tolist()}]} for row in rows]
    target = loadgen.http_target("gb-http", server.http_url, "/v2/models/gb/infer", bodies)
    before = _served(server)
    r = gen.closed(target, concurrency=3, duration_s=1.0, warmup_s=0.2, server_pids=lambda: [server.process.pid])
    _check_counts_and_order(r)
    assert _served_settles_at(server, before, r.sent_total + gen.workers) == r.sent_total + gen.workers


def test_wrong_model_name_is_named(server, rows, gen):
    target = loadgen.grpc_target("typo", server.grpc_url, "gb_typo", "X", rows)
    with pytest.raises(loadgen.LoadGenError, match="gb_typo") as err:
        gen.closed(target, concurrency=2, duration_s=1.0)
    assert "the first request failed" in str(err.value)


def test_wrong_input_name_is_named(server, rows, gen):
    target = loadgen.grpc_target("bad-input", server.grpc_url, "gb", "features_typo", rows)
    with pytest.raises(loadgen.LoadGenError, match="features_typo"):
        gen.open(target, rate=50.0, duration_s=1.0)


def test_unreachable_server_fails_fast_with_the_address(rows, gen):
    from scorestack.serve.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    target = loadgen.grpc_target("nobody", address, "gb", "X", rows, deadline_s=2.0)
    with pytest.raises(loadgen.LoadGenError, match=address.replace(".", r"\.")):
        gen.closed(target, concurrency=1, duration_s=1.0)


def test_bad_arguments_are_refused(rows):
    with pytest.raises(ValueError, match="rows must be a non-empty 2-D"):
        loadgen.grpc_target("x", "127.0.0.1:1", "gb", "X", rows[0])
    with pytest.raises(ValueError, match="workers must be >= 1"):
        loadgen.LoadGenerator(workers=0)
