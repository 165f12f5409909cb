"""Soak, short mode: 45 seconds of open-loop fraud traffic at 70% of the sustainable maximum, on the real stack.

Runs `benchmarks/soak.py`'s `run_soak` in-process against a real Triton serving the compiled demo
fraud model, with features read from Redis through Feast. Asserts values, never wall-clock
latency: every request answered (nothing lost, no error) and memory bounded over those 45 seconds.
The 10-minute run (`benchmarks/soak.py`, results in benchmarks/results/soak.md) is where the
issue's figures come from. The rate is the soak's own: 70% of the highest open-loop rate the stack
keeps up with (no errors, p99 within the model's latency budget), found by stepping down from the closed-loop maximum (that maximum is the in-process
Python client's, and a paced request costs the client more than a closed-loop one). The served fraud
model is compiled with a 100 ms budget instead of the demo's 10 ms: with the demo's ~9 ms queue
timeout a CI machine whose 2 cores the client shares sheds the odd request after a scheduling
hiccup, which is the queue policy doing its job (tested in test_serve.py), not instability.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from scorestack.compile import compile_model
from scorestack.features import store
from scorestack.demo import features as demo_features
from conftest import LocalTriton
from scorestack.triton_config import load_config
from scorestack.serve.ports import free_ports

N_USERS = 1000
DURATION_S, WINDOW_S = 45.0, 7.5  # six windows, as the 10-minute run reports them
UTILIZATION = 0.7
STEP_S = 5.0
# Over 45 s a little allocator and cache warm-up is normal; a leak of a few kB a request is not: at
# ~1000 req/s over the 30 s between the second window's end and the last's it would add well over
# 10% to tritonserver+stubs.
MAX_SERVER_GROWTH = 1.10
MAX_CLIENT_GROWTH = 1.25


def _load_soak() -> ModuleType:
    """benchmarks/ is not a package: import soak.py from it by name (its client processes are
    spawned, and a spawned process finds the client's code by module name on the same sys.path)."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("soak")


@pytest.fixture(scope="module")
def feature_repo(tmp_path_factory, redis_url):
    repo = tmp_path_factory.mktemp("features") / "repo"
    demo_features.init_repo(repo, online="redis", redis_url=redis_url, n_users=N_USERS, project="e2e_soak")
    store.apply(repo)
    store.materialize(repo)
    return repo


@pytest.fixture(scope="module")
def soak_repository(compiled_demo, tmp_path_factory) -> Path:
    """The demo fraud model in its selected format, compiled with a 100 ms latency budget."""
    models_dir, _, specs, reports = compiled_demo
    spec = yaml.safe_load(specs["fraud_xgb"].read_text())
    spec["serving"]["latency_budget_ms"] = 100
    chosen = reports["fraud_xgb"]
    spec["formats"] = [b["format"] for b in chosen.dispatch.bands] if chosen.selected.format == "dispatch" else [chosen.selected.format]
    for key in ("path",):
        spec["source"][key] = str((models_dir / spec["source"][key]).resolve())
    spec["holdout"] = str((models_dir / spec["holdout"]).resolve())
    root = tmp_path_factory.mktemp("soak")
    (root / "fraud_xgb.yaml").write_text(yaml.safe_dump(spec))
    compile_model(root / "fraud_xgb.yaml", root / "repo", serve_check=False)
    return root / "repo"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # compiling the demo models (session fixture) + ~80 s of load
def test_soak_short_every_request_answered_and_memory_bounded(soak_repository, server_environment, feature_repo):
    soak = _load_soak()
    repository = soak_repository
    ports = dict(zip(("grpc_port", "http_port", "metrics_port"), free_ports(3)))
    with LocalTriton(repository, server_env=server_environment, models=["fraud_xgb"], **ports) as server:
        result = soak.run_soak(DURATION_S, WINDOW_S, server=server, feature_repo=feature_repo, n_users=N_USERS, max_seconds=10.0, utilization=UTILIZATION, step_s=STEP_S)

    totals, windows = result["totals"], result["windows"]
    report = soak.render_markdown(result)  # the per-window table (CPU, lag, errors' first messages) on failure
    assert result["settings"]["max_throughput"]["rps"] > 0
    sustained = result["settings"]["sustainable_max"]
    assert sustained["steps"][-1]["kept_up"] and 0 < sustained["rps"] <= result["settings"]["max_throughput"]["rps"]
    assert result["settings"]["rate_rps"] == pytest.approx(UTILIZATION * sustained["rps"], rel=1e-3)
    assert len(windows) == 6
    # Nothing silently lost, nothing failed: every request sent was answered.
    assert totals["sent"] == totals["ok"] + totals["errors_total"], report
    assert totals["accounted"], report
    assert totals["errors_total"] == 0, report
    assert totals["unsent"] == 0 and totals["sent"] == totals["scheduled"], report
    assert sum(w["sent"] for w in windows) == totals["sent"], report
    # Memory bounded: the end against the end of the second window (start-up growth excluded).
    base, end = windows[1]["memory"], windows[-1]["memory"]
    # The Python backend's stubs found and none died; scorestack's native backend runs in tritonserver itself.
    native = load_config(repository / "fraud_xgb" / "config.pbtxt").backend == "scorestack"
    assert (base["n_stubs"] == 0 if native else base["n_stubs"] >= 1) and end["n_stubs"] == base["n_stubs"], report
    assert end["server_total_mib"] <= MAX_SERVER_GROWTH * base["server_total_mib"], report
    assert end["client_mib"] <= MAX_CLIENT_GROWTH * base["client_mib"], report
