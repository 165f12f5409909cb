"""Start, health-check and stop a real Triton Inference Server on this machine."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from scorestack.errors import ServerError
from scorestack.serve.environment import ServerEnvironment, ensure_server_environment
from scorestack.serve.view import LocalView, build_local_view

log = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 120.0
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalTriton:
    """A real `tritonserver` serving a model repository through the local view.

    >>> with LocalTriton(repository="model_repository") as server:
    ...     client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

    Binds 127.0.0.1, picks free ports unless given, uses a per-run shared-memory prefix, waits
    for readiness within `ready_timeout_s` (raising with the log tail if it fails), and stops with
    SIGTERM, removing its shared-memory files and run directory.
    """

    def __init__(
        self,
        repository: str | os.PathLike[str],
        *,
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        models: list[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        run_dir: str | os.PathLike[str] | None = None,
        server_env: ServerEnvironment | None = None,
        log_verbose: int = 0,
    ) -> None:
        self.repository = Path(repository).resolve()
        self.host = host
        self._fixed_ports = (grpc_port, http_port, metrics_port)
        self.grpc_port = self.http_port = self.metrics_port = 0
        self.models = models
        self.cache_bytes = cache_bytes
        self.ready_timeout_s = ready_timeout_s
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else None
        self._env = server_env
        self.log_verbose = log_verbose
        self.shm_prefix = f"scorestack_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.process: subprocess.Popen[bytes] | None = None
        self.view: LocalView | None = None
        self._log_file = None

    # -- addresses ---------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        assert self.run_dir is not None
        return self.run_dir / "tritonserver.log"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalTriton":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "LocalTriton":
        env = self._env or ensure_server_environment()
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="scorestack-triton-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.view = build_local_view(self.repository, self.run_dir / "models")
        for name, reason in self.view.skipped.items():
            log.warning("model %s not served locally: %s", name, reason)
        backends = self._assemble_backends(env)
        # Free ports are picked then released: another process may take one first. Retry that
        # (and only that) with new ports, unless the caller fixed every port.
        attempts_left = 1 if all(self._fixed_ports) else 3
        while True:
            attempts_left -= 1
            self._pick_ports()
            self._launch(env, backends)
            try:
                self.wait_ready(self.ready_timeout_s)
                return self
            except ServerError:
                collided = "address already in use" in self.log_tail().lower()
                self._terminate()
                if not (collided and attempts_left > 0):
                    self._cleanup()
                    raise
                log.warning("port collision, retrying with new ports")

    def stop(self, timeout_s: float = 20.0) -> None:
        self._terminate(timeout_s)
        self._cleanup()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_running():
                code = self.process.returncode if self.process else None
                raise ServerError(
                    f"tritonserver exited with code {code} before becoming ready "
                    f"(repository {self.repository}): {self.failure_reason()}\n--- log tail ---\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.1)
        raise ServerError(
            f"tritonserver not ready within {timeout_s:.0f} s (repository {self.repository}): "
            f"{self.failure_reason()}\n"
            f"--- log tail ---\n{self.log_tail()}"
        )

    def failure_reason(self) -> str:
        """The server's own error lines (failed loads first), condensed to one paragraph."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except (OSError, AssertionError):
            return "no server log"
        picked = [ln.strip() for ln in lines if "load failed for model" in ln or ln.startswith("error:")]
        picked += [ln.strip() for ln in lines if ln.startswith("E") and ln[1:5].isdigit() and ln.strip() not in picked]
        noise = ("CUDA", "Cuda", "cuda", "NVML", "DCGM", "GPU")
        picked = [ln for ln in picked if not any(s in ln for s in noise)]
        return " | ".join(picked[:3])[:1500] or "no error line in the server log"

    def log_tail(self, n_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except (OSError, AssertionError):
            return "(no log)"
        # CUDA/NVML/DCGM complaints are harmless on a CPU machine; keep the rest.
        noise = ("CUDA", "cuda", "NVML", "nvml", "DCGM", "GPU metrics", "Pinned memory")
        useful = [ln for ln in lines if not any(s in ln for s in noise)]
        return "\n".join(useful[-n_lines:])

    # -- internals ---------------------------------------------------------------------------
    def _pick_ports(self) -> None:
        g, h, m = self._fixed_ports
        self.grpc_port = g or free_port(self.host)
        self.http_port = h or free_port(self.host)
        self.metrics_port = m or free_port(self.host)

    def _assemble_backends(self, env: ServerEnvironment) -> Path:
        # The wheel's backends/python has no stub: pair its files with the stub for this Python.
        assert self.run_dir is not None
        backend = self.run_dir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for src in (*env.python_backend_files, env.stub):
            dst = backend / src.name
            if not dst.exists():
                os.symlink(src, dst)
        return backend.parent

    def _launch(self, env: ServerEnvironment, backends: Path) -> None:
        assert self.run_dir is not None and self.view is not None
        args = [
            str(env.tritonserver),
            f"--model-repository={self.view.root}",
            f"--backend-directory={backends}",
            f"--cache-directory={env.cache_dir}",
            "--model-control-mode=explicit",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--cache-config=local,size={self.cache_bytes}",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--log-verbose={self.log_verbose}",
        ]
        names = self.models if self.models is not None else list(self.view.models)
        unknown = sorted(set(names) - set(self.view.models))
        if unknown:
            raise ServerError(f"models {unknown} are not in {self.repository} (has {sorted(self.view.models)})")
        args += [f"--load-model={n}" for n in names]
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            args,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env.launch_env(),
            cwd=self.run_dir,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it cleanly
        )

    def _terminate(self, timeout_s: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _cleanup(self) -> None:
        # A failed load can leave shared-memory regions behind: remove this run's.
        for path in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._own_run_dir and self.run_dir is not None and self.run_dir.exists():
            keep = os.environ.get("SCORESTACK_KEEP_RUN_DIR")
            if not keep:
                shutil.rmtree(self.run_dir, ignore_errors=True)
