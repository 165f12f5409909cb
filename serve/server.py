"""Start, health-check and stop a real Triton Inference Server on this machine."""

from __future__ import annotations

import ctypes
import fcntl
import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from scorestack import GRPC_CLIENT_EXPERIMENTS, paths
from scorestack.errors import AdminKeyError, ConfigError, ServerError
from scorestack.serve.environment import ServerEnvironment, ensure_server_environment
from scorestack.serve.readiness import triton_endpoints, wait_until
from scorestack.serve.security import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, ADMIN_KEY_HEADER, RESTRICTED_APIS, AdminKey, ServerTls, build_key_shim, is_loopback, key_handoff
from scorestack.serve.view import LocalView, build_local_view, render_model

log = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 120.0
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# Triton's own default: at stop, wait up to this long for in-flight requests (then for its models
# to unload, which it checks once a second: 1-6 s per stop measured here even with nothing in flight).
DEFAULT_EXIT_TIMEOUT_S = 30
# How often Triton samples its CPU metrics; its stop waits for that thread's current sleep (Triton's
# 2000 ms default cost ~0.9 s per stop here). Counters of requests are updated per request regardless.
METRICS_INTERVAL_MS = 250
# Every tritonserver we start (and its Python-backend stubs, which inherit the environment) carries
# this variable naming its supervisor, so a later start can find and stop the orphans of one that died.
SUPERVISOR_ENV = "SCORESTACK_SUPERVISOR"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ModelStatus:
    """Whether one model of the repository is being served, and if not, why."""

    name: str
    ready: bool
    versions: tuple[str, ...] = ()
    reason: str = ""


def _process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _supervisor_tag(pid: int) -> str:
    return f"{pid}:{_process_start_time(pid)}"


def _supervisor_alive(tag: str) -> bool:
    pid, _, start = tag.partition(":")
    return pid.isdigit() and _process_start_time(int(pid)) == start


def clean_leftovers() -> list[int]:
    """Stop tritonservers and stubs whose supervising scorestack process is gone, and remove their
    shared-memory regions. Returns the pids stopped."""
    killed = []
    me = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != me:
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        tag = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(SUPERVISOR_ENV.encode() + b"=")), None)
        if tag and not _supervisor_alive(tag):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    for path in glob.glob("/dev/shm/scorestack_*_*"):
        owner = Path(path).name.split("_")[1]
        if owner.isdigit() and _process_start_time(int(owner)) is None:
            try:
                os.unlink(path)
            except OSError:
                pass
    if killed:
        log.warning("stopped %d leftover Triton processes of a scorestack run that died: %s", len(killed), killed)
    return killed


def _die_with_parent(parent: int):
    """In the child before exec: SIGKILL when the parent dies (Linux parent-death signal)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def parse_cpus(cpus: "Collection[int] | str", *, field: str = "cpus") -> frozenset[int]:
    """A CPU set for the server: ints, or a list like "1", "0,2" or "2-3", each CPU one this process may use.

    On a machine shared by the server and its callers, a server confined to its own cores wakes its
    threads (gRPC frontend, batcher, model instances) on one core instead of across cores; on the
    2-core project machine that took the fraud model call at concurrency 1 (queue + compute +
    network phases) from 0.59-0.61 to 0.40-0.44 ms (benchmarks/results/request_path.md).
    """
    if isinstance(cpus, str):
        chosen: set[int] = set()
        try:
            for part in (p.strip() for p in cpus.split(",")):
                if "-" in part:
                    lo, hi = (int(x) for x in part.split("-", 1))
                    if hi < lo:
                        raise ValueError(part)
                    chosen.update(range(lo, hi + 1))
                elif part:
                    chosen.add(int(part))
        except ValueError:
            raise ConfigError(f"{field}: {cpus!r} is not a CPU list; write e.g. \"1\", \"0,2\" or \"2-3\"") from None
    else:
        chosen = {int(c) for c in cpus}
    allowed = os.sched_getaffinity(0)
    if not chosen:
        raise ConfigError(f"{field}: empty; name at least one of the CPUs this process may use ({_cpu_list(allowed)})")
    outside = sorted(chosen - allowed)
    if outside:
        raise ConfigError(f"{field}: CPUs {outside} are not available to this process; choose among {_cpu_list(allowed)}")
    return frozenset(chosen)


def _cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _child_setup(parent: int | None, cpus: frozenset[int] | None):
    """In the child before exec: the CPU set (every thread and process it starts inherits it), and
    the parent-death signal when `parent` is given."""
    die = _die_with_parent(parent) if parent is not None else None

    def setup() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if die is not None:
            die()

    return setup


def free_port(host: str = "127.0.0.1") -> int:
    """One port free now. For several, use free_ports: a port released by one pick can be the next pick."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct ports free now, none in `exclude`, for another process to bind (e.g. the ports of a
    `scorestack serve` a caller starts): reserved against other scorestack processes (PortReservation)
    until this process exits. A server of this process reserves its own (LocalTriton)."""
    reservation = PortReservation.take(n, host, exclude=exclude)
    _KEPT.append(reservation)
    return reservation.ports


_KEPT: list["PortReservation"] = []


class PortReservation:
    """Ports picked for one server and reserved against every other scorestack process until released.

    A picked port is free only until someone binds it. Two scorestack processes starting servers at
    once (parallel compile jobs' serving checks, parallel test workers) can be handed the same port,
    and Triton's metrics endpoint binds with SO_REUSEPORT: a second server then *shares* the first
    one's metrics port without an error, and scrapes reach either (measured here). Each reserved
    port holds an exclusive lock on a file named after it under scorestack's home; other scorestack
    processes skip locked ports, and the kernel drops the locks of a process that dies.
    """

    def __init__(self, ports: list[int], locks: list[int]) -> None:
        self.ports = ports
        self._locks = locks

    @staticmethod
    def directory() -> Path:
        # Machine-wide state, like the server environment (not $TMPDIR, which callers set per run).
        path = paths.home() / "ports"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    @classmethod
    def take(cls, n: int, host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> "PortReservation":
        """`n` distinct ports, none in `exclude` or reserved by another scorestack process.

        Each socket stays bound until all are picked: picked and released one at a time, the kernel
        hands out the same port again (seen in CI: Triton refused "HTTP and metrics at the same
        address and port" and exited before it was ready)."""
        held: list[socket.socket] = []
        ports: list[int] = []
        locks: list[int] = []
        folder = cls.directory()
        try:
            while len(ports) < n:
                s = socket.socket()
                held.append(s)  # stays bound until every port is picked, so none is picked twice
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port in exclude:
                    continue
                fd = os.open(folder / str(port), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # reserved elsewhere: its server has it or is about to bind it
                    os.close(fd)
                    continue
                locks.append(fd)
                ports.append(port)
        except BaseException:
            for fd in locks:
                os.close(fd)
            raise
        finally:
            for s in held:
                s.close()
        return cls(ports, locks)

    def release(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks = []


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
        self._fingerprints: dict[str, tuple] = {}
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        self._sync_lock = threading.Lock()

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
        seen = {p.name: self._fingerprint(p.name) for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")}
        self.view = build_local_view(self.repository, self.run_dir / "models", strict=self.strict)
        self._fingerprints = {name: seen.get(name, (None,)) for name in self.view.models}
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
                self._check_models()
                if self.watch_interval_s:
                    self._stop_watching.clear()
                    self._watcher = threading.Thread(target=self._watch, name="scorestack-repository-watch", daemon=True)
                    self._watcher.start()
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
        self._stop_watching.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(10)
        self._watcher = None
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
    def _http(self, method: str, path: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(self.admin_key.http_headers if self.admin_key else {})}
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                code, answer = exc.code, json.loads(raw)
            except ValueError:
                code, answer = exc.code, {"error": raw.decode(errors="replace")}
            if code == 403 and "restricted" in str(answer).lower():
                raise AdminKeyError(f"Triton at {self.http_url} refused {path}: {'the admin key is wrong' if self.admin_key else 'no admin key was sent'} (header {ADMIN_KEY_HEADER!r})") from exc
            return code, answer

    def repository_index(self) -> dict[str, ModelStatus]:
        """Every model Triton knows of, with its state and Triton's reason when it is not ready."""
        code, entries = self._http("POST", "/v2/repository/index", {})
        if code != 200 or not isinstance(entries, list):
            raise ServerError(f"Triton at {self.http_url} answered its repository index with {code}: {str(entries)[:500]}")
        out: dict[str, dict] = {}
        for e in entries or []:
            d = out.setdefault(e["name"], {"versions": [], "reasons": [], "ready": False})
            if e.get("state") == "READY":
                d["ready"] = True
                d["versions"].append(str(e.get("version", "")))
            elif e.get("reason"):
                d["reasons"].append(_first_line(e["reason"]))
        return {
            name: ModelStatus(name, d["ready"], tuple(sorted(d["versions"], key=lambda v: int(v) if v.isdigit() else 0)), "; ".join(dict.fromkeys(d["reasons"])))
            for name, d in out.items()
        }

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
        return _first_line(hits[-1]) if hits else ""

    def ready_models(self) -> list[str]:
        return sorted(n for n, st in self.model_status.items() if st.ready)

    def reload(self, name: str, timeout_s: float = 120.0) -> ModelStatus:
        """Re-render `name` from the repository and ask Triton to load it (explicit model control).

        Triton loads the new versions while the old ones keep serving, then retires versions the
        version policy no longer lists once their requests are done. Returns the model's status;
        a failed load leaves whatever was serving in place and reports Triton's reason.
        """
        assert self.view is not None and self.run_dir is not None
        with self._sync_lock:
            # What is about to be rendered, taken before rendering: a version installed while this
            # one renders and loads (a load takes seconds) then differs at the next look and is
            # loaded then. Taken after the load, it would mark that version as already seen.
            seen = self._fingerprint(name)
            try:
                reason = render_model(self.repository / name, self.view.root)
            except ConfigError as exc:
                reason = str(exc)
            if reason is not None:
                st = ModelStatus(name, False, reason=f"not served locally: {reason}")
            else:
                code, body = self._http("POST", f"/v2/repository/models/{name}/load", {}, timeout_s=timeout_s)
                current = self.repository_index().get(name)
                if code == 200 and current is not None and current.ready:
                    st = current
                else:
                    err = body.get("error") if isinstance(body, dict) else str(body)
                    st = ModelStatus(name, bool(current and current.ready), current.versions if current else (), _first_line(err or "load failed"))
            self._fingerprints[name] = seen
            self.model_status[name] = st
            return st

    def sync(self) -> dict[str, ModelStatus]:
        """Load what changed in the repository since the last look (a new version, a new or edited model)."""
        changed = {}
        for model_dir in sorted(p for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
            name = model_dir.name
            if self.models is not None and name not in self.models:
                continue
            fp = self._fingerprint(name)
            if fp != self._fingerprints.get(name) and fp[0] is not None:
                st = self.reload(name)
                changed[name] = st
                log.warning("model %s reloaded from %s: %s", name, self.repository, "ready, versions " + ",".join(st.versions) if st.ready else st.reason)
        return changed

    def _fingerprint(self, name: str) -> tuple:
        model_dir = self.repository / name
        try:
            config = (model_dir / "config.pbtxt").stat().st_mtime_ns
        except OSError:
            return (None,)
        versions = []
        for p in model_dir.iterdir():
            if p.is_dir() and p.name.isdigit():
                try:
                    versions.append((p.name, (p / "SHA256SUMS").stat().st_mtime_ns if (p / "SHA256SUMS").exists() else p.stat().st_mtime_ns))
                except OSError:
                    pass
        return (config, tuple(sorted(versions)))

    def _watch(self) -> None:
        while not self._stop_watching.wait(self.watch_interval_s or 1.0):
            if not self.is_running():
                return
            try:
                self.sync()
            except Exception:  # a failed look is logged and retried at the next tick
                log.exception("repository sync failed")

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
        launch_env[SUPERVISOR_ENV] = _supervisor_tag(os.getpid())
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
                preexec_fn=_child_setup(os.getpid() if main else None, self.cpus) if main or self.cpus is not None else None,
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


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")[:600]
