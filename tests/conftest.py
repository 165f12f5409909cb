"""Shared fixtures: the real services every test talks to.

A missing service fails the test with what to install or start: nothing is skipped, here or in
CI, so a green run never hides an untested capability. `./scripts/test.sh` starts a local Redis
when none answers and the `redis-server` binary exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from scorestack.serve import server as _server
from scorestack.serve.ports import free_port
from scorestack.serve.readiness import port_open, process_exit, wait_until



# Modules in the order the parallel run should start them: scripts/test.sh runs two workers, each
# taking a whole module at a time (--dist loadfile, so a module's servers and fixtures stay in one
# process); the run ends when its last module does, so the long ones (marked slow) go first.
_SLOW_FIRST = ("test_demo", "test_soak", "test_verified_served", "test_vision")


def pytest_collection_modifyitems(config, items):
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        name = item.module.__name__
        return _SLOW_FIRST.index(name) if name in _SLOW_FIRST else len(_SLOW_FIRST) + (name not in slow)

    items.sort(key=rank)  # stable: tests keep their order inside a module


class LocalTriton(_server.LocalTriton):
    """The real LocalTriton, stopped without a drain: a test stops its server only after its own
    requests are answered, so nothing is in flight and Triton's 1-6 s wait for its models to unload
    buys nothing (exit_timeout_s=0). `scorestack serve`, started by tests as a command, keeps the
    default drain."""

    def __init__(self, *args, exit_timeout_s: int = 0, **kwargs) -> None:
        super().__init__(*args, exit_timeout_s=exit_timeout_s, **kwargs)


def settled(read, counted, timeout_s: float = 10.0):
    """Re-read (`read()`) until `counted(reading)` holds or `timeout_s` passes; the last reading either way,
    for the caller's own assertion. The synchronous twin of `scorestack.client.server_stats.settled`:
    Triton's backends report a request's statistics after sending its response, so a count read right
    after the reply can still miss it (CI saw 9 of 10 executions, and 401 of 400 served)."""
    deadline = time.monotonic() + timeout_s
    reading = read()
    while not counted(reading) and time.monotonic() < deadline:
        time.sleep(0.02)
        reading = read()
    return reading


def settled_statistics(client, model: str, counted, timeout_s: float = 10.0, **kwargs):
    """`model`'s statistics from a tritonclient client (`kwargs`: e.g. as_json=True), once `counted(stats)` holds."""
    return settled(lambda: client.get_inference_statistics(model, client_timeout=5, **kwargs), counted, timeout_s)


def require(reason: str) -> None:
    """A required service is missing: fail, saying what is missing and how to provide it."""
    pytest.fail(f"required service missing: {reason}")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The machine's Redis at 127.0.0.1:6379 (REDIS_URL overrides), or none: skip/fail."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    import redis

    try:
        redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping()
        return url
    except Exception as exc:  # any failure means "not reachable"
        require(f"Redis not reachable at {url}: {exc}; start one (redis-server --daemonize yes) or set REDIS_URL")
    raise AssertionError("unreachable")


class RedisProcess:
    """A private redis-server on a free port, for tests that stop or pause Redis."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            require("redis-server binary not found (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open("127.0.0.1", self.port), timeout_s=10, what=f"redis-server on port {self.port}", died=process_exit(self.proc))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path):
    """A redis-server of the test's own, which the test may stop, restart or pause."""
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


class ServeOutput:
    """Reads a `scorestack serve` process's merged output in a thread, to the end.

    A test that stops reading once the server is ready lets the pipe fill, and the server's later
    log lines (a hot-swap's "reloaded", a failed sync's traceback) would then block its repository
    watcher. Draining keeps the server unblocked and keeps every line for assertion messages.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Ctrl-C to stop" in line:
                self._ready.set()
        self._ready.set()  # ended: wait_ready() sees whether it was ready

    def wait_ready(self, timeout_s: float = 180) -> bool:
        self._ready.wait(timeout_s)
        return any("Ctrl-C to stop" in ln for ln in self.lines)

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout_s: float = 60) -> str:
        """Wait for the process to end (after the test stopped it) and return everything it printed."""
        self.proc.wait(timeout_s)
        self._thread.join(10)
        return self.text()


@pytest.fixture(scope="session")
def compiled_demo(tmp_path_factory):
    """The demo models (real sizes), trained and compiled once per test run, shared by the workers.

    Under pytest-xdist every worker is its own session: the first worker to ask trains and compiles into
    the run's shared temporary folder under a file lock; the others wait for it, then find the models
    there and every spec unchanged (train_demo_models keeps existing models, compile_model returns the
    report of an unchanged spec without compiling again). Tests copy what they change (the folder is
    shared). Returns (models_dir, repository, {name: spec_path}, {name: CompileReport}).
    """
    import fcntl

    from scorestack.compile import compile_model
    from scorestack.demo.train import train_demo_models

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the run's folder above each worker's
    root = shared / "compiled_demo"
    root.mkdir(parents=True, exist_ok=True)
    with open(shared / "compiled_demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, whatever happens inside
        # One training thread: the other worker runs on the other core (two threads here ran several times slower).
        specs = {p.stem: p for p in train_demo_models(root / "models", threads=1)}
        repository = root / "model_repository"
        reports = {name: compile_model(specs[name], repository) for name in ("fraud_xgb", "ranking_xgb", "fraud_sklearn")}
    return root / "models", repository, specs, reports


@pytest.fixture(scope="session")
def server_environment():
    from scorestack.serve import ensure_server_environment

    return ensure_server_environment()


def user_feature_repo(root: Path, definitions: str, online_store: str, project: str, offline: dict) -> "feast.FeatureStore":  # noqa: F821
    """A Feast repository as a team writes its own: `definitions` (Python, `{data}` standing for the data folder)
    in `root`, a feature_store.yaml with `online_store` (its YAML block), `offline` ({file name: DataFrame}) as the
    parquet sources, and every Entity, DataSource, FeatureView, OnDemandFeatureView and FeatureService applied."""
    import importlib.util
    import sys
    import uuid

    import feast
    from feast import Entity, FeatureService, FeatureView, OnDemandFeatureView
    from feast.data_source import DataSource

    data = root / "data"
    data.mkdir(parents=True)
    (root / "definitions.py").write_text(definitions.format(data=str(data)))
    (root / "feature_store.yaml").write_text(
        f"project: {project}\nprovider: local\nregistry: {data}/registry.db\n{online_store}"
        "offline_store:\n  type: file\nentity_key_serialization_version: 3\n"
    )
    for name, frame in offline.items():
        frame.to_parquet(data / name)
    name = f"_user_repo_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, root / "definitions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the transformations' module must stay importable for Feast's dill
    spec.loader.exec_module(module)
    kinds = (Entity, DataSource, FeatureView, OnDemandFeatureView, FeatureService)
    fs = feast.FeatureStore(repo_path=str(root))
    fs.apply([v for v in vars(module).values() if isinstance(v, kinds)])
    return fs
