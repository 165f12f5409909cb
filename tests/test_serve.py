"""The foundation: a real tritonserver on CPU serving an ONNX model through the local view."""

from __future__ import annotations

import asyncio
import concurrent.futures
import platform
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
import tritonclient.http as httpclient
from sklearn.ensemble import GradientBoostingClassifier
from skl2onnx import to_onnx

from scorestack.errors import ConfigError, PlatformError, ServerError
from conftest import LocalTriton, settled_statistics
from scorestack.serve import build_local_view, check_platform, ensure_server_environment
from scorestack.serve.view import render_model
from scorestack.triton_config import load_config, parse_config

N_FEATURES = 30
CONFIG = """
name: "gb"
backend: "onnxruntime"
max_batch_size: 64
input [{ name: "X" data_type: TYPE_FP32 dims: [30] }]
output [
  { name: "probabilities" data_type: TYPE_FP32 dims: [2] },
  { name: "label" data_type: TYPE_INT64 dims: [1] }
]
dynamic_batching {
  max_queue_delay_microseconds: 2000
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 5000000 allow_timeout_override: true max_queue_size: 256 }
}
instance_group [{ count: 1 kind: KIND_CPU }]
response_cache { enable: true }
"""


@pytest.fixture(scope="session")
def server_env():
    return ensure_server_environment()


@pytest.fixture(scope="module")
def onnx_repo(tmp_path_factory) -> Path:
    """A production-style repository: a scikit-learn model converted with skl2onnx, native onnxruntime backend."""
    root = tmp_path_factory.mktemp("repo")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3000, N_FEATURES)).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] * X[:, 2] > 0).astype(int)
    model = GradientBoostingClassifier(n_estimators=30, max_depth=3, random_state=0).fit(X, y)
    onx = to_onnx(model, X[:1], options={id(model): {"zipmap": False}})
    (root / "gb" / "1").mkdir(parents=True)
    (root / "gb" / "1" / "model.onnx").write_bytes(onx.SerializeToString())
    (root / "gb" / "config.pbtxt").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def server(onnx_repo, server_env):
    with LocalTriton(onnx_repo, server_env=server_env) as s:
        yield s


def _reference(repo: Path, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sess = ort.InferenceSession(str(repo / "gb" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    label, proba = sess.run(["label", "probabilities"], {"X": X})
    return proba, label


def test_server_environment_has_numpy_1(server_env):
    # The Python backend stub returns empty tensors with numpy 2: the environment must pin <2.
    out = subprocess.run([str(server_env.python), "-c", "import numpy; print(numpy.__version__)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith("1.")
    assert server_env.tritonserver.exists()


def test_grpc_and_http_outputs_equal_onnxruntime(server, onnx_repo):
    X = np.random.default_rng(1).normal(size=(17, N_FEATURES)).astype(np.float32)
    want_proba, want_label = _reference(onnx_repo, X)

    g = grpcclient.InferenceServerClient(server.grpc_url)
    gi = grpcclient.InferInput("X", list(X.shape), "FP32")
    gi.set_data_from_numpy(X)
    r = g.infer("gb", [gi], client_timeout=10)
    np.testing.assert_allclose(r.as_numpy("probabilities"), want_proba, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("label").ravel(), want_label)

    h = httpclient.InferenceServerClient(server.http_url, network_timeout=10)
    hi = httpclient.InferInput("X", list(X.shape), "FP32")
    hi.set_data_from_numpy(X, binary_data=True)
    r = h.infer("gb", [hi])
    np.testing.assert_allclose(r.as_numpy("probabilities"), want_proba, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("label").ravel(), want_label)
    # Not empty, not zeros: the numpy-2 stub trap returns the right shape and no data.
    assert r.as_numpy("probabilities").sum() == pytest.approx(len(X), rel=1e-5)


def test_local_view_keeps_the_production_contract(server):
    served = load_config(server.view.root / "gb" / "config.pbtxt")
    prod = parse_config(CONFIG)
    assert served.backend == "python" and prod.backend == "onnxruntime"
    assert served.max_batch_size == prod.max_batch_size
    assert [(t.name, t.data_type, list(t.dims)) for t in served.input] == [(t.name, t.data_type, list(t.dims)) for t in prod.input]
    assert [(t.name, t.data_type, list(t.dims)) for t in served.output] == [(t.name, t.data_type, list(t.dims)) for t in prod.output]
    assert served.dynamic_batching == prod.dynamic_batching
    assert list(served.instance_group) == list(prod.instance_group)
    assert served.response_cache.enable
    assert served.parameters["scorestack_runtime"].string_value == "onnxruntime"
    assert (server.view.root / "gb" / "1" / "model.py").exists()


def test_concurrent_requests_are_batched_with_identical_outputs(server, onnx_repo):
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(96, N_FEATURES)).astype(np.float32)
    want_proba, _ = _reference(onnx_repo, rows)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    before = g.get_inference_statistics("gb").model_stats[0]

    async def run() -> list[np.ndarray]:
        client = aiogrpc.InferenceServerClient(server.grpc_url)
        try:
            async def one(i: int) -> np.ndarray:
                inp = aiogrpc.InferInput("X", [1, N_FEATURES], "FP32")
                inp.set_data_from_numpy(rows[i : i + 1])
                res = await client.infer("gb", [inp], client_timeout=30)
                return res.as_numpy("probabilities")[0]

            return await asyncio.gather(*(one(i) for i in range(len(rows))))
        finally:
            await client.close()

    got = np.stack(asyncio.run(run()))
    np.testing.assert_allclose(got, want_proba, rtol=0, atol=1e-6)
    after = settled_statistics(g, "gb", lambda s: s.model_stats[0].inference_count >= before.inference_count + len(rows)).model_stats[0]
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    # Unique rows: the cache cannot serve them, so every one was inferred.
    assert inferences == len(rows)
    assert executions < inferences, f"no batching: {executions} executions for {inferences} inferences"


def test_response_cache_hit_and_metrics(server, onnx_repo):
    X = np.full((1, N_FEATURES), 0.25, dtype=np.float32)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("X", [1, N_FEATURES], "FP32")
    inp.set_data_from_numpy(X)
    first = g.infer("gb", [inp]).as_numpy("probabilities")
    hits_before = g.get_inference_statistics("gb").model_stats[0].inference_stats.cache_hit.count
    second = g.infer("gb", [inp]).as_numpy("probabilities")
    hits_after = settled_statistics(g, "gb", lambda s: s.model_stats[0].inference_stats.cache_hit.count > hits_before).model_stats[0].inference_stats.cache_hit.count
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(second, _reference(onnx_repo, X)[0], atol=1e-6)
    assert hits_after == hits_before + 1

    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    success = [ln for ln in text.splitlines() if ln.startswith('nv_inference_request_success{model="gb"')]
    assert success and float(success[0].rsplit(" ", 1)[1]) >= 2
    hits = [ln for ln in text.splitlines() if ln.startswith('nv_cache_num_hits_per_model{model="gb"')]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1


def test_misspelled_field_names_the_field(tmp_path):
    bad = tmp_path / "m" / "config.pbtxt"
    bad.parent.mkdir()
    bad.write_text(CONFIG.replace("max_batch_size", "max_batch_sise"))
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "max_batch_sise" in str(err.value) and str(bad) in str(err.value)
    # The local view names it the same way, before any server starts: strict refuses the
    # repository, the default leaves that model out with the reason (the others still serve).
    (bad.parent / "1").mkdir()
    with pytest.raises(ConfigError, match="max_batch_sise"):
        build_local_view(tmp_path, tmp_path / "view", strict=True)
    view = build_local_view(tmp_path, tmp_path / "view2")
    assert view.models == () and "max_batch_sise" in view.skipped["m"]


def test_a_re_render_never_leaves_the_model_folder_missing(tmp_path):
    """Triton may read the local view while the watcher re-renders a model (a client's hot-swap
    racing the watcher; seen in CI: the stub found model.py gone and the load hung). The rendered
    folder is swapped in atomically, so a reader polling it never finds it missing, and the previous
    render is kept beside the view for a load still reading it."""
    model = tmp_path / "repo" / "gb"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.onnx").write_bytes(b"not read by the view")
    view = tmp_path / "view"
    view.mkdir()
    assert render_model(model, view) is None
    missing, stop = [], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            if not (view / "gb" / "1" / "model.py").exists():
                missing.append(1)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for _ in range(300):
            assert render_model(model, view) is None
    finally:
        stop.set()
        reader.join()
    assert not missing, f"the model folder was missing {len(missing)} times"
    assert (tmp_path / "view.previous" / "gb" / "1" / "model.py").exists()
    assert sorted(p.name for p in view.iterdir()) == ["gb"]  # nothing else for Triton to list


def test_bad_enum_and_wrong_type_are_named():
    with pytest.raises(ConfigError, match="TYPE_FLOAT32"):
        parse_config(CONFIG.replace("TYPE_FP32", "TYPE_FLOAT32"))
    with pytest.raises(ConfigError, match="max_batch_size"):
        parse_config(CONFIG.replace("max_batch_size: 64", 'max_batch_size: "lots"'))


def test_two_servers_at_once(onnx_repo, server_env):
    X = np.random.default_rng(3).normal(size=(4, N_FEATURES)).astype(np.float32)
    want, _ = _reference(onnx_repo, X)

    def serve_once() -> tuple[np.ndarray, tuple[int, int, int], str]:
        with LocalTriton(onnx_repo, server_env=server_env) as s:
            c = grpcclient.InferenceServerClient(s.grpc_url)
            inp = grpcclient.InferInput("X", list(X.shape), "FP32")
            inp.set_data_from_numpy(X)
            return c.infer("gb", [inp]).as_numpy("probabilities"), (s.grpc_port, s.http_port, s.metrics_port), s.shm_prefix

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: serve_once(), range(2))
    np.testing.assert_allclose(a[0], want, atol=1e-6)
    np.testing.assert_allclose(b[0], want, atol=1e-6)
    assert set(a[1]).isdisjoint(b[1]) and a[2] != b[2]
    assert not list(Path("/dev/shm").glob(f"{a[2]}*")) and not list(Path("/dev/shm").glob(f"{b[2]}*"))


def _threads_cpus(pid: int) -> dict[str, str]:
    """Cpus_allowed_list of every thread of `pid` and of its child processes (the backend stubs)."""
    out: dict[str, str] = {}
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(c) for c in children.read_text().split()]
    for p in pids:
        for task in Path(f"/proc/{p}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    out[f"{p}/{task.name}"] = line.split(":", 1)[1].strip()
    return out


def test_server_confined_to_its_cpus(onnx_repo, server_env):
    import os

    mine = sorted(os.sched_getaffinity(0))
    chosen = mine[-1]  # on a machine of one CPU this is the same set, and still must hold
    X = np.random.default_rng(4).normal(size=(5, N_FEATURES)).astype(np.float32)
    want, _ = _reference(onnx_repo, X)
    with LocalTriton(onnx_repo, server_env=server_env, cpus=str(chosen)) as s:
        placement = _threads_cpus(s.process.pid)
        c = grpcclient.InferenceServerClient(s.grpc_url)
        inp = grpcclient.InferInput("X", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        got = c.infer("gb", [inp]).as_numpy("probabilities")
    assert len(placement) > 5  # tritonserver's threads, not just its main one
    assert set(placement.values()) == {str(chosen)}, placement
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert sorted(os.sched_getaffinity(0)) == mine  # this process keeps its own CPUs


@pytest.mark.parametrize(
    ("cpus", "match"),
    [("", "cpus: empty"), ("one", "not a CPU list"), ("3-1", "not a CPU list"), ("4096", "not available to this process"), ([], "cpus: empty")],
)
def test_bad_cpus_are_named(onnx_repo, cpus, match):
    with pytest.raises(ConfigError, match=match):
        LocalTriton(onnx_repo, cpus=cpus)


def test_cpu_lists_parse():
    from scorestack.serve.supervise import parse_cpus
    import os

    first = min(os.sched_getaffinity(0))
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus([first]) == {first}
    assert parse_cpus(f"{first}-{first}, {first}") == {first}


def test_ready_means_every_endpoint_answers_and_a_taken_metrics_port_is_retried(onnx_repo, server_env, monkeypatch):
    """Triton binds gRPC, then HTTP, then metrics last, and dies when the metrics port is taken: ready
    is every endpoint answering, so a start that returned has a metrics port that answers. The port
    is really held by another socket; the patch only makes the port picker hand out that port, as a race
    with another process would."""
    from scorestack.serve.ports import PortReservation, free_ports
    from scorestack.serve.readiness import http_ok, port_open

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # Every port fixed: no new ports to try, and the error names the collision.
        g, h = free_ports(2, exclude=[taken])
        fixed = LocalTriton(onnx_repo, server_env=server_env, grpc_port=g, http_port=h, metrics_port=taken)
        with pytest.raises(ServerError, match=f"Socket '127.0.0.1:{taken}' already in use") as err:
            fixed.start()
        assert "exited with code" in str(err.value) and not fixed.is_running()
        # Picked ports: the first pick hands out the held one for metrics; start() retries on new ports.
        real = PortReservation.take
        picks: list[list[int]] = []

        def take(n, host="127.0.0.1", **kw):
            got = real(n, host, **kw)
            if not picks:
                got.ports[-1] = taken
            picks.append(list(got.ports))
            return got

        monkeypatch.setattr(PortReservation, "take", take)
        with LocalTriton(onnx_repo, server_env=server_env) as s:
            assert len(picks) == 2 and picks[0][-1] == taken and s.metrics_port != taken, picks
            assert port_open(s.host, s.grpc_port) is None
            assert http_ok(f"http://{s.http_url}/v2/health/ready") is None
            assert http_ok(s.metrics_url) is None
            with urllib.request.urlopen(s.metrics_url, timeout=5) as r:
                assert b"nv_inference_request_success" in r.read()
            assert s.is_ready()


def test_ports_reserved_by_one_process_are_refused_to_another_until_released():
    """Two scorestack processes starting servers at once must not pick the same port (Triton's
    metrics endpoint would even share it): a reserved port's lock is refused to another process."""
    import json
    import sys

    from scorestack.serve.ports import PortReservation

    probe = (
        "import fcntl, json, os, sys\n"
        "from scorestack.serve.ports import PortReservation\n"
        "got = []\n"
        "for port in json.loads(sys.argv[1]):\n"
        "    fd = os.open(PortReservation.directory() / str(port), os.O_RDWR)\n"
        "    try:\n"
        "        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); got.append(port)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(json.dumps(got))\n"
    )
    reservation = PortReservation.take(3)
    ports = reservation.ports
    assert len(set(ports)) == 3
    held = subprocess.run([sys.executable, "-c", probe, json.dumps(ports)], capture_output=True, text=True, check=True)
    assert json.loads(held.stdout) == []
    reservation.release()
    free = subprocess.run([sys.executable, "-c", probe, json.dumps(ports)], capture_output=True, text=True, check=True)
    assert json.loads(free.stdout) == ports


def test_failed_start_reports_why(tmp_path, server_env, onnx_repo):
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    (repo / "broken" / "config.pbtxt").write_text(CONFIG.replace('name: "gb"', 'name: "broken"'))
    server = LocalTriton(repo, server_env=server_env, ready_timeout_s=60)
    with pytest.raises(ServerError) as err:
        server.start()
    message = str(err.value)
    assert "load failed for model 'broken'" in message and "log tail" in message
    assert not server.is_running()
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_unsupported_platform_points_to_docker_compose(monkeypatch):
    # A fault that cannot be produced for real on this machine: pretend to be macOS on arm64.
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    with pytest.raises(PlatformError, match="docker"):
        check_platform()


def test_serve_command_runs_until_ctrl_c(onnx_repo, server_env, tmp_path):
    import os
    import re
    import signal
    import sys
    import time

    exe = Path(sys.executable).parent / "scorestack"
    env = dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="200")
    proc = subprocess.Popen([str(exe), "serve", "--repository", str(onnx_repo)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        grpc = None
        while time.monotonic() < deadline and grpc is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"gRPC\s+(127\.0\.0\.1:\d+)", line)
            grpc = m.group(1) if m else None
        assert grpc, "".join(lines)
        X = np.random.default_rng(4).normal(size=(2, N_FEATURES)).astype(np.float32)
        c = grpcclient.InferenceServerClient(grpc)
        inp = grpcclient.InferInput("X", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        np.testing.assert_allclose(c.infer("gb", [inp]).as_numpy("probabilities"), _reference(onnx_repo, X)[0], atol=1e-6)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopped" in out
    assert not list(tmp_path.glob("scorestack-triton-*"))  # run directory removed
    assert _server_gone(c)


def _server_gone(client) -> bool:
    try:
        client.is_server_live(client_timeout=1)
        return False
    except Exception:  # any failure to reach it means it is gone
        return True


def _picky_onnx() -> bytes:
    """Y = X for X of shape [n, 5], but only when 5n is divisible by 3 (a Reshape to [-1, 3] inside)."""
    from onnx import TensorProto, helper

    shape3 = helper.make_tensor("shape3", TensorProto.INT64, [2], [-1, 3])
    shape5 = helper.make_tensor("shape5", TensorProto.INT64, [2], [-1, 5])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["X", "shape3"], ["T"]), helper.make_node("Reshape", ["T", "shape5"], ["Y"])],
        "picky",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 5])],
        initializer=[shape3, shape5],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_runtime_reports_failures_per_request(tmp_path, server_env):
    # A batch that fails as a whole is retried request by request: good requests still succeed,
    # and each failing one gets its own error naming the model.
    repo = tmp_path / "repo"
    (repo / "picky" / "1").mkdir(parents=True)
    (repo / "picky" / "1" / "model.onnx").write_bytes(_picky_onnx())
    (repo / "picky" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 16\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [5] }]\noutput [{ name: "Y" data_type: TYPE_FP32 dims: [5] }]\n'
        "dynamic_batching { max_queue_delay_microseconds: 50000 }\n"
    )
    with LocalTriton(repo, server_env=server_env) as server:
        good = [np.arange(15, dtype=np.float32).reshape(3, 5) + i for i in range(3)]
        bad = np.ones((1, 5), dtype=np.float32)

        async def run():
            client = aiogrpc.InferenceServerClient(server.grpc_url)
            try:
                async def one(x):
                    inp = aiogrpc.InferInput("X", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x)
                    try:
                        return (await client.infer("picky", [inp], client_timeout=30)).as_numpy("Y")
                    except Exception as exc:  # the error is what we check
                        return exc

                return await asyncio.gather(*(one(x) for x in [*good, bad]))
            finally:
                await client.close()

        results = asyncio.run(run())
        g = grpcclient.InferenceServerClient(server.grpc_url)
        # Read once the good requests' rows are counted (CI read 0 and 0 right after the replies).
        rows = sum(len(x) for x in good)
        stats = settled_statistics(g, "picky", lambda s: s.model_stats[0].inference_count >= rows).model_stats[0]
    for x, y in zip(good, results[:3]):
        np.testing.assert_array_equal(y, x)
    assert isinstance(results[3], Exception)
    assert "model picky" in str(results[3]) and "Reshape" in str(results[3])
    # The 50 ms queue delay joined them into one execution, which failed and was split.
    assert stats.execution_count < stats.inference_count


def test_client_raises_queue_rejections_without_retrying(onnx_repo, tmp_path, server_env):
    # Triton answers UNAVAILABLE both when it is down and when its queue policy rejects: only the
    # first is retried. Here every request waits for a 200 ms batch that never fills, past a 1 us
    # queue timeout, so the server rejects it for real.
    import shutil
    import time

    from scorestack.client.triton import TritonClient
    from scorestack.errors import OverloadedError

    repo = tmp_path / "repo"
    shutil.copytree(onnx_repo, repo)
    config = CONFIG.replace("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 200000 preferred_batch_size: [64]")
    config = config.replace("default_timeout_microseconds: 5000000", "default_timeout_microseconds: 1")
    config = config.replace("response_cache { enable: true }", "")
    (repo / "gb" / "config.pbtxt").write_text(config)
    X = np.random.default_rng(5).normal(size=(2, N_FEATURES)).astype(np.float32)

    async def run(url: str):
        client = TritonClient(url, deadline_s=5.0)
        try:
            start = time.monotonic()
            with pytest.raises(OverloadedError, match="model 'gb': rejected by Triton's queue policy") as err:
                await client.infer("gb", {"X": X})
            rejected_after = time.monotonic() - start
            return err.value, rejected_after, await client.is_ready()
        finally:
            await client.close()

    with LocalTriton(repo, server_env=server_env) as server:
        err, rejected_after, ready = asyncio.run(run(server.grpc_url))
        stats = settled_statistics(grpcclient.InferenceServerClient(server.grpc_url), "gb", lambda s: s.model_stats[0].inference_stats.fail.count >= 1).model_stats[0]
    assert "Request timeout expired" in str(err)
    # One attempt, not retries until the 5 s deadline: Triton saw exactly one request, and failed it.
    assert stats.inference_stats.fail.count == 1 and stats.inference_stats.success.count == 0
    assert rejected_after < 2.5 and ready
