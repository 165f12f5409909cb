"""The benchmark load generator (h2load, one C client for every target) against a real local Triton:
the requests it counts are the requests Triton served, the suite's value check reads the answer
h2load's requests get, bad targets are named."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from sklearn.ensemble import GradientBoostingClassifier
from skl2onnx import to_onnx

from conftest import LocalTriton, settled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loadgen
import suite

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


def _served(server: LocalTriton) -> int:
    """Requests Triton answered successfully for model gb, by its own statistics."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/gb/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def _served_settles_at(server: LocalTriton, before: int, expected: int) -> int:
    """Requests served since `before`, re-read for up to 2 s until it reaches `expected`; the caller asserts
    the value, so an over-count fails too."""
    return settled(lambda: _served(server) - before, lambda n: n >= expected, timeout_s=2.0)


def _onnx_probability(server_root: Path, row: np.ndarray) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(server_root / "gb" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return float(sess.run(None, {"X": row.reshape(1, -1)})[-1][0, -1])


def _triton_http_body(row: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "X", "shape": [1, N_FEATURES], "datatype": "FP32", "data": row.tolist()}]}).encode()


def _check(r: dict, requests: int) -> None:
    assert r["requests"] == r["http_ok"] == requests
    assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["p999_ms"] <= r["max_ms"]
    assert r["throughput"] == pytest.approx(requests / r["seconds"])
    assert r["server_cpu_us_per_request"] > 0 and 0 < r["client_cpu_cores"] < 3


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_request_h2load_counts_is_one_triton_served_with_the_models_answer(server, rows, protocol):
    if protocol == "grpc":
        target = loadgen.grpc_target("gb", server.grpc_url, "gb", "X", rows[0])
    else:
        target = loadgen.http_target("gb-http", server.http_url, "/v2/models/gb/infer", _triton_http_body(rows[0]))
    # The value check the suite makes before loading a target reads the answer to h2load's exact bytes.
    start = _served(server)
    assert suite.answer(target) == pytest.approx(_onnx_probability(server.repository, rows[0]), abs=1e-6)
    assert loadgen.shape(target, 64) == ((8, 8) if protocol == "grpc" else (64, 1))
    # The check's own request, counted before the load starts (read at once it can still be missing: CI saw 401 of 400).
    before = start + _served_settles_at(server, start, 1)
    r = loadgen.run(target, *loadgen.shape(target, 4), 400, pids=lambda: [server.process.pid])
    _check(r, 400)
    assert _served_settles_at(server, before, 400) == 400


def test_closed_and_open_loops_send_what_they_say(server, rows):
    target = loadgen.grpc_target("gb", server.grpc_url, "gb", "X", rows[1])
    before = _served(server)
    closed = loadgen.closed(target, 2, 0.5, pids=lambda: [server.process.pid])
    assert closed["concurrency"] == 2 and (closed["connections"], closed["streams"]) == (2, 1)
    _check(closed, closed["requests"])
    # The open loop sends rps x connections x duration requests, spaced by h2load's --rps.
    opened = loadgen.open_loop(target, 160.0, 1.0, pids=lambda: [server.process.pid])
    assert opened["rate"] == 160 and opened["requests"] == 160
    _check(opened, 160)
    warmup = 200  # closed()'s first run, max(50 x concurrency, 200), warms the server and sizes the measured one
    assert _served_settles_at(server, before, warmup + closed["requests"] + 160) == warmup + closed["requests"] + 160


def test_an_error_answer_is_not_counted_as_served(server, rows):
    target = loadgen.http_target("typo", server.http_url, "/v2/models/gb_typo/infer", _triton_http_body(rows[0]))
    r = loadgen.run(target, 1, 1, 20)
    assert r["http_ok"] == 0 and r["throughput"] == 0 and r["http_statuses"] == {"404": 20}
    # Over gRPC an error is HTTP 200 with a grpc-status trailer: the suite's value check names it before any load.
    with pytest.raises(Exception, match="gb_typo"):
        suite.answer(loadgen.grpc_target("typo", server.grpc_url, "gb_typo", "X", rows[0]))


def test_unreachable_server_and_bad_arguments_are_named(rows):
    from scorestack.serve.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(loadgen.LoadGenError, match="target nobody"):
        loadgen.run(loadgen.grpc_target("nobody", address, "gb", "X", rows[0]), 1, 1, 10, timeout_s=30)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        loadgen.shape(loadgen.grpc_target("x", address, "gb", "X", rows[0]), 0)
