"""The peer servers, each a real process of its own serving the same fraud model: scorestack's Triton
(derived batching, no batching, Python backend, the response-cache floor), MLServer, FastAPI and
BentoML. docs/benchmarks.md ("The peers") lists each configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import harness
from peers.model import FraudModel
from scorestack.errors import ServerError
from scorestack.serve.ports import free_port
from scorestack.serve.readiness import all_of, http_ok, port_open, process_exit, wait_until

HERE = Path(__file__).resolve().parent


@dataclass
class Peer:
    """A started server: where to send, which processes to charge CPU to, how it was set up."""

    name: str
    protocol: str  # grpc | http
    address: str
    model: str  # gRPC model name or HTTP path
    input_name: str
    description: str
    config: dict
    versions: dict
    pids: Callable[[], list[int]]
    stop: Callable[[], None]
    stats: Callable[[], dict | None] = field(default=lambda: None)  # executions / inferences so far (Triton)
    http_address: str = ""  # Triton: its HTTP endpoint beside the gRPC one
    output_name: str = ""


def _wait_ready(probe, proc: subprocess.Popen, timeout_s: float, what: str, log: Path) -> None:
    """Bounded wait for a peer (scorestack.serve.readiness); the log's tail when it exits or never answers."""
    try:
        wait_until(probe, timeout_s=timeout_s, what=what, died=process_exit(proc))
    except ServerError as exc:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{exc}; log {log}:\n{tail}") from None


def _launch(cmd: list[str], logf: Path, probe, timeout_s: float, what: str, **popen: object) -> subprocess.Popen:
    """Start a peer in its own session, output to `logf`, and wait until `probe` passes (stopped again if it never does)."""
    with open(logf, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        _wait_ready(probe, proc, timeout_s, what, logf)
    except Exception:
        _stop_proc(proc)
        raise
    return proc


def _tree_pids(proc: subprocess.Popen) -> Callable[[], list[int]]:
    """A supervisor's pid and its workers' (uvicorn's, bentoml's): the process tree charged with the server's CPU."""
    return lambda: [p.pid for p in harness.tree(proc.pid)] or [proc.pid]


def _stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _pkg_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


# -- Triton variants -------------------------------------------------------------------------------
def triton_variants(model: FraudModel, root: Path) -> dict[str, Path]:
    """A repository per variant: the compiled folder as is, without dynamic batching, through the Python
    backend (when the compiled config names scorestack's native backend), with the response cache."""
    from scorestack.triton_config import load_config, write_config

    out = {}
    native = load_config(model.model_dir / "config.pbtxt").backend == "scorestack"
    # "python": the same folder through the Python backend, when the compiled one is on the native backend.
    for variant in ("batching", "nobatch", "python", "cache") if native else ("batching", "nobatch", "cache"):
        repo = root / f"repo_{variant}"
        if repo.exists():
            shutil.rmtree(repo)
        name = "fraud_xgb" if variant == "batching" else f"fraud_xgb_{variant}"
        dest = repo / name
        # The latest version only: the model folder keeps the previous one too, which the current
        # config (its dispatch table may name artifacts only the new version has) need not fit.
        latest = max((p for p in model.model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        dest.mkdir(parents=True)
        shutil.copy(model.model_dir / "config.pbtxt", dest / "config.pbtxt")
        shutil.copytree(latest, dest / latest.name, symlinks=False)
        cfg = load_config(dest / "config.pbtxt")
        cfg.name = name
        if variant == "nobatch":
            cfg.ClearField("dynamic_batching")
        elif variant == "python":
            cfg.backend = "python"  # the local view runs the same parameters through the model runtime
        elif variant == "cache":
            cfg.response_cache.enable = True
        write_config(cfg, dest / "config.pbtxt")
        out[variant] = dest
    return out


def start_triton(name: str, model_dir: Path, description: str) -> Peer:
    from scorestack.serve import LocalTriton
    from scorestack.triton_config import format_config, load_config

    server = LocalTriton(model_dir.parent, models=[model_dir.name], strict=True, exit_timeout_s=0)
    server.start()
    meta = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2", timeout=5).read())
    cfg = load_config(model_dir / "config.pbtxt")
    batching = format_config(cfg).split("dynamic_batching", 1)
    summary = {
        "server": "tritonserver (local view, " + ("scorestack's native backend" if cfg.backend == "scorestack" else "Python backend") + " running the compiled artifact)",
        "max_batch_size": cfg.max_batch_size,
        "instances": [f"{g.count} x {model_config_kind(g.kind)}" for g in cfg.instance_group],
        "dynamic_batching": ("dynamic_batching" + batching[1].split("\n}\n", 1)[0] + "\n}") if len(batching) > 1 else None,
        "response_cache": bool(cfg.response_cache.enable),
        "scorestack_parameters": {k: v.string_value for k, v in cfg.parameters.items() if k != "scorestack_dispatch"},
        "dispatch": json.loads(cfg.parameters["scorestack_dispatch"].string_value) if "scorestack_dispatch" in cfg.parameters else None,
    }

    def stats() -> dict | None:
        try:
            body = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model_dir.name}/stats", timeout=5).read())
        except OSError:
            return None
        s = body["model_stats"][0]
        st = s["inference_stats"]

        def get(k: str, f: str) -> int:
            return int(st.get(k, {}).get(f, 0))

        return {"inferences": int(s.get("inference_count", 0)), "executions": int(s.get("execution_count", 0)),
                "cache_hits": get("cache_hit", "count"), "success": get("success", "count"), "success_ns": get("success", "ns"),
                "fail": get("fail", "count"), "queue": get("queue", "count"), "queue_ns": get("queue", "ns")}

    return Peer(
        name=name, protocol="grpc", address=server.grpc_url, model=model_dir.name, input_name="features", description=description,
        config=summary, versions={"triton": meta.get("version"), "server_environment": _server_env_versions()},
        pids=lambda: [server.process.pid] if server.process is not None else [], stop=server.stop, stats=stats,
        http_address=server.http_url, output_name=cfg.output[0].name,
    )


def model_config_kind(kind: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.ModelInstanceGroup.Kind.Name(kind)


def _server_env_versions() -> dict:
    from scorestack.serve import ensure_server_environment

    env = ensure_server_environment()
    code = ("import json\nfrom importlib import metadata as m\nout={}\n"
            "for p in ('numpy','onnxruntime','xgboost','xgboost-cpu','nvidia-pytriton'):\n"
            "    try: out[p]=m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    res = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, timeout=60)
    return json.loads(res.stdout) if res.returncode == 0 else {}


# -- MLServer --------------------------------------------------------------------------------------
def start_mlserver(model: FraudModel, run_dir: Path, max_batch_size: int, max_batch_time_us: int, log=print) -> Peer:
    from peers.envs import MLSERVER_REPORTED, mlserver_env

    env = mlserver_env(log=log)
    run_dir.mkdir(parents=True, exist_ok=True)
    from scorestack.serve.server import free_ports

    ports = dict(zip(("http_port", "grpc_port", "metrics_port"), free_ports(3)))
    settings = (HERE / "mlserver" / "settings.json").read_text()
    for k, v in ports.items():
        settings = settings.replace("{" + k + "}", str(v))
    (run_dir / "settings.json").write_text(settings)
    mdir = run_dir / "fraud_xgb"
    mdir.mkdir(exist_ok=True)
    shutil.copy(model.xgb_json, mdir / "fraud_xgb.json")
    ms = (HERE / "mlserver" / "model-settings.json").read_text()
    values = {"name": "fraud_xgb", "uri": "./fraud_xgb.json", "max_batch_size": str(max_batch_size), "max_batch_time_s": f"{max_batch_time_us / 1e6:.6f}"}
    for k, v in values.items():
        ms = ms.replace("{" + k + "}", v)
    (mdir / "model-settings.json").write_text(ms)
    logf = run_dir / "mlserver.log"
    # One OpenMP thread per XGBoost call, as scorestack's compiled model and the FastAPI peers.
    penv = {**os.environ, "PATH": f"{env.bin}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    penv.pop("PYTHONPATH", None)
    ready = all_of(lambda: port_open("127.0.0.1", ports["grpc_port"]), lambda: http_ok(f"http://127.0.0.1:{ports['http_port']}/v2/models/fraud_xgb/ready"))
    proc = _launch([str(env.bin / "mlserver"), "start", str(run_dir)], logf, ready, 120, "mlserver model fraud_xgb", cwd=run_dir, env=penv)
    return Peer(
        name="mlserver", protocol="grpc", address=f"127.0.0.1:{ports['grpc_port']}", model="fraud_xgb", input_name="features",
        description="MLServer + mlserver-xgboost, adaptive batching, KServe v2 gRPC",
        config={"settings.json": json.loads(settings), "model-settings.json": json.loads(ms), "venv": str(env.root),
                "environment": {"OMP_NUM_THREADS": "1"}, "command": "mlserver start <run dir>"},
        versions=env.versions(MLSERVER_REPORTED), pids=lambda: [proc.pid], stop=lambda: _stop_proc(proc),
    )


# -- FastAPI ---------------------------------------------------------------------------------------
def start_fastapi(runtime: str, model: FraudModel, run_dir: Path, threads: int = 1, endpoint: str = "async", workers: int = 1) -> Peer:
    """FastAPI + uvicorn serving the fraud model (benchmarks/peers/fastapi_app.py): `endpoint` "async"
    (the strongest honest configuration) or "sync" (pydantic models, run in Starlette's threadpool)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = model.xgb_json if runtime == "xgboost" else model.onnx
    cmd = [sys.executable, str(HERE / "fastapi_app.py"), "--runtime", runtime, "--model", str(path), "--features",
           str(len(model.features)), "--threads", str(threads), "--endpoint", endpoint, "--workers", str(workers), "--port", str(port)]
    logf = run_dir / f"fastapi_{runtime}_{endpoint}_w{workers}.log"
    proc = _launch(cmd, logf, lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, f"fastapi ({runtime}, {endpoint}, {workers} workers)")
    lib = "xgboost-cpu" if runtime == "xgboost" else "onnxruntime"
    call = f"Booster.inplace_predict, nthread={threads}" if runtime == "xgboost" else f"InferenceSession.run (CPUExecutionProvider), intra_op_num_threads={threads}, inter_op_num_threads=1"
    style = ("async def endpoint, body parsed with json.loads, model called on the event loop, plain dict returned" if endpoint == "async"
             else "def endpoint with pydantic request/response models (run in Starlette's threadpool)")
    name = f"fastapi_{runtime}" + ("_sync" if endpoint == "sync" else "") + (f"_w{workers}" if workers > 1 else "")

    return Peer(
        name=name, protocol="http", address=f"127.0.0.1:{port}", model="/predict", input_name="features",
        description=f"FastAPI + uvicorn ({workers} worker{'s' if workers > 1 else ''}, uvloop + httptools), {endpoint} endpoint, "
        f"{'XGBoost' if runtime == 'xgboost' else 'onnxruntime'} per request, HTTP/1.1 JSON",
        config={"command": " ".join(Path(c).name if c.startswith("/") else c for c in cmd[1:]), "workers": workers, "access_log": False,
                "loop": "uvloop", "http": "httptools", "model": Path(path).name, "runtime_options": call, "endpoint": style,
                "request": 'POST /predict {"features": [30 floats]} -> {"probability": p}'},
        versions=_pkg_versions(("fastapi", "uvicorn", "pydantic", "uvloop", "httptools", lib, "numpy")),
        pids=_tree_pids(proc), stop=lambda: _stop_proc(proc),
    )


# -- BentoML ---------------------------------------------------------------------------------------
def start_bentoml(model: FraudModel, run_dir: Path, log=print) -> Peer:
    """`bentoml serve` of peers/bentoml_service.py (1 worker, async API, onnxruntime with 1 thread) in its own venv."""
    from peers.envs import BENTOML_REPORTED, bentoml_env

    env = bentoml_env(log=log)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    logf = run_dir / "bentoml.log"
    penv = {**os.environ, "SCORESTACK_BENTO_MODEL": str(model.onnx), "BENTOML_HOME": str(run_dir / "bentoml_home"), "OMP_NUM_THREADS": "1"}
    penv.pop("PYTHONPATH", None)
    cmd = [str(env.bin / "bentoml"), "serve", "bentoml_service:Fraud", "--host", "127.0.0.1", "--port", str(port)]
    proc = _launch(cmd, logf, lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), 120, "bentoml service Fraud", cwd=HERE, env=penv)

    return Peer(
        name="bentoml", protocol="http", address=f"127.0.0.1:{port}", model="/predict", input_name="features",
        description="BentoML service (1 worker), async API, onnxruntime (1 intra-op thread) on the event loop, HTTP/1.1 JSON",
        config={"command": "bentoml serve bentoml_service:Fraud", "service": "benchmarks/peers/bentoml_service.py", "workers": 1,
                "request": 'POST /predict {"features": [30 floats]} -> {"probability": p}'},
        versions=env.versions(BENTOML_REPORTED), pids=_tree_pids(proc), stop=lambda: _stop_proc(proc),
    )


def tmp_run_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
