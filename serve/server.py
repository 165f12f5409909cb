"""Start, health-check and stop a real Triton Inference Server on this machine.

`LocalTriton` is the launcher: it composes the parts of a server's life that live beside it in
serve/: its process as scorestack's child (supervise.py: leftovers, parent-death, CPU set), its
ports (ports.py), the local view it serves (view.py), readiness (readiness.py), admin calls
(admin.py) and hot swap (reload.py).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Collection

from scorestack import GRPC_CLIENT_EXPERIMENTS
from scorestack.errors import ConfigError, ServerError
from scorestack.serve.admin import ModelStatus, TritonAdmin, first_line
from scorestack.serve.environment import ServerEnvironment, ensure_server_environment

# The benchmarks still import free_port and free_ports from here (serve.ports is their home).
from scorestack.serve.ports import PortReservation, free_port, free_ports
from scorestack.serve.readiness import triton_endpoints, wait_until
from scorestack.serve.reload import RepositoryWatcher, fingerprint
from scorestack.serve.security import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, RESTRICTED_APIS, AdminKey, ServerTls, build_key_shim, is_loopback, key_handoff
from scorestack.serve.supervise import SUPERVISOR_ENV, child_setup, clean_leftovers, parse_cpus, supervisor_tag
from scorestack.serve.view import LocalView, build_local_view

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_EXIT_TIMEOUT_S", "DEFAULT_READY_TIMEOUT_S", "LocalTriton", "ModelStatus", "free_port", "free_ports"]

log = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 120.0
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# Triton's own default: at stop, wait up to this long for in-flight requests (then for its models
# to unload, which it checks once a second: 1-6 s per stop measured here even with nothing in flight).
DEFAULT_EXIT_TIMEOUT_S = 30
# How often Triton samples its CPU metrics; its stop waits for that thread's current sleep (Triton's
# 2000 ms default cost ~0.9 s per stop here). Counters of requests are updated per request regardless.
METRICS_INTERVAL_MS = 250


class LocalTriton:
    """A real `tritonserver` serving a model repository through the local view.

    >>> with LocalTriton(repository="model_repository") as server:
    ...     client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

    Binds 127.0.0.1, picks free ports unless given, uses a per-run shared-memory prefix, waits
    for readiness within `ready_timeout_s`, and stops with SIGTERM, removing its shared-memory files
    and run directory.

    A model that fails to load does not stop the others: it is reported in `model_status` with
    Triton's reason, and start() raises only if no model loads (`strict=True`: if any fails).
    tritonserver dies with the process that started it (parent-death signal; started from the main
    thread), and orphans of a supervisor that was killed are stopped at the next start.
    With `watch_interval_s`, changes in the repository (a new version, a new model) are rendered
    and loaded while serving (`sync()`), which is how a recompiled model is hot-swapped.

    `exit_timeout_s` is how long stop() lets in-flight requests finish (Triton's --exit-timeout-secs,
    default 30 s, after which it also waits for its models to unload). A caller that stops the server
    only after its own requests are answered (the compiler's serving check, the demo, the benchmarks,
    the tests) passes 0: the server then stops in tens of milliseconds instead of 1-6 s, and its Python
    backend stubs exit on their own when they see it gone.

    With `admin_key`, Triton's model-repository, shared-memory, statistics, trace and logging APIs
    (serve.security.RESTRICTED_APIS) answer only calls carrying the key's header, on gRPC and HTTP;
    this object's own admin calls send it. With `tls`, gRPC is served over TLS (mutual with
    `tls.mutual`); Triton's HTTP frontend has no TLS, so it is then bound to 127.0.0.1 only and
    serves this object's health and repository calls.
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
        strict: bool = False,
        watch_interval_s: float | None = None,
        admin_key: AdminKey | None = None,
        tls: ServerTls | None = None,
        restricted_apis: tuple[str, ...] = RESTRICTED_APIS,
        cpus: "Collection[int] | str | None" = None,
        exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S,
    ) -> None:
        self.repository = Path(repository).resolve()
        # Where tritonserver and every thread and stub it starts may run (None: wherever this
        # process may). See `parse_cpus`.
        self.cpus = parse_cpus(cpus) if cpus is not None else None
        if not isinstance(exit_timeout_s, int) or exit_timeout_s < 0:
            raise ConfigError(f"exit_timeout_s: {exit_timeout_s!r}; give whole seconds >= 0 (0: stop at once, for a caller whose own requests are all answered)")
        self.exit_timeout_s = exit_timeout_s
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
        self.strict = strict
        self.watch_interval_s = watch_interval_s
        self.admin_key = admin_key
        self.tls = tls
        self.restricted_apis = restricted_apis
        # Triton's HTTP frontend speaks plaintext only: with TLS on gRPC it stays on loopback.
        self.http_host = "127.0.0.1" if tls is not None and not is_loopback(host) else host
        self.process: subprocess.Popen[bytes] | None = None
        self._ports: PortReservation | None = None
        self.view: LocalView | None = None
        self.model_status: dict[str, ModelStatus] = {}
        self._log_file = None
        self._watcher: RepositoryWatcher | None = None

    # -- addresses ---------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.http_host}:{self.http_port}"

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
        clean_leftovers()
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="scorestack-triton-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Fingerprints before the view is built (see reload): a version installed meanwhile is loaded by the watcher.
        seen = {p.name: fingerprint(p) for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")}
        self.view = build_local_view(self.repository, self.run_dir / "models", strict=self.strict)
        self._watcher = RepositoryWatcher(
            self.repository,
            self.view.root,
            lambda: self.admin,  # the ports are picked below, and picked again after a collision
            seen={name: seen.get(name, (None,)) for name in self.view.models},
            on_status=self._record_status,
            models=self.models,
        )
        for name, reason in self.view.skipped.items():
            log.warning("model %s not served locally: %s", name, reason)
        assert self.run_dir is not None
        backends = env.backend_directory(self.run_dir / "backends")
        # Free ports are picked then released: another process may take one first. Retry that
        # (and only that) with new ports, unless the caller fixed every port.
        attempts_left = 1 if all(self._fixed_ports) else 3
        while True:
            attempts_left -= 1
            self._pick_ports()
            self._launch(env, backends)
            try:
                self.wait_ready(self.ready_timeout_s)
                self._check_models()
                if self.watch_interval_s:
                    self._watcher.start(self.watch_interval_s, self.is_running)
                return self
            except ServerError:
                # gRPC and HTTP say "address already in use"; metrics "Socket '<addr>' already in use".
                collided = "already in use" in self.log_tail().lower()
                self._terminate()
                if not (collided and attempts_left > 0):
                    self._cleanup()
                    raise
                log.warning("port collision, retrying with new ports")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        self._terminate(timeout_s)
        self._cleanup()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _endpoints(self):
        return triton_endpoints(self.host, self.grpc_port, self.http_host, self.http_port, self.metrics_port)

    def is_ready(self) -> bool:
        """Every endpoint this server opens answers now: gRPC, HTTP readiness and metrics."""
        return self.is_running() and self._endpoints()() is None

    def _exit_message(self) -> str | None:
        if self.is_running():
            return None
        code = self.process.returncode if self.process else None
        return f"exited with code {code} before becoming ready"

    def wait_ready(self, timeout_s: float) -> None:
        """Wait, bounded, until every endpoint answers (serve.readiness: Triton binds gRPC, HTTP, then
        metrics last, so HTTP readiness alone can come before the metrics port is bound)."""
        try:
            wait_until(self._endpoints(), timeout_s=timeout_s, what=f"tritonserver (repository {self.repository})", died=self._exit_message)
        except ServerError as exc:
            raise ServerError(f"{exc}: {self.failure_reason()}\n--- log tail ---\n{self.log_tail()}") from None

    # -- models ------------------------------------------------------------------------------
    @property
    def admin(self) -> TritonAdmin:
        """Admin calls to this server (over its HTTP frontend, with its admin key)."""
        return TritonAdmin(self.http_url, self.admin_key)

    def repository_index(self) -> dict[str, ModelStatus]:
        """Every model Triton knows of, with its state and Triton's reason when it is not ready."""
        return self.admin.repository_index()

    def _check_models(self) -> None:
        """Record each model's readiness; raise if none of the requested models loaded (strict: if any failed)."""
        assert self.view is not None
        index = self.repository_index()
        wanted = self.models if self.models is not None else list(self.view.models)
        status = {}
        for n in wanted:
            st = index.get(n)
            ok = st is not None and (st.ready or st.reason)
            status[n] = st if ok else ModelStatus(n, False, reason=self._log_reason(n) or "not loaded")
        for name, reason in self.view.skipped.items():
            if self.models is None or name in self.models:
                status[name] = ModelStatus(name, False, reason=f"not served locally: {reason}")
        self.model_status = status
        failed = {n: st.reason for n, st in status.items() if not st.ready}
        for name, reason in failed.items():
            log.warning("model %s is not served: %s", name, reason)
        if failed and (self.strict or len(failed) == len(status)):
            what = "some models failed to load (strict)" if self.strict and len(failed) < len(status) else "no model could be loaded"
            raise ServerError(
                f"{what} from {self.repository}: " + "; ".join(f"{n}: {r}" for n, r in failed.items())
                + f"\n{self.failure_reason()}\n--- log tail ---\n{self.log_tail()}"
            )

    def _log_reason(self, name: str) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except (OSError, AssertionError):
            return ""
        hits = [ln.strip() for ln in lines if f"model '{name}'" in ln and ("failed" in ln or ln.startswith("E"))]
        return first_line(hits[-1]) if hits else ""

    def ready_models(self) -> list[str]:
        return sorted(n for n, st in self.model_status.items() if st.ready)

    def _record_status(self, name: str, status: ModelStatus) -> None:
        self.model_status[name] = status

    def reload(self, name: str, timeout_s: float = 120.0) -> ModelStatus:
        """Re-render `name` from the repository and ask Triton to load it (serve.reload.RepositoryWatcher.reload).

        Triton loads the new versions while the old ones keep serving; a failed load leaves whatever
        was serving in place and reports Triton's reason.
        """
        assert self._watcher is not None, "start() the server first"
        return self._watcher.reload(name, timeout_s)

    def sync(self) -> dict[str, ModelStatus]:
        """Load what changed in the repository since the last look (a new version, a new or edited model)."""
        assert self._watcher is not None, "start() the server first"
        return self._watcher.sync()

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
        if not picked:  # e.g. a refused command line: Triton prints its usage, then one line saying why
            last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
            return f"no error line in the server log; its last line: {last[:500]}" if last else "the server log is empty"
        return " | ".join(picked[:3])[:1500]

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
        fixed = [p for p in self._fixed_ports if p]
        self._release_ports()
        self._ports = PortReservation.take(3 - len(fixed), self.host, exclude=fixed)
        picked = iter(self._ports.ports)
        self.grpc_port, self.http_port, self.metrics_port = (p or next(picked) for p in self._fixed_ports)

    def _release_ports(self) -> None:
        if self._ports is not None:
            self._ports.release()
            self._ports = None

    def _launch(self, env: ServerEnvironment, backends: Path) -> None:
        assert self.run_dir is not None and self.view is not None
        args = [
            str(env.tritonserver),
            f"--model-repository={self.view.root}",
            f"--backend-directory={backends}",
            f"--cache-directory={env.cache_dir}",
            "--model-control-mode=explicit",
            f"--http-address={self.http_host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--cache-config=local,size={self.cache_bytes}",
            # A model that fails to load is reported per model (_check_models) instead of taking the
            # healthy ones down, unless strict.
            f"--exit-on-error={'true' if self.strict else 'false'}",
            f"--strict-readiness={'true' if self.strict else 'false'}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--metrics-interval-ms={METRICS_INTERVAL_MS}",
        ]

        if self.tls is not None:
            args += self.tls.triton_args()
        names = self.models if self.models is not None else list(self.view.models)
        known = set(self.view.models) | set(self.view.skipped)
        unknown = sorted(set(names) - known)
        if unknown:
            raise ServerError(f"models {unknown} are not in {self.repository} (has {sorted(known)})")
        args += [f"--load-model={n}" for n in names if n in self.view.models]
        self._log_file = open(self.log_path, "ab")
        launch_env = env.launch_env()
        launch_env[SUPERVISOR_ENV] = supervisor_tag(os.getpid())
        # Triton and its stubs need no key in their environment; keep it out of /proc/<pid>/environ.
        launch_env.pop(ADMIN_KEY_ENV, None)
        launch_env.pop(ADMIN_KEY_FILE_ENV, None)
        # The client-side gRPC setting scorestack puts in its own environment is not Triton's.
        if launch_env.get("GRPC_EXPERIMENTS") == GRPC_CLIENT_EXPERIMENTS:
            launch_env.pop("GRPC_EXPERIMENTS")
        handoff = None
        if self.admin_key is not None:
            # Triton takes the key only on its command line: it gets a random placeholder there, and
            # the key through a pipe that a library preloaded into it reads before main() parses its
            # options (serve.security.key_handoff): ps and /proc/<pid>/cmdline never show the key.
            handoff = key_handoff(
                self.admin_key.triton_args(self.restricted_apis), self.admin_key, build_key_shim(self.run_dir / "keyshim"),
                ld_preload=launch_env.get("LD_PRELOAD"),
            )
            args += handoff.args
            launch_env.update(handoff.env)
        # The parent-death signal fires when the forking *thread* exits: only tie it from the main thread.
        main = threading.current_thread() is threading.main_thread()
        try:
            self.process = subprocess.Popen(
                args,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=launch_env,
                cwd=self.run_dir,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it cleanly
                preexec_fn=child_setup(os.getpid() if main else None, self.cpus) if main or self.cpus is not None else None,
                pass_fds=(handoff.read_fd,) if handoff is not None else (),
            )
        finally:
            if handoff is not None:
                handoff.close()  # tritonserver holds its own copy of the pipe's read end

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
        self._release_ports()
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

