"""`scorestack diagnose` on a deployment the demo never made: a model trained and compiled here, served
by the real local Triton, traffic from a separate client process, and the fraud request path's
exported histograms joined with Triton's statistics.

Each diagnosis window is made to contain all of the traffic (the client starts when diagnose says it
is watching and must finish before the window ends), so what diagnose reports can be checked against
Triton's own cumulative statistics read by the test before and after, exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
import yaml

from scorestack import schema
from scorestack.demo import data as demo_data
from scorestack.client.server_stats import SERVER_PHASES, parse_statistics
from scorestack.compile import compile_model
from conftest import LocalTriton

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)

MODEL = "acme_risk"  # not a demo model: trained and compiled by this test
CACHED = "acme_cached"  # the same, served with Triton's response cache
EXE = str(Path(sys.executable).parent / "scorestack")
PASSIVE_REQUESTS = 600
REJECTED = 25  # more requests, sent with a 1 µs queue timeout: Triton's queue policy rejects them
FRAUD_REQUESTS = 200
WINDOW_S = 12.0  # long enough to hold all the traffic on a busy 2-core host; asserted below


@pytest.fixture(autouse=True)
def _workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """diagnose saves its window's statistics under the workspace by default: keep them out of the tree."""
    monkeypatch.setenv("SCORESTACK_WORKSPACE", str(tmp_path / "workspace"))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, server_environment):
    """A small XGBoost on the fraud feature layout, compiled into a repository of this test's own and served."""
    root = tmp_path_factory.mktemp("diagnose")
    rng = np.random.default_rng(11)
    X = rng.normal(size=(2400, len(schema.FRAUD_FEATURES))).astype(np.float32)
    y = (X[:, 0] + 0.7 * X[:, 3] * X[:, 5] - 0.4 * X[:, 20] > 0.2).astype(int)
    model = xgb.XGBClassifier(n_estimators=60, max_depth=4, n_jobs=1).fit(X[:2000], y[:2000])
    model.get_booster().save_model(root / "acme_risk.json")
    np.savez(root / "holdout.npz", X=X[2000:], y=y[2000:])
    spec = {
        "name": MODEL,
        "source": {"path": "acme_risk.json", "format": "xgboost-json"},
        "task": "binary",
        "inputs": {"features": list(schema.FRAUD_FEATURES)},
        # The queue policy stated (it is the default): diagnose must count what it rejects.
        "serving": {"batch_sizes": [1, 16], "max_batch_size": 64, "latency_budget_ms": 200, "queue_policy": True},
        "holdout": "holdout.npz",
        "formats": ["onnx", "native"],
    }
    spec_path = root / "acme_risk.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    repo = root / "model_repository"
    # No serving check inside the compile: the test serves the model itself right below.
    report = compile_model(spec_path, repo, serve_check=False)
    assert report.selected.format in ("onnx", "native", "dispatch")
    # The same model once more with Triton's response cache on (the compiler never turns it on).
    shutil.copytree(repo / MODEL, repo / CACHED)
    config = repo / CACHED / "config.pbtxt"
    text = config.read_text().replace(f'name: "{MODEL}"', f'name: "{CACHED}"', 1)
    config.write_text(text + "response_cache {\n  enable: true\n}\n")
    with LocalTriton(repo, server_env=server_environment) as server:
        yield server, repo, root


def _stats(server: LocalTriton, model: str = MODEL):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return parse_statistics(client.get_inference_statistics(model, as_json=True, client_timeout=10))[model]
    finally:
        client.close()


def _start_diagnose(args: list[str]) -> subprocess.Popen:
    """Start `scorestack diagnose`, returning once it has taken its first readings ("watching ...")."""
    proc = subprocess.Popen([EXE, "diagnose", *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if line.startswith("watching"):
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"diagnose never started watching: {''.join(seen)}{proc.stdout.read()}")


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    return json.loads(out)


CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    import tritonclient.grpc.aio as grpc
    from tritonclient.utils import InferenceServerException

    async def main(url, model, holdout, n, concurrency):
        client = grpc.InferenceServerClient(url)
        X = np.load(holdout)["X"].astype(np.float32)
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            rows = 1 + i % 4  # requests of 1-4 rows, so executed batches vary
            x = np.ascontiguousarray(X[i % 300 : i % 300 + rows])
            inp = grpc.InferInput("features", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            async with sem:
                await client.infer(model, [inp], client_timeout=30)

        sys.stdin.readline()  # "go": diagnose is watching
        await asyncio.gather(*(one(i) for i in range(n)))
        # Requests that allow 1 µs in the queue: Triton's queue policy rejects each (the batcher waits longer).
        rejected = 0
        for i in range(REJECTED):
            inp = grpc.InferInput("features", [1, X.shape[1]], "FP32")
            inp.set_data_from_numpy(X[i : i + 1])
            try:
                await client.infer(model, [inp], client_timeout=30, timeout=1)
            except InferenceServerException as exc:
                rejected += "timeout expired" in exc.message()
        await client.close()
        print("sent", n, "rejected", rejected, flush=True)

    REJECTED = int(sys.argv[6])
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    """
)


def test_passive_diagnosis_of_a_user_model_adds_up_to_tritons_statistics(deployment, tmp_path):
    server, repo, root = deployment
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.grpc_url, MODEL, str(root / "holdout.npz"), str(PASSIVE_REQUESTS), "8", str(REJECTED)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stats_file = tmp_path / "stats.json"
    before = _stats(server)
    diagnose = _start_diagnose(
        ["--url", server.grpc_url, "--model", MODEL, "--window", str(WINDOW_S), "--metrics-url", server.metrics_url,
         "--repository", str(repo), "--save-stats", str(stats_file)]
    )  # fmt: skip
    try:
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0 and f"sent {PASSIVE_REQUESTS} rejected {REJECTED}" in out, err
        assert diagnose.poll() is None, "the client's traffic outlasted the diagnosis window: raise WINDOW_S"
        doc = _finish(diagnose)
    finally:
        for p in (client, diagnose):
            if p.poll() is None:
                p.kill()
    triton = _stats(server) - before  # Triton's own accounting over (a superset of) the window

    (d,) = doc["models"]
    assert d["model"] == MODEL and d["mode"] == "passive" and d["client"] is None
    # Every request of the window, exactly as Triton counted them.
    assert d["requests"] == triton.success.count == PASSIVE_REQUESTS
    # The queue policy's rejections, by Triton's reason (from its /metrics).
    assert d["failed"] == triton.fail.count == REJECTED == d["rejected"] and d["failures"] == {"REJECTED": REJECTED}
    assert d["rows"] == triton.inference_count == sum(1 + i % 4 for i in range(PASSIVE_REQUESTS))
    assert {int(b): n for b, n in d["batch_sizes"].items()} == dict(triton.batches)
    assert sum(int(b) * n for b, n in d["batch_sizes"].items()) == d["rows"]
    assert d["executions"] == triton.execution_count == sum(triton.batches.values())
    assert d["server_total_ms"]["success"] == pytest.approx(triton.success.ns / 1e6, rel=1e-12)
    for phase in SERVER_PHASES:
        assert d["server_total_ms"][phase] == pytest.approx(triton.phase_ns(phase) / 1e6, rel=1e-12)

    # The named phases add up to Triton's own request time within 5%, and the rest is reported.
    named_total = sum(triton.phase_ns(p) for p in SERVER_PHASES) / 1e6
    assert named_total == pytest.approx(triton.success.ns / 1e6, rel=0.05)
    assert sum(d["phases_ms"].values()) * d["requests"] == pytest.approx(named_total, rel=1e-9)
    assert sum(d["phases_ms"].values()) + d["unattributed_ms"] == pytest.approx(d["measured_ms"], rel=1e-9)
    assert d["measured_ms"] == pytest.approx(triton.success.ns / triton.success.count / 1e6, rel=1e-9)
    assert d["attributed_share"] >= 0.95

    # The dominant phase is Triton's largest, and the decision is about it.
    largest = max(SERVER_PHASES, key=triton.phase_ns)
    assert d["dominant"] == largest == d["decision"]["phase"]
    assert d["decision"]["technique"] and d["decision"]["detail"]

    # The saved window is a batch profile the compiler reads: the executed sizes of this traffic.
    from scorestack.compile.profile import profile_for

    profile = profile_for(stats_file, MODEL)
    assert profile.executions == dict(triton.batches) and profile.requests == PASSIVE_REQUESTS
    assert doc["stats_file"] == str(stats_file.resolve())


@pytest.fixture(scope="module")
def feature_repo(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Path:
    from scorestack.features import store
    from scorestack.demo import features as demo_features

    repo = tmp_path_factory.mktemp("diagnose_features") / "repo"
    demo_features.init_repo(repo, online="redis", redis_url=redis_url, n_users=100, n_items=50, project="diagnose_e2e")
    store.apply(repo)
    store.materialize(repo)
    return repo


def _transaction(i: int) -> dict:
    row = demo_data.make_fraud_requests(FRAUD_REQUESTS, seed=77).iloc[i % FRAUD_REQUESTS]
    return {"user_id": 1 + i % 100, **{k: float(v) for k, v in row.items()}}


def test_client_metrics_join_attributes_the_fraud_paths_latency(deployment, feature_repo):
    from prometheus_client import CollectorRegistry

    from scorestack.client.fraud import FraudService
    from scorestack.client.metrics import RequestMetrics, serve
    from scorestack.client.triton import TritonClient
    from scorestack.features.fetch import FeatureFetcher

    server, repo, _ = deployment
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, service="fraud", model=MODEL)
    http, _ = serve(0, registry)
    loop = asyncio.new_event_loop()
    try:

        async def open_path():
            # One registry for the fetch layer and the request phases: one endpoint to scrape.
            fetcher = await FeatureFetcher.from_repo(feature_repo, timeout_s=0.5, registry=registry).start()
            return TritonClient(server.grpc_url, deadline_s=5.0), fetcher

        triton, fetcher = loop.run_until_complete(open_path())
        # The request path records its own phases into the exported histograms (warm-up requests
        # too: the diagnosis reads the histograms' change over its window).
        fraud = FraudService(triton, fetcher, model=MODEL, metrics=metrics)
        totals: list[float] = []

        async def traffic(n: int, record: bool) -> None:
            for i in range(n):
                result = await fraud.score(_transaction(i))
                assert 0.0 <= result.probability <= 1.0
                if record:
                    totals.append(result.timings_ms["total"])

        loop.run_until_complete(traffic(10, record=False))  # warm: metadata, threshold, connections
        before = _stats(server)
        diagnose = _start_diagnose(
            ["--url", server.grpc_url, "--model", MODEL, "--window", str(WINDOW_S), "--repository", str(repo),
             "--client-metrics", f"http://127.0.0.1:{http.server_port}/metrics"]
        )  # fmt: skip
        try:
            loop.run_until_complete(traffic(FRAUD_REQUESTS, record=True))
            assert diagnose.poll() is None, "the fraud traffic outlasted the diagnosis window: raise WINDOW_S"
            doc = _finish(diagnose)
        finally:
            if diagnose.poll() is None:
                diagnose.kill()
        triton_delta = _stats(server) - before
        loop.run_until_complete(fetcher.close())
        loop.run_until_complete(triton.close())
    finally:
        http.shutdown()
        loop.close()

    import os

    # By default the window's statistics are saved in the workspace, ready for --batch-profile.
    assert doc["stats_file"] == str((Path(os.environ["SCORESTACK_WORKSPACE"]) / "diagnose-stats.json").resolve())
    assert Path(doc["stats_file"]).is_file()
    (d,) = doc["models"]
    assert d["mode"] == "client-metrics" and d["client"]["service"] == "fraud"
    # The join sees exactly the fraud path's requests, on both sides.
    assert d["client"]["requests"] == FRAUD_REQUESTS == d["requests"] == triton_delta.success.count
    assert d["client"]["mean_ms"]["total"] == pytest.approx(float(np.mean(totals)), rel=1e-6)
    assert d["measured_ms"] == d["client"]["mean_ms"]["total"]
    # Client, server and network phases by name; at least 95% of the client's mean latency is in them.
    assert {"validate", "features", "assemble", "queue", "compute_input", "compute_infer", "compute_output", "network"} <= set(d["phases_ms"])
    assert all(v >= 0 for v in d["phases_ms"].values())
    assert d["phases_ms"]["compute_infer"] == pytest.approx(triton_delta.compute_infer.ns / FRAUD_REQUESTS / 1e6, rel=1e-9)
    assert d["attributed_share"] >= 0.95, d
    assert d["unattributed_ms"] == pytest.approx(d["measured_ms"] - sum(d["phases_ms"].values()), abs=1e-9)
    assert d["dominant"] == max(d["phases_ms"], key=d["phases_ms"].get) == d["decision"]["phase"]
    assert d["decision"]["technique"]


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    # Wide enough that typer's error box does not wrap a message the assertions read.
    env = {**(os.environ if env is None else env), "COLUMNS": "250"}
    return subprocess.run([EXE, "diagnose", *args], capture_output=True, text=True, timeout=180, env=env)


def test_replay_from_the_compile_reports_holdout_and_from_an_npz(deployment, tmp_path):
    server, repo, root = deployment
    base = ["--url", server.grpc_url, "--model", MODEL, "--replay", "--repository", str(repo), "--save-stats", str(tmp_path / "s.json"), "--json"]
    # Default rows: the held-out rows the model's report.json -> spec -> holdout points to.
    out = _run([*base, "--requests", "150", "--concurrency", "4"])
    assert out.returncode == 0, out.stderr
    assert "holdout.npz" in out.stderr and "acme_risk.yaml" in out.stderr
    (d,) = json.loads(out.stdout)["models"]
    assert d["mode"] == "replay" and d["requests"] == 150 == d["client"]["requests"] and d["rows"] == 150
    assert d["client"]["p50_ms"] <= d["client"]["p99_ms"] and d["measured_ms"] == d["client"]["mean_ms"]["total"]
    assert "network" in d["phases_ms"] and d["attributed_share"] >= 0.95

    rows = tmp_path / "rows.npz"
    np.savez(rows, X=np.load(root / "holdout.npz")["X"][:50].astype(np.float64))  # cast to the model's FP32 on the way
    out = _run([*base, "--rows", str(rows), "--requests", "60", "--rate", "300", "--rows-per-request", "3"])
    assert out.returncode == 0, out.stderr
    (d,) = json.loads(out.stdout)["models"]
    assert d["requests"] == 60 and d["rows"] == 180


def test_bad_input_is_named_with_the_fix(deployment, tmp_path):
    server, repo, _ = deployment
    url = ["--url", server.grpc_url]
    out = _run([*url, "--model", "nope", "--window", "1"])
    assert out.returncode == 1 and "'nope'" in out.stderr and "not served" in out.stderr
    no_x = tmp_path / "no_x.npz"
    np.savez(no_x, rows=np.zeros((3, 3)))
    out = _run([*url, "--model", MODEL, "--replay", "--rows", str(no_x)])
    assert out.returncode == 1 and "no array X" in out.stderr and "np.savez" in out.stderr
    # --client-metrics alone watches the default window; the endpoint is read before it starts.
    out = _run([*url, "--client-metrics", "http://127.0.0.1:1/metrics"])
    assert out.returncode == 1 and "http://127.0.0.1:1/metrics did not answer" in out.stderr
    # Replay settings without --replay: named, nothing sent; --replay without a model to replay into.
    out = _run([*url, "--model", MODEL, "--requests", "5"])
    assert out.returncode == 2 and "--requests" in out.stderr and "add --replay" in out.stderr
    out = _run([*url, "--replay", "--requests", "5"])
    assert out.returncode == 2 and "--model M" in out.stderr
    # The demo's traffic flags belong to `scorestack demo diagnose`.
    out = _run([*url, "--fraud-requests", "5"])
    assert out.returncode == 2 and "--fraud-requests" in out.stderr
    out = _run([*url, "--window", "5", "--rate", "10"])
    assert out.returncode == 2 and "sends nothing" in out.stderr
    out = _run([*url, "--model", MODEL, "--replay", "--window", "5"])
    assert out.returncode == 2 and "send nothing" in out.stderr
    out = _run([*url, "--window", "1", "--client-metrics", "http://127.0.0.1:1/metrics", "--model", MODEL])
    assert out.returncode == 1 and "http://127.0.0.1:1/metrics did not answer" in out.stderr


def test_bare_diagnose_watches_every_ready_model_for_the_default_window_and_sends_nothing(deployment, tmp_path):
    """`scorestack diagnose --url X` and nothing else: passive over every ready model for the default
    window; `--model M` alone: passive over M. Triton counts no inference from either."""
    from scorestack.cli.diagnose import DEFAULT_WINDOW_S

    server, _, _ = deployment
    before = {m: _stats(server, m) for m in (MODEL, CACHED)}
    # In an empty folder: no ./model_repository with compile reports to read either. Beside it, at the
    # same time, `--model M` alone: it watches that model and sends nothing too (replay needs --replay).
    bare = subprocess.Popen([EXE, "diagnose", "--url", server.grpc_url, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    one = subprocess.Popen([EXE, "diagnose", "--url", server.grpc_url, "--model", MODEL, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out_text, err_text = bare.communicate(timeout=180)
    one_out, one_err = one.communicate(timeout=180)
    assert bare.returncode == 0, err_text
    assert one.returncode == 0, one_err
    after = {m: _stats(server, m) for m in (MODEL, CACHED)}
    assert f"passive over every ready model for {DEFAULT_WINDOW_S:g} s, the default window" in err_text and "sending nothing" in err_text
    assert "watching" in err_text
    assert f"passive over {MODEL} for {DEFAULT_WINDOW_S:g} s" in one_err and "sending nothing" in one_err
    (only,) = json.loads(one_out)["models"]
    assert only["model"] == MODEL and only["mode"] == "passive" and only["requests"] == 0
    by_model = {d["model"]: d for d in json.loads(out_text)["models"]}
    assert set(by_model) == {MODEL, CACHED}
    for model, d in by_model.items():
        delta = after[model] - before[model]
        assert (delta.inference_count, delta.success.count, delta.fail.count, delta.execution_count) == (0, 0, 0, 0), model
        assert d["mode"] == "passive" and d["requests"] == 0 and d["rows"] == 0 and d["decision"]["phase"] == "none"
        assert d["window_s"] >= DEFAULT_WINDOW_S


def test_restricted_statistics_take_the_admin_key_from_the_environment_only(deployment, server_environment):
    import os
    import secrets

    from scorestack.serve.security import ADMIN_KEY_ENV, AdminKey

    _, repo, _ = deployment
    key = AdminKey(secrets.token_urlsafe(32), "test")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORESTACK_ADMIN_KEY")}
    with LocalTriton(repo, server_env=server_environment, admin_key=key) as restricted:
        args = ["--url", restricted.grpc_url, "--window", "0.5", "--json", "--repository", str(repo)]
        refused = _run(args, env=env)
        assert refused.returncode == 1 and ADMIN_KEY_ENV in refused.stderr and key.value not in refused.stderr
        out = _run(args, env={**env, ADMIN_KEY_ENV: key.value})
        assert out.returncode == 0, out.stderr
        by_model = {d["model"]: d for d in json.loads(out.stdout)["models"]}  # every ready model
        assert set(by_model) == {MODEL, CACHED}
        d = by_model[MODEL]
        assert d["requests"] == 0 and d["decision"]["phase"] == "none"
        assert key.value not in out.stdout + out.stderr


def test_compute_decision_prints_a_recompile_command_the_compiler_accepts(deployment, tmp_path):
    """The served format measured slower at the executed batch sizes than another one -> the command.

    The compile report is the real one; the served format is set to the one its curves measured
    slowest at batch 1 (a model compiled for other traffic), and the window executed batch 1 only.
    The printed command is then run as printed, into a repository of the test's own.
    """
    import shlex

    from scorestack.client.advice import _curves, decide_compute
    from scorestack.client.diagnose import save_profile
    from scorestack.client.server_stats import Duration, ModelStats
    from scorestack.compile.report import CompileReport

    _, repo, _ = deployment
    report = CompileReport.model_validate_json((repo / MODEL / "report.json").read_text())
    curves = _curves(report)
    assert len(curves) >= 2, f"the compile measured one format only: {curves}"
    slow = max(curves, key=lambda f: curves[f][1])
    fast = min(curves, key=lambda f: curves[f][1])
    assert curves[slow][1] > 1.2 * curves[fast][1], curves  # onnx vs native XGBoost at batch 1 (docs/platform-notes.md: >10x)
    served = report.model_copy(update={"selected": report.selected.model_copy(update={"format": slow})})
    window = ModelStats(MODEL, success=Duration(400, 400 * 10**6), compute_infer=Duration(400, 400 * 10**6),
                        inference_count=400, execution_count=400, batches={1: 400}, batch_infer_ns={1: 400 * int(curves[slow][1] * 1e3)})  # fmt: skip
    stats_file = save_profile(tmp_path / "stats.json", [window])
    own_repo = tmp_path / "recompiled"
    decision = decide_compute(0.8, window, served, repo / MODEL / "report.json", own_repo, stats_file)
    assert decision.phase == "compute_infer" and decision.command is not None
    assert decision.technique.startswith("recompile") and (fast in decision.technique or "dispatch" in decision.technique)
    argv = shlex.split(decision.command)
    assert argv[:2] == ["scorestack", "compile"] and argv[argv.index("--batch-profile") + 1] == str(stats_file)

    done = subprocess.run([EXE, *argv[1:], "--no-serve-check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    recompiled = CompileReport.model_validate_json((own_repo / MODEL / "report.json").read_text())
    assert recompiled.batch_profile is not None and recompiled.batch_profile.executions == {"1": 400}
    assert recompiled.batch_profile.requests == 400

    # Triton spending 20x what the model measured per execution: the backend's overhead, which no
    # format removes. Whether a queue delay could join requests depends on whether they overlap.
    per_exec_ns = 400 * int(20 * max(c[1] for c in curves.values()) * 1e3)

    def overhead_window(request_ns: int) -> ModelStats:
        return ModelStats(MODEL, success=Duration(400, 400 * request_ns), compute_infer=Duration(400, per_exec_ns),
                          inference_count=400, execution_count=400, batches={1: 400}, batch_infer_ns={1: per_exec_ns})  # fmt: skip

    report_path = repo / MODEL / "report.json"
    alone = decide_compute(0.8, overhead_window(2_000_000), report, report_path, own_repo, stats_file, window_s=10.0)  # 0.08 in Triton
    assert alone.technique.startswith("fewer, fuller executions or a native backend") and alone.command is None
    assert "rarely overlap (0.08 in Triton on average)" in alone.detail and "raise max_queue_delay" not in alone.detail
    crowded = decide_compute(0.8, overhead_window(100_000_000), report, report_path, own_repo, stats_file, window_s=10.0)  # 4.0
    assert "raise max_queue_delay_microseconds" in crowded.detail and "rarely overlap" not in crowded.detail


def test_queue_and_feature_rules_turn_measurements_into_settings(deployment):
    """The queue and feature rules on the served model's real config and hand-made windows of traffic."""
    from scorestack.client.advice import FeatureSide, ServedConfig, decide_features, decide_queue
    from scorestack.client.server_stats import Duration, ModelStats

    server, _, _ = deployment
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        config = ServedConfig.from_json(client.get_model_config(MODEL, as_json=True, client_timeout=10))
    finally:
        client.close()
    assert config.max_batch_size == 64 and config.max_queue_delay_us == 0 and config.instances >= 1
    # The compiler derives no queue delay any more; the rule that lowers one is checked on the served
    # config with the 200 µs delay earlier compiles set (what a user's older repository still has).
    config = dataclasses.replace(config, max_queue_delay_us=200)
    delay = config.max_queue_delay_us

    # Lone requests waiting out the batcher's delay: batches of 1, queue ~ the delay -> lower it to 0.
    lone = ModelStats(MODEL, success=Duration(1000, 1000 * 400_000), queue=Duration(1000, 1000 * delay * 1000),
                      compute_infer=Duration(1000, 1000 * 100_000), inference_count=1000, execution_count=1000, batches={1: 1000})  # fmt: skip
    d = decide_queue(0.6, lone, config, 10.0, delay / 1e3)
    assert d.technique == f"lower max_queue_delay_microseconds from {delay} to 0" and "1.0 rows" in d.detail

    # Full batches and a queue 20x the delay: the instances are the bottleneck -> one more.
    busy = ModelStats(MODEL, success=Duration(64_000, 0), queue=Duration(64_000, 0), compute_infer=Duration(64_000, 64_000 * 5_000_000),
                      inference_count=64_000, execution_count=1000, batches={64: 1000})  # fmt: skip
    d = decide_queue(0.7, busy, config, 10.0, 20 * delay / 1e3)
    assert d.technique.startswith(f"add instances (instance_group count {config.instances} -> {config.instances + 1})")
    assert "64.0 rows" in d.detail

    reads = {"direct": (500, 1.8)}
    assert "direct Redis reader instead of feast_async" in decide_features(0.5, 2.0, FeatureSide({"feast_async": (500, 2.5)}, 0, 0, 1.0), 1.0).technique
    assert "cache_ttl_s" in decide_features(0.5, 2.0, FeatureSide(reads, 10, 90, 1.0), 1.0).technique
    assert "coalesce" in decide_features(0.5, 2.0, FeatureSide(reads, 90, 10, 1.0), 8.0).technique
    alone = decide_features(0.5, 2.0, FeatureSide(reads, 90, 10, 1.0), 0.2)  # nothing overlaps: nothing to coalesce
    assert "store round trip" in alone.technique and "too few to coalesce" in alone.detail


def test_response_cache_hits_are_counted_and_their_time_named(deployment):
    server, repo, root = deployment
    X = np.load(root / "holdout.npz")["X"].astype(np.float32)
    before = _stats(server, CACHED)
    diagnose = _start_diagnose(["--url", server.grpc_url, "--model", CACHED, "--window", "6", "--repository", str(repo)])
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for i in range(100):  # 10 distinct rows, each sent 10 times, one at a time: 10 misses, 90 hits
            inp = grpcclient.InferInput("features", [1, X.shape[1]], "FP32")
            inp.set_data_from_numpy(X[i % 10 : i % 10 + 1])
            client.infer(CACHED, [inp], client_timeout=30)
        assert diagnose.poll() is None, "the traffic outlasted the diagnosis window"
        doc = _finish(diagnose)
    finally:
        client.close()
        if diagnose.poll() is None:
            diagnose.kill()
    triton = _stats(server, CACHED) - before
    (d,) = doc["models"]
    assert d["requests"] == 100 and triton.cache_hit.count == 90 == d["cache_hits"] and d["cache_hit_rate"] == pytest.approx(0.9)
    assert d["rows"] == 10 and d["executions"] == 10  # only the misses reached the model
    assert d["phases_ms"]["cache"] == pytest.approx((triton.cache_hit.ns + triton.cache_miss.ns) / 100 / 1e6, rel=1e-9)
    assert d["attributed_share"] == pytest.approx(sum(triton.phase_ns(p) for p in SERVER_PHASES) / triton.success.ns, rel=1e-9)


def test_the_plain_text_table_names_every_phase_the_traffic_and_the_unattributed_rest():
    """The default output (no --json): one row per named phase with its share, the unattributed rest,
    the executed batch sizes, cache hits, queue-policy rejections and the decision; --json holds the same."""
    from scorestack.client.diagnosis import ModelContext, diagnose_model, render_diagnoses, to_json
    from scorestack.client.server_stats import Duration, ModelStats

    ms = 1_000_000  # ns
    window = ModelStats(
        "user_model", success=Duration(100, 100 * 2 * ms), fail=Duration(3, 3 * ms), queue=Duration(100, 100 * 1_200_000),
        compute_input=Duration(100, 100 * 50_000), compute_infer=Duration(100, 100 * 600_000), compute_output=Duration(100, 100 * 50_000),
        cache_hit=Duration(0, 0), inference_count=100, execution_count=60, batches={1: 20, 2: 40}, batch_infer_ns={1: 20 * ms, 2: 40 * ms},
    )  # fmt: skip
    ctx = ModelContext(config=None, report=None, report_path=Path("/nowhere/report.json"), repository=Path("/nowhere"), stats_file=None)
    d = diagnose_model("passive", window, 10.0, ctx, failures={"REJECTED": 3})
    assert d.phases_ms == pytest.approx({"queue": 1.2, "compute_input": 0.05, "compute_infer": 0.6, "compute_output": 0.05})
    assert d.measured_ms == pytest.approx(2.0) and d.unattributed_ms == pytest.approx(0.1) and d.attributed_share == pytest.approx(0.95)
    assert d.dominant == "queue" == d.decision.phase and d.rejected == 3 and d.cache_hit_rate == 0.0

    lines = render_diagnoses([d]).splitlines()
    assert lines[0] == "model user_model — passive, 10.0 s window, 100 requests"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:8]}
    assert rows["queue"] == ["1.200", "60.0%", "<-", "dominant"]
    assert rows["compute_infer"] == ["0.600", "30.0%"] and rows["compute_input"] == rows["compute_output"] == ["0.050", "2.5%"]
    assert rows["unattributed"] == ["0.100", "5.0%"]
    assert rows["total"][:2] == ["2.000", "100%"] and "95.0% attributed to named phases" in lines[7]
    assert "executed batch sizes (size: executions): 1: 20, 2: 40; 100 rows in 60 executions" in lines[8]
    assert "response cache hits 0 (0%); failed 3, of them rejected by the queue policy 3" in lines[9]
    assert lines[10].startswith("  decision: queue is 60% of the time -> ")

    doc = json.loads(json.dumps(to_json([d], url="x:8001")))
    (j,) = doc["models"]
    assert j["unattributed_ms"] == pytest.approx(0.1) and j["batch_sizes"] == {"1": 20, "2": 40} and j["decision"]["phase"] == "queue"
    # Without Triton's /metrics the rejections are unknown, and the table says how to know them.
    unknown = diagnose_model("passive", window, 10.0, ctx)
    assert unknown.rejected is None and "rejected by the queue policy unknown (pass --metrics-url)" in render_diagnoses([unknown])


def test_exported_request_phases_read_back_as_the_means_of_the_window():
    """A request path's histograms (any service: here a ranking path's phases) exported with
    prometheus-client and scraped twice: the difference is exactly the window's requests."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry

    from scorestack.client.diagnosis import client_named_phases
    from scorestack.client.metrics import RequestMetrics, Scrape, serve
    from scorestack.errors import InferenceError

    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, service="ranking", model="user_ranker")
    server, _ = serve(0, registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        metrics.observe({"validate": 9.0, "features": 9.0, "features_wait": 9.0, "assemble": 9.0, "infer": 9.0, "total": 45.0})  # before the window
        before = Scrape.read(url)
        window = [
            {"validate": 0.1, "features": 1.5, "features_wait": 1.0, "assemble": 0.2, "infer": 2.0, "total": 3.5},
            {"validate": 0.3, "features": 2.5, "features_wait": 2.0, "assemble": 0.4, "infer": 4.0, "total": 6.9},
        ]
        for timings in window:
            metrics.observe(timings)
        (service, means, n), = Scrape.read(url).minus(before).request_phases("user_ranker")
    finally:
        server.shutdown()
    assert service == "ranking" and n == 2
    assert means == pytest.approx({p: (window[0][p] + window[1][p]) / 2 for p in window[0]}, rel=1e-9)
    # The client's own critical-path phases: the fetch's wait (not its overlapping duration); the Triton
    # call (`infer`) is split with Triton's statistics instead.
    assert client_named_phases(means) == pytest.approx({"validate": 0.2, "assemble": 0.3, "features": 1.5})
    with pytest.raises(ValueError, match="'features'"):
        metrics.observe({"features": -1.0})

    class NotMetrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>a dashboard, not metrics</body></html>\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    page = http.server.HTTPServer(("127.0.0.1", 0), NotMetrics)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        with pytest.raises(InferenceError, match=rf"metrics at http://127.0.0.1:{page.server_port}/: not Prometheus text"):
            Scrape.read(f"http://127.0.0.1:{page.server_port}/")
    finally:
        page.shutdown()


def test_server_snapshot_sums_every_served_version():
    """A model serves two versions by default; the snapshot is the model's traffic over both (it read
    entry 0 alone, the old idle version after a recompile: every phase 0). Triton's statistics JSON
    as its gRPC API returns it, from a stand-in for the client: the shape is what is tested here;
    the served path is covered by the tests above."""
    from types import SimpleNamespace

    from scorestack.client.breakdown import server_snapshot

    def version(v: str, n: int, queue_ns: int) -> dict:
        stat = lambda ns: {"count": str(n), "ns": str(ns)}
        return {"name": "m", "version": v, "inference_count": str(n), "execution_count": str(n // 2),
                "inference_stats": {"success": stat(1000 * n), "queue": stat(queue_ns), "compute_input": stat(10), "compute_infer": stat(500 * n),
                                    "compute_output": stat(20), "cache_hit": {"count": "0", "ns": "0"}}}

    async def stats(model, headers=None, as_json=False, client_timeout=None):
        return {"model_stats": [version("1", 0, 0), version("2", 40, 7000)]}

    triton = SimpleNamespace(grpc=SimpleNamespace(get_inference_statistics=stats), admin_headers=None, url="x", admin_key=None)
    snap = asyncio.run(server_snapshot(triton, "m"))
    assert (snap.success_count, snap.success_ns, snap.queue_ns, snap.compute_infer_ns) == (40, 40_000, 7000, 20_000)
    assert (snap.inference_count, snap.execution_count, snap.compute_input_ns) == (40, 20, 20)
