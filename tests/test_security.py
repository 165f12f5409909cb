"""Who may change the models and who may listen: the admin key, TLS and mutual TLS against the real local Triton."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
import yaml
from tritonclient.utils import InferenceServerException

from conftest import LocalTriton, ServeOutput, settled_statistics
from restricted_triton import assert_restricted_to, cmdlines, wait_ready

from scorestack import limits, schema
from scorestack.demo import data as demo_data
from scorestack.client.breakdown import server_snapshot
from scorestack.client.fraud import FraudService
from scorestack.client.triton import ModelInfo, TensorInfo, TritonClient
from scorestack.errors import AdminKeyError, RequestValidationError, TlsError
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher
from scorestack.serve.control import load_version, unload_model
from scorestack.serve.devcerts import issue_client_cert, write_dev_certs
from scorestack.serve.security import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_FILE_ENV,
    ADMIN_KEY_HEADER,
    TLS_DIR_ENV,
    AdminKey,
    ClientTls,
    ServerTls,
    load_admin_key,
)

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)

SCORESTACK = str(Path(sys.executable).with_name("scorestack"))
MODEL = "fraud_tiny"
N_USERS = 200
DEADLINE_S = 5.0
# One key for the module's servers; generated, never committed.
KEY = AdminKey(secrets.token_urlsafe(32), "test")


# --- fixtures: a small fraud model, its features, certificates ---------------------------------------


def _fraud_spec(root: Path, tag: str, trees: int) -> tuple[Path, xgb.Booster]:
    users = demo_data.make_users(N_USERS)
    X, y, _ = demo_data.make_fraud_dataset(users, n=4000)
    model = xgb.XGBClassifier(n_estimators=trees, max_depth=3, n_jobs=1, random_state=0).fit(X[:3000], y[:3000])
    model.get_booster().save_model(root / f"{tag}.json")
    np.savez(root / f"{tag}.npz", X=X[3000:], y=y[3000:])
    spec = {
        "name": MODEL,
        "source": {"path": f"{tag}.json", "format": "xgboost-json"},
        "task": "binary",
        "inputs": {"features": list(schema.FRAUD_FEATURES), "dtype": "float32"},
        "outputs": [schema.OUTPUT_TENSORS["binary"]],
        "serving": {"batch_sizes": [1, 16], "latency_budget_ms": 1000, "decision_threshold": 0.05, "keep_versions": 1},
        "holdout": f"{tag}.npz",
        "formats": ["onnx"],
    }
    path = root / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, model.get_booster()


@pytest.fixture(scope="module")
def fraud_model(tmp_path_factory):
    from scorestack.compile import compile_model

    root = tmp_path_factory.mktemp("security_model")
    spec, booster = _fraud_spec(root, "v1", trees=20)
    repo = root / "repo"
    assert compile_model(spec, repo, serve_check=False).version == 1
    return root, repo, booster


@pytest.fixture(scope="module")
def feature_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("security_features") / "repo"
    demo_features.init_repo(repo, online="sqlite", n_users=N_USERS, n_items=10, project="security_test")
    store.apply(repo)
    store.materialize(repo)
    return repo


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    return {
        "good": write_dev_certs(root / "good"),
        "other": write_dev_certs(root / "other"),  # another CA: its certificates mean nothing to "good"
        "expired": write_dev_certs(root / "expired", expired=True),
    }


@pytest.fixture(scope="module")
def plain_server(fraud_model, server_environment):
    with LocalTriton(fraud_model[1], server_env=server_environment, admin_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def mtls_server(fraud_model, server_environment, certs):
    tls = ServerTls.from_dir(certs["good"].directory, mutual=True)
    with LocalTriton(fraud_model[1], server_env=server_environment, admin_key=KEY, tls=tls) as s:
        yield s


def _x(n: int = 4) -> np.ndarray:
    return np.random.default_rng(3).normal(size=(n, len(schema.FRAUD_FEATURES))).astype(np.float32)


async def _infer(url: str, X: np.ndarray, **kw) -> np.ndarray:
    async with TritonClient(url, deadline_s=DEADLINE_S, **kw) as c:
        return (await c.infer(MODEL, {schema.INPUT_TENSOR: X})).outputs[schema.OUTPUT_TENSORS["binary"]]


# --- the admin key ----------------------------------------------------------------------------------


def test_admin_key_comes_from_env_or_file_never_printed(tmp_path):
    key = secrets.token_urlsafe(24)
    assert load_admin_key(environ={}) is None
    assert load_admin_key(environ={ADMIN_KEY_ENV: key}).value == key
    f = tmp_path / "admin.key"
    f.write_text(key + "\n")
    f.chmod(0o600)
    loaded = load_admin_key(environ={ADMIN_KEY_FILE_ENV: str(f)})
    assert loaded.value == key and loaded.source == str(f)
    assert key not in repr(loaded) and key not in str(loaded)
    with pytest.raises(AdminKeyError, match="set only one"):
        load_admin_key(environ={ADMIN_KEY_ENV: key, ADMIN_KEY_FILE_ENV: str(f)})
    with pytest.raises(AdminKeyError, match="cannot be read"):
        load_admin_key(environ={ADMIN_KEY_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(AdminKeyError, match="at least 16 URL-safe"):
        load_admin_key(environ={ADMIN_KEY_ENV: "short"})
    with pytest.raises(AdminKeyError, match="URL-safe"):
        AdminKey("has:colon=and,comma" + "x" * 10)  # would break Triton's flag syntax


def test_model_load_unload_needs_the_key_inference_does_not(plain_server, fraud_model):
    url = plain_server.grpc_url
    X = _x()
    want = fraud_model[2].predict(xgb.DMatrix(X))
    # Inference, metadata, config and health: open.
    np.testing.assert_allclose(asyncio.run(_infer(url, X))[:, 0], want, atol=1e-5)
    g = grpcclient.InferenceServerClient(url)
    assert g.is_server_ready(client_timeout=5) and g.get_model_config(MODEL, client_timeout=5).config.max_batch_size == 16
    # Unload without the key, and with a wrong one: refused, saying which; the model keeps serving.
    with pytest.raises(AdminKeyError, match="no admin key was sent") as err:
        unload_model(url, MODEL, admin_key=None)
    assert ADMIN_KEY_ENV in str(err.value)
    with pytest.raises(AdminKeyError, match="is not the server's"):
        unload_model(url, MODEL, admin_key=AdminKey(secrets.token_urlsafe(32), "a wrong key"))
    with pytest.raises(AdminKeyError, match="no admin key was sent"):
        load_version(url, MODEL, 1, timeout_s=DEADLINE_S, admin_key=None)
    assert g.is_model_ready(MODEL, "1", client_timeout=5)
    # With the key: unload takes the model away, load brings it back.
    unload_model(url, MODEL, admin_key=KEY)
    deadline = time.monotonic() + 30
    while g.is_model_ready(MODEL, client_timeout=5) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not g.is_model_ready(MODEL, client_timeout=5)
    assert load_version(url, MODEL, 1, timeout_s=60, admin_key=KEY) >= 0
    np.testing.assert_allclose(asyncio.run(_infer(url, X))[:, 0], want, atol=1e-5)
    # Statistics: restricted on gRPC and HTTP alike.
    with pytest.raises(InferenceServerException, match="restricted"):
        g.get_inference_statistics(MODEL, client_timeout=5)
    stats = settled_statistics(g, MODEL, lambda s: s.model_stats[0].inference_stats.success.count >= 1, headers=KEY.grpc_headers).model_stats[0]
    assert stats.name == MODEL and stats.inference_stats.success.count >= 1
    req = urllib.request.Request(f"http://{plain_server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=5)
    assert http_err.value.code == 403 and ADMIN_KEY_HEADER in http_err.value.read().decode()
    assert plain_server.repository_index()[MODEL].ready  # LocalTriton's own admin calls send the key
    g.close()


def test_diagnosis_statistics_need_the_key(plain_server):
    async def snap(key):
        async with TritonClient(plain_server.grpc_url, deadline_s=DEADLINE_S, admin_key=key) as c:
            return await server_snapshot(c, MODEL)

    with pytest.raises(AdminKeyError, match="no admin key was sent"):
        asyncio.run(snap(None))
    assert asyncio.run(snap(KEY)).success_count >= 1


# --- TLS ----------------------------------------------------------------------------------------------


def _tls_failure(url: str, **kw) -> str:
    """The TlsError a request gets, never a hang or a retry loop: TritonClient names a TLS problem only
    from a probe it starts before the deadline (each socket step bounded by the time left); past the
    deadline it raises InferenceError ("deadline exceeded") instead. No wall-clock assertion here."""
    with pytest.raises(TlsError) as err:
        asyncio.run(_infer(url, _x(1), **kw))
    return str(err.value)


def test_tls_failures_say_which_within_the_deadline(mtls_server, certs):
    url = mtls_server.grpc_url
    good, other = certs["good"], certs["other"]
    cases = {
        "plaintext": ({}, "requires TLS and this client connects in plaintext"),
        "wrong CA": ({"tls": ClientTls(other.ca, good.client_cert, good.client_key)}, "not signed by the CA this client trusts"),
        "no client certificate": ({"tls": ClientTls(good.ca)}, "requires a client certificate (mutual TLS) and this client sent none"),
        "client certificate of another CA": ({"tls": ClientTls(good.ca, other.client_cert, other.client_key)}, "refused this client's certificate"),
    }
    old_cert, old_key = issue_client_cert(good.directory, "old-client", expired=True)
    cases["expired client certificate"] = ({"tls": ClientTls(good.ca, old_cert, old_key)}, "has expired|expired on")
    for what, (kw, message) in cases.items():
        text = _tls_failure(url, **kw)
        assert any(m in text for m in message.split("|")), f"{what}: {text}"
        assert MODEL in text, f"{what}: {text}"
    # And the right certificates work.
    X = _x()
    assert asyncio.run(_infer(url, X, tls=ClientTls.from_dir(good.directory))).shape == (4, 1)


def test_tls_client_against_a_plaintext_server_says_so(plain_server, certs):
    text = _tls_failure(plain_server.grpc_url, tls=ClientTls.from_dir(certs["good"].directory))
    assert "does not speak TLS" in text and "runs in plaintext" in text and MODEL in text, text


def test_expired_server_certificate_is_refused_by_name(fraud_model, server_environment, certs):
    expired = certs["expired"]
    with LocalTriton(fraud_model[1], server_env=server_environment, tls=ServerTls.from_dir(expired.directory)) as s:
        text = _tls_failure(s.grpc_url, tls=ClientTls(expired.ca))
    assert "has expired" in text, text


def test_fraud_path_scores_exactly_the_same_over_mutual_tls(plain_server, mtls_server, feature_repo, certs, fraud_model):
    requests = demo_data.make_fraud_requests(12, seed=1234)
    txns = [{"user_id": 1 + (7 * i) % N_USERS, **{k: float(v) for k, v in requests.iloc[i].items()}} for i in range(12)]

    async def score(url: str, tls: ClientTls | None) -> list:
        async with TritonClient(url, deadline_s=DEADLINE_S, tls=tls) as triton, FeatureFetcher.from_repo(feature_repo, timeout_s=2.0) as fetcher:
            fraud = FraudService(triton, fetcher, model=MODEL)
            return [await fraud.score(t) for t in txns]

    plain = asyncio.run(score(plain_server.grpc_url, None))
    tls = asyncio.run(score(mtls_server.grpc_url, ClientTls.from_dir(certs["good"].directory)))
    assert [r.probability for r in tls] == [r.probability for r in plain]  # bit for bit
    assert [r.decision for r in tls] == [r.decision for r in plain]
    assert all(not r.degraded and r.threshold == pytest.approx(0.05) for r in tls)
    want = fraud_model[2].predict(xgb.DMatrix(np.stack([r.features for r in tls])))
    np.testing.assert_allclose([r.probability for r in tls], want, atol=1e-5)
    assert len({round(r.probability, 6) for r in tls}) > 1


# --- limits -------------------------------------------------------------------------------------------


def test_request_size_limits_are_enforced_before_sending():
    asyncio.run(_check_limits())


async def _check_limits() -> None:
    client = TritonClient("127.0.0.1:1", deadline_s=0.1)  # never contacted: the checks come first
    wide = ModelInfo("big", "1", (TensorInfo("x", "FP32", (-1, 4)),), (), max_batch_size=10 * limits.MAX_ROWS_PER_REQUEST)
    with pytest.raises(RequestValidationError, match="MAX_ROWS_PER_REQUEST") as err:
        client.check_inputs(wide, {"x": np.zeros((limits.MAX_ROWS_PER_REQUEST + 1, 4), np.float32)})
    assert err.value.field == "x"
    client.check_inputs(wide, {"x": np.zeros((limits.MAX_ROWS_PER_REQUEST, 4), np.float32)})
    flat = ModelInfo("flat", "1", (TensorInfo("x", "FP32", (-1,)),), (), max_batch_size=0)
    with pytest.raises(RequestValidationError, match="MAX_TENSOR_BYTES") as err:
        client.check_inputs(flat, {"x": np.zeros(limits.MAX_TENSOR_BYTES // 4 + 1, np.float32)})
    assert err.value.field == "x"
    with pytest.raises(RequestValidationError, match="MAX_CANDIDATES") as err:
        limits.check_candidates(limits.MAX_CANDIDATES + 1)
    assert err.value.field == "candidate_ids"
    from scorestack.client.ranking import RankingService

    with pytest.raises(RequestValidationError, match="MAX_CANDIDATES") as err:
        RankingService(client, None, max_candidates=limits.MAX_CANDIDATES + 1)  # refused before it is built
    assert err.value.field == "max_candidates"
    await client.close()


def test_triton_rows_limit_is_the_same_number():
    """Triton's own rows limit is each model's max_batch_size: a spec cannot set it above MAX_ROWS_PER_REQUEST."""
    import pydantic

    from scorestack.compile.spec import ServingSpec

    assert ServingSpec(batch_sizes=[1, limits.MAX_ROWS_PER_REQUEST]).max_batch == limits.MAX_ROWS_PER_REQUEST
    for field, kw in (("batch_sizes", {"batch_sizes": [1, limits.MAX_ROWS_PER_REQUEST + 1]}), ("max_batch_size", {"max_batch_size": limits.MAX_ROWS_PER_REQUEST + 1})):
        with pytest.raises(pydantic.ValidationError) as err:
            ServingSpec(**kw)
        assert err.value.errors()[0]["loc"][0] == field and err.value.errors()[0]["ctx"]["le"] == limits.MAX_ROWS_PER_REQUEST


# --- the key never shows: command lines, logs, reports -------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_no_command_line_log_or_report_of_scorestack_holds_the_key(fraud_model, server_environment, certs, tmp_path):
    root, _, _ = fraud_model
    repo = tmp_path / "repo"
    from scorestack.compile import compile_model

    spec1, _ = _fraud_spec(tmp_path, "k1", trees=10)
    spec2, _ = _fraud_spec(tmp_path, "k2", trees=12)
    compile_model(spec1, repo, serve_check=False)
    key = secrets.token_urlsafe(32)
    key_file = tmp_path / "admin.key"
    key_file.write_text(key)
    key_file.chmod(0o600)
    run_dirs = tmp_path / "tmp"
    run_dirs.mkdir()
    g, h, m = (str(p) for p in _free(3))
    env = dict(os.environ, TMPDIR=str(run_dirs), COLUMNS="250", SCORESTACK_KEEP_RUN_DIR="1", **{ADMIN_KEY_FILE_ENV: str(key_file)})
    env.pop(ADMIN_KEY_ENV, None)
    serve = subprocess.Popen(
        [SCORESTACK, "serve", "--repository", str(repo), "--grpc-port", g, "--http-port", h, "--metrics-port", m, "--tls-dir", str(certs["good"].directory), "--exit-timeout-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    output = ServeOutput(serve)
    try:
        assert output.wait_ready() and any("restricted" in ln and ADMIN_KEY_HEADER in ln for ln in output.lines), output.text()
        url = f"127.0.0.1:{g}"
        client_env = dict(os.environ, COLUMNS="250", **{TLS_DIR_ENV: str(certs["good"].directory)})
        client_env.pop(ADMIN_KEY_ENV, None)
        client_env.pop(ADMIN_KEY_FILE_ENV, None)
        # Without the key the hot-swap is refused, loudly; with it (from the environment) it works.
        refused = subprocess.run([SCORESTACK, "compile", str(spec2), "--repository", str(repo), "--serve-url", url, "--no-serve-check"], capture_output=True, text=True, timeout=600, env=client_env)
        assert refused.returncode != 0 and "no admin key was sent" in refused.stdout + refused.stderr, refused.stdout + refused.stderr
        # While serving: which processes hold the key in their command line?
        triton = _children(serve.pid)
        holders = {pid for pid, cmd in cmdlines().items() if key.encode() in cmd}
        swap = subprocess.run(
            [SCORESTACK, "compile", str(spec2), "--repository", str(repo), "--serve-url", url, "--force", "--no-serve-check"],
            capture_output=True, text=True, timeout=600, env=dict(client_env, **{ADMIN_KEY_ENV: key}),
        )
        assert swap.returncode == 0 and "serving fraud_tiny version" in swap.stdout, swap.stdout + swap.stderr + "\n--- serve ---\n" + output.text()
        tritonserver_env = Path(f"/proc/{triton[0]}/environ").read_bytes()
    finally:
        serve.send_signal(signal.SIGINT)
        serve_text = output.finish(60)
    # No process: tritonserver gets the key through a pipe; its command line holds a placeholder.
    assert len(triton) == 1 and holders == set(), (holders, triton)
    assert key.encode() not in tritonserver_env
    # Nothing scorestack printed or wrote (serve's and compile's output, Triton's log in the kept run
    # directory, the repository's reports) holds the key.
    texts = {"serve output": serve_text, "refused compile": refused.stdout + refused.stderr, "compile": swap.stdout + swap.stderr}
    files = [p for d in (run_dirs, repo) for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "tritonserver.log" for p in files) and any(p.name == "report.json" for p in files)
    for p in files:
        texts[str(p)] = p.read_bytes().decode(errors="replace")
    leaks = [where for where, text in texts.items() if key in text]
    assert not leaks, leaks


def _free(n: int) -> list[int]:
    from scorestack.serve.ports import free_ports

    return free_ports(n)


# --- the key through a pipe: never in tritonserver's command line or environment -------------------------


def _handoff_run(tmp_path: Path, key: AdminKey, argv_tail: list[str], *, ld_preload: str | None = None) -> subprocess.CompletedProcess:
    from scorestack.serve.security import build_key_shim, key_handoff

    shim = build_key_shim(tmp_path / "shim")
    handoff = key_handoff(["/bin/sh", "-c", 'printf "%s\\n" "$1"; tr "\\0" " " < /proc/$$/cmdline; echo; env', "sh", *argv_tail], key, shim, ld_preload=ld_preload)
    try:
        return subprocess.run(handoff.args, env=dict(os.environ, **handoff.env), pass_fds=(handoff.read_fd,), capture_output=True, text=True, timeout=30)
    finally:
        handoff.close()


def test_key_handoff_puts_the_key_into_argv_behind_the_command_line(tmp_path):
    """The preloaded library gives main() the key while /proc/<pid>/cmdline keeps the placeholder, and
    the process's children inherit neither the pipe's fd variable nor the library (the caller's LD_PRELOAD stays)."""
    key = AdminKey(secrets.token_urlsafe(32), "test")
    done = _handoff_run(tmp_path, key, [f"--grpc-restricted-protocol=trace:{ADMIN_KEY_HEADER}={key.value}"], ld_preload="libc.so.6")
    assert done.returncode == 0, done.stderr
    seen, cmdline, *env = done.stdout.splitlines()
    assert seen == f"--grpc-restricted-protocol=trace:{ADMIN_KEY_HEADER}={key.value}"  # what main() parses
    assert key.value not in cmdline and f"{ADMIN_KEY_HEADER}=scorestack-key-placeholder-" in cmdline  # what ps shows
    assert "LD_PRELOAD=libc.so.6" in env and not any(v.startswith(("SCORESTACK_ADMIN_KEY_FD=", "SCORESTACK_ADMIN_KEY_PLACEHOLDER=")) for v in env)
    # No argument to put it in: refuses to start, saying why, instead of running unrestricted.
    from scorestack.serve.security import build_key_shim, key_handoff

    with pytest.raises(AdminKeyError, match="no tritonserver argument carries the admin key"):
        key_handoff(["/bin/true"], key, build_key_shim(tmp_path / "shim"))
    handoff = key_handoff(["/bin/true", key.value], key, build_key_shim(tmp_path / "shim"))
    try:  # the library loaded, but the command it runs under holds no placeholder
        broken = subprocess.run(["/bin/true"], env=dict(os.environ, **handoff.env), pass_fds=(handoff.read_fd,), capture_output=True, text=True, timeout=30)
    finally:
        handoff.close()
    assert broken.returncode == 78 and "scorestack admin-key handoff: no argument holds the placeholder" in broken.stderr


def test_tritonserver_restricted_by_a_key_it_never_had_on_its_command_line(server_environment, tmp_path):
    """A real tritonserver, restricted through the pipe handoff: its command line and environment hold no
    key, the key opens the repository API on HTTP and gRPC, and no key or the visible placeholder do not."""
    from scorestack.serve.security import KEY_PLACEHOLDER_ENV, build_key_shim, key_handoff
    from scorestack.serve.ports import free_ports

    key = AdminKey(secrets.token_urlsafe(32), "test")
    (tmp_path / "models").mkdir()
    h, g, m = free_ports(3)
    args = [
        str(server_environment.tritonserver), f"--model-repository={tmp_path / 'models'}", "--model-control-mode=explicit",
        "--http-address=127.0.0.1", f"--http-port={h}", "--grpc-address=127.0.0.1", f"--grpc-port={g}",
        "--metrics-address=127.0.0.1", f"--metrics-port={m}", "--allow-gpu-metrics=false", *key.triton_args(),
    ]
    handoff = key_handoff(args, key, build_key_shim(tmp_path / "shim"))
    env = server_environment.launch_env()
    env.update(handoff.env)
    env.pop(ADMIN_KEY_ENV, None)
    with open(tmp_path / "tritonserver.log", "wb") as log:
        proc = subprocess.Popen(handoff.args, env=env, pass_fds=(handoff.read_fd,), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    handoff.close()
    try:
        wait_ready(h, proc, tmp_path / "tritonserver.log", grpc_port=g, metrics_port=m)
        holders = {pid for pid, cmd in cmdlines().items() if key.value.encode() in cmd}
        assert holders == set() and key.value.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert_restricted_to(key, handoff.env[KEY_PLACEHOLDER_ENV], h, g)
    finally:
        proc.terminate()
        proc.wait(30)
    assert key.value not in (tmp_path / "tritonserver.log").read_text(errors="replace")
