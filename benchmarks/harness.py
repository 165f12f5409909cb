"""The benchmarks' one harness: a closed loop, an open loop, worker processes, process metrics, results.

A benchmark writes only a `send(i)` coroutine (request i of the run) and its rendering; a loop returns
a `Tally` (sent, answered, errors by kind with the first message of each, latencies). The open loop
counts latency from each request's due time (no coordinated omission) and never drops a request
silently: late and unsent ones are counted. docs/benchmarks.md ("The harness and the scripts").
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import multiprocessing as mp
import os
import platform
import random
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Sequence

import numpy as np
import psutil

RESULTS = Path(__file__).resolve().parent / "results"
PERCENTILES = (50.0, 90.0, 99.0, 99.9)

Send = Callable[[int], Awaitable[Any]]
Classify = Callable[[BaseException], str]


def by_class(exc: BaseException) -> str:
    """The default error kind: the exception's class name."""
    return type(exc).__name__


# -- what a loop recorded ------------------------------------------------------------------------------
@dataclass
class Tally:
    """Counts and latencies of one loop (or one window of it). Latencies are in ms, of answered requests."""

    sent: int = 0  # counted requests sent
    sent_all: int = 0  # every request sent, the warm-up's included
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    error_samples: dict = field(default_factory=dict)
    latencies_ms: list = field(default_factory=list)  # open loop: from the due time; closed loop: from the send
    sent_latencies_ms: list = field(default_factory=list)  # open loop: from the actual send (the server's share)
    scheduled: int = 0  # open loop: requests due in the counted span
    late: int = 0  # open loop: started more than late_after_ms after their due time
    unsent: int = 0  # open loop: due but never started (the client too far behind)
    lags_ms: list = field(default_factory=list)  # open loop: how late each request started
    flagged: int = 0  # answered requests whose result `flag` marked (e.g. degraded features)
    values: list = field(default_factory=list)  # the answers, when the loop was asked to keep them
    wall_s: float = 0.0  # the counted span
    cpu_s: float = 0.0  # this process's CPU over the counted span
    start_s: float = 0.0  # window: its span from the run's start
    end_s: float = 0.0

    def fail(self, kind: str, exc: BaseException) -> None:
        self.errors[kind] += 1
        self.error_samples.setdefault(kind, f"{type(exc).__name__}: {exc}"[:400])

    @property
    def errors_total(self) -> int:
        return sum(self.errors.values())

    def percentiles(self, which: str = "latencies_ms", qs: Sequence[float] = PERCENTILES) -> list[float]:
        values = getattr(self, which)
        return [float(x) for x in np.percentile(values, qs)] if len(values) else [float("nan")] * len(qs)

    def summary(self) -> dict:
        """The headline numbers (no raw latencies): rates over the counted span, percentiles, errors."""
        p50, p90, p99, p999 = self.percentiles()
        lat = self.latencies_ms
        wall = self.wall_s or float("nan")
        out = {
            "sent": self.sent, "ok": self.ok, "errors": dict(self.errors), "error_samples": self.error_samples,
            "rate": self.ok / wall, "sent_rate": self.sent / wall, "wall_s": self.wall_s,
            "p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "p999_ms": p999,
            "mean_ms": float(np.mean(lat)) if len(lat) else float("nan"), "max_ms": float(np.max(lat)) if len(lat) else float("nan"),
            "client_cpu_cores": self.cpu_s / wall, "client_cpu_us_per_request": 1e6 * self.cpu_s / max(self.sent, 1),
        }
        if self.scheduled:
            sp50, sp99 = self.percentiles("sent_latencies_ms", (50, 99))
            out.update(scheduled=self.scheduled, late=self.late, unsent=self.unsent, p50_from_send_ms=sp50, p99_from_send_ms=sp99,
                       send_lag_ms_p99=float(np.percentile(self.lags_ms, 99)) if self.lags_ms else 0.0,
                       lag_max_ms=float(np.max(self.lags_ms)) if self.lags_ms else 0.0)
        return out

    @classmethod
    def merge(cls, parts: Iterable["Tally"]) -> "Tally":
        """One Tally from several workers' (or windows'): counts summed, latencies joined, the longest span."""
        out = cls()
        for p in parts:
            for name in ("sent", "sent_all", "ok", "scheduled", "late", "unsent", "flagged", "cpu_s"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            for name in ("latencies_ms", "sent_latencies_ms", "lags_ms", "values"):
                getattr(out, name).extend(getattr(p, name))
            out.errors.update(p.errors)
            for k, v in p.error_samples.items():
                out.error_samples.setdefault(k, v)
            out.wall_s = max(out.wall_s, p.wall_s)
            out.start_s = p.start_s if out.end_s == 0 else min(out.start_s, p.start_s)
            out.end_s = max(out.end_s, p.end_s)
        return out


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system


# -- the two loops ---------------------------------------------------------------------------------------
async def closed_loop(send: Send, concurrency: int, *, duration_s: float | None = None, n: int | None = None, warmup_s: float = 0.0,
                      start_at: float | None = None, classify: Classify = by_class, keep: bool = False,
                      flag: Callable[[Any], bool] | None = None) -> Tally:
    """`concurrency` callers sending back to back: for `duration_s` after `warmup_s` (requests started in the
    warm-up are sent but not counted), or `n` requests in all. `start_at` (time.monotonic) delays the start,
    so workers in several processes start together. Latency is from each request's send."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if (duration_s is None) == (n is None):
        raise ValueError("give duration_s or n")
    if start_at is not None and start_at > time.monotonic():
        await asyncio.sleep(start_at - time.monotonic())
    tally = Tally()
    start = time.monotonic()
    w0 = start + warmup_s
    w1 = w0 + duration_s if duration_s is not None else float("inf")
    counter = iter(range(n if n is not None else 1 << 62))
    marks: list[float] = []

    async def caller() -> None:
        for i in counter:
            t = time.monotonic()
            if t >= w1:
                return
            counted = t >= w0
            if counted and not marks:
                marks[:] = [t, _cpu_now()]
            tally.sent += counted
            tally.sent_all += 1
            try:
                value = await send(i)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is counted by kind, the point of the measurement
                if counted:
                    tally.fail(classify(exc), exc)
                continue
            if counted:
                tally.ok += 1
                tally.latencies_ms.append((time.monotonic() - t) * 1e3)
                if keep:
                    tally.values.append(value)
                if flag is not None and flag(value):
                    tally.flagged += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    if marks:
        tally.wall_s, tally.cpu_s = time.monotonic() - marks[0], _cpu_now() - marks[1]
    return tally


async def open_loop(send: Send, rate: float, *, duration_s: float, warmup_s: float = 0.0, start_at: float | None = None, seed: int = 0,
                    poisson: bool = True, offset: int = 0, stride: int = 1, max_inflight: int = 4096, late_after_ms: float = 10.0,
                    window_s: float | None = None, classify: Classify = by_class, keep: bool = False,
                    flag: Callable[[Any], bool] | None = None) -> list[Tally]:
    """Arrivals at `rate`/s for `warmup_s` + `duration_s` (the warm-up's requests are sent, not counted): Poisson
    from `seed`, or evenly spaced (request i due at i / rate). Several processes share one schedule with
    `offset`/`stride` (process j sends requests j, j + stride, ...; evenly spaced only). Returns one Tally per
    window of `window_s` (by due time; one window when None) after the whole run has drained."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if start_at is not None and start_at > time.monotonic():
        await asyncio.sleep(start_at - time.monotonic())
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    w0, w1 = t0 + warmup_s, t0 + warmup_s + duration_s
    span = window_s or duration_s
    windows = [Tally(start_s=k * span, end_s=min((k + 1) * span, duration_s)) for k in range(max(1, int(np.ceil(duration_s / span - 1e-9))))]
    slots = asyncio.Semaphore(max_inflight)
    tasks: set[asyncio.Task] = set()
    late_s = late_after_ms / 1e3
    cpu0 = None
    sent_all = 0

    def due_times():
        if poisson:
            rng = random.Random(seed)
            t = t0
            while True:
                t += rng.expovariate(rate)
                yield t
        i = offset
        while True:
            yield t0 + i / rate
            i += stride

    async def one(i: int, due: float, tally: Tally | None, started: float) -> None:
        try:
            value = await send(i)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # counted by kind, none is lost
            if tally is not None:
                tally.fail(classify(exc), exc)
            return
        finally:
            slots.release()
        if tally is not None:
            now = time.monotonic()
            tally.ok += 1
            tally.latencies_ms.append((now - due) * 1e3)
            tally.sent_latencies_ms.append((now - started) * 1e3)
            if keep:
                tally.values.append(value)
            if flag is not None and flag(value):
                tally.flagged += 1

    burst = 0
    for i, due in enumerate(due_times()):
        if due >= w1:
            break
        counted = due >= w0
        tally = windows[min(int((due - w0) / span), len(windows) - 1)] if counted else None
        if counted and cpu0 is None:
            cpu0 = (time.monotonic(), _cpu_now())
        now = time.monotonic()
        if due > now:
            burst = 0
            await asyncio.sleep(due - now)
        elif burst >= 64:  # behind schedule: start what is due back to back, but let answers run between bursts
            burst = 0
            await asyncio.sleep(0)
        if tally is not None:
            tally.scheduled += 1
        await slots.acquire()  # the in-flight cap: waiting here makes the request late, not lost
        started = time.monotonic()
        if started > w1 + span:  # so far behind that the run would overrun by a whole window: say what was never sent
            slots.release()
            if tally is not None:
                tally.unsent += 1
            continue
        sent_all += 1
        if tally is not None:
            tally.sent += 1
            lag = started - due
            tally.lags_ms.append(lag * 1e3)
            tally.late += lag > late_s
        task = loop.create_task(one(offset + i * stride, due, tally, started))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        burst += 1
    if tasks:
        await asyncio.gather(*tasks)
    windows[0].sent_all = sent_all
    if cpu0 is not None:
        cpu = _cpu_now() - cpu0[1]
        for w in windows:
            w.wall_s = w.end_s - w.start_s
            w.cpu_s = cpu * w.wall_s / duration_s
    return windows


# -- worker processes ------------------------------------------------------------------------------------
def _worker_main(conn, factory: str, settings: dict, index: int, cpus: list[int] | None) -> None:
    # gRPC's older client poller, as scorestack's clients use it (scorestack/__init__.py), read when grpc is
    # first imported, which in this spawned process happens after this line.
    os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client")
    if cpus:
        os.sched_setaffinity(0, cpus)
    if settings.get("spin_us"):  # scorestack's spinning loop: polls before it sleeps
        from scorestack.client.eventloop import run

        return run(_worker_serve(conn, factory, settings, index), spin_us=settings["spin_us"])
    if settings.get("uvloop", True):
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    asyncio.run(_worker_serve(conn, factory, settings, index))


async def _worker_serve(conn, factory: str, settings: dict, index: int) -> None:
    module, name = factory.split(":")
    loop = asyncio.get_running_loop()
    try:
        ctx = getattr(importlib.import_module(module), name)(settings, index)
        session = await ctx.__aenter__()
    except Exception as exc:  # the parent raises it with the factory's name
        conn.send(("error", f"{factory}: {type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("ready", os.getpid()))
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command is None:
                return
            kind, kwargs = command
            try:
                if kind == "closed":
                    result: Any = await closed_loop(session.send, classify=session.classify, **kwargs)
                elif kind == "open":
                    result = await open_loop(session.send, classify=session.classify, **kwargs)
                else:
                    result = await getattr(session, kind)(**kwargs)  # a session's own command (preflight, freeze...)
                conn.send(("ok", result))
            except Exception as exc:  # sent back to the parent, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"[:600]))
    finally:
        await ctx.__aexit__(None, None, None)


class WorkerError(RuntimeError):
    """A worker process failed to start or to run a command."""


class Workers:
    """`n` processes (spawned: no fork after gRPC exists in the parent), each holding a session built once by
    `factory` ("module:callable", called as callable(settings, index) -> async context manager whose value has
    `send(i)` and `classify(exc)`). `cpus`: pin the workers (one core each when there are enough, else the set).
    Commands go to all of them at once and their results come back as a list."""

    def __init__(self, n: int, factory: str, settings: dict, *, cpus: Sequence[int] | None = None, start_timeout_s: float = 120.0) -> None:
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for j in range(n):
            pin = ([list(cpus)[j % len(cpus)]] if len(cpus) >= n else list(cpus)) if cpus else None
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, factory, settings, j, pin), name=f"bench-worker-{j}", daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self.pids = [self._recv(c, start_timeout_s) for c in self._conns]
        except BaseException:
            self.close()
            raise

    @property
    def n(self) -> int:
        return len(self._procs)

    def _recv(self, conn, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise WorkerError(f"a worker did not answer within {timeout_s:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError as exc:
            raise WorkerError("a worker process died") from exc
        if status == "error":
            raise WorkerError(value)
        return value

    def send(self, kind: str, per_worker: Sequence[dict]) -> None:
        for conn, kwargs in zip(self._conns, per_worker):
            conn.send((kind, kwargs))

    def gather(self, timeout_s: float, n: int | None = None) -> list[Any]:
        return [self._recv(conn, timeout_s) for conn in self._conns[: n or self.n]]

    def run(self, kind: str, per_worker: Sequence[dict], timeout_s: float) -> list[Any]:
        self.send(kind, per_worker)
        return self.gather(timeout_s, len(per_worker))

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split(total: int, n: int) -> list[int]:
    """`total` shared over `n` as evenly as integers allow."""
    return [total // n + (1 if j < total % n else 0) for j in range(n)]


# -- process metrics (psutil) ----------------------------------------------------------------------------
def tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (a server's stub processes, say); [] when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_seconds(pids: Iterable[int], *, children: bool = True) -> float:
    """CPU seconds (user + system) of these processes (and their descendants)."""
    total, seen = 0.0, set()
    for pid in pids:
        for p in tree(pid) if children else [psutil.Process(pid)]:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


def rss_mib(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return None


def host_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class Meter:
    """CPU used between two `lap`s, in % of one core: the clients, the server (with its descendants), the
    machine, and the rest ("other", Redis included: on a shared machine a stall of someone else's making
    must not pass for one of ours); `client_loop_thread_pct` is the busiest client's main thread (its event
    loop): near 100%, that client is the bottleneck."""

    def __init__(self, server_pid: int, client_pids: Sequence[int] | None = None) -> None:
        self.server_pid = server_pid
        self.client_pids = list(client_pids or [os.getpid()])
        self._last = self._read()

    def _main_thread_s(self, pid: int) -> float:
        try:
            t = next((t for t in psutil.Process(pid).threads() if t.id == pid), None)
            return t.user_time + t.system_time if t else 0.0
        except psutil.NoSuchProcess:
            return 0.0

    def _read(self) -> tuple:
        return (time.monotonic(), cpu_seconds(self.client_pids, children=False), [self._main_thread_s(p) for p in self.client_pids],
                cpu_seconds([self.server_pid]), host_busy_seconds())

    def lap(self) -> dict[str, float]:
        now = self._read()
        (t0, c0, l0, s0, h0), (t1, c1, l1, s1, h1) = self._last, now
        self._last = now
        wall = max(t1 - t0, 1e-9)
        client, server, host = (c1 - c0) / wall * 100, (s1 - s0) / wall * 100, (h1 - h0) / wall * 100
        return {"client_pct": round(client, 1), "client_loop_thread_pct": round(max(b - a for a, b in zip(l0, l1)) / wall * 100, 1),
                "server_pct": round(server, 1), "host_pct": round(host, 1), "other_pct": round(max(host - client - server, 0.0), 1)}


def memory(server_pid: int, client_pids: Sequence[int] | None = None) -> dict[str, Any]:
    """Resident memory: the server, its descendants (Python-backend stubs) summed, the clients summed."""
    stubs = [(p.pid, p.name(), rss) for p in tree(server_pid)[1:] if (rss := rss_mib(p.pid)) is not None]
    server = rss_mib(server_pid) or 0.0
    stubs_total = sum(r for _, _, r in stubs)
    clients = list(client_pids or [os.getpid()])
    return {"tritonserver_mib": round(server, 1), "stubs_mib": round(stubs_total, 1), "n_stubs": len(stubs),
            "server_total_mib": round(server + stubs_total, 1), "client_mib": round(sum(rss_mib(p) or 0.0 for p in clients), 1),
            "n_clients": len(clients), "stubs": [{"pid": pid, "name": name, "rss_mib": round(r, 1)} for pid, name, r in stubs]}


def pin(pids: Iterable[int], cpus: Iterable[int], *, children: bool = False) -> None:
    """Every thread of these processes (and, with `children`, of their descendants: a server's stubs) may run
    only on `cpus`; threads created later inherit it."""
    cpus = sorted(cpus)
    for pid in pids:
        for proc in tree(pid) if children else tree(pid)[:1]:
            try:
                for t in proc.threads():
                    try:
                        os.sched_setaffinity(t.id, cpus)
                    except OSError:
                        pass
            except psutil.NoSuchProcess:
                pass


class GcPauses:
    """This process's garbage-collection pauses while installed, by generation (a full collection stops the
    event loop for all of its duration: a latency tail, not an error)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, float]] = []  # (time.monotonic at the end, generation, pause ms)
        self._t: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.events.append((time.monotonic(), info["generation"], (time.perf_counter() - self._t) * 1e3))
            self._t = None

    def between(self, t0: float, t1: float) -> dict:
        """Collections by generation, their total and longest pause, of those that ended in [t0, t1)."""
        got = [(g, ms) for t, g, ms in self.events if t0 <= t < t1]
        return {"collections": [sum(g == k for g, _ in got) for k in range(3)], "total_ms": round(sum(ms for _, ms in got), 1),
                "max_ms": round(max((ms for _, ms in got), default=0.0), 1)}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


# -- the machine and the results -------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(**extra: Any) -> dict[str, Any]:
    """Where and when a run happened: CPUs, model, platform, Python, commit, date, load average."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(), "python": platform.python_version(),
            "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": list(os.getloadavg()), **extra}


def demo_stack(models: Sequence[str], *, project: str | None, n_users: int = 5000, recompile: bool = False) -> tuple[Path, Path | None, dict[str, Path]]:
    """The demo models trained into the workspace (once), `models` compiled (skipped when unchanged unless `recompile`), and with a
    `project` a Feast repository of the demo features on Redis (REDIS_URL), applied and materialized: (repository, feature repo or None, specs)."""
    from scorestack import paths
    from scorestack.compile import compile_model
    from scorestack.demo.features import init_repo
    from scorestack.demo.train import train_demo_models
    from scorestack.features import store

    ws = paths.workspace()
    specs = {p.stem: p for p in train_demo_models(ws / "models")}
    for name in models:
        compile_model(specs[name], ws / "model_repository", force=recompile)
    if project is None:
        return ws / "model_repository", None, specs
    repo = init_repo(ws / f"feature_repo_{project}", online="redis", redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                     n_users=n_users, project=project)
    store.apply(repo)
    store.materialize(repo)
    return ws / "model_repository", repo, specs


def _plain(x: Any) -> Any:
    if isinstance(x, Tally):
        return x.summary()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Counter):
        return dict(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def write_results(name: str, data: dict, markdown: str, results_dir: Path = RESULTS) -> tuple[Path, Path]:
    """results/<name>.json (the data) and results/<name>.md (its rendering): the one place results land."""
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=_plain) + "\n")
    md_path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return json_path, md_path


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]
