"""A lean load generator for KServe v2 gRPC (Triton, MLServer) and plain HTTP/JSON services.

Closed loop (N callers, each sends its next request when the last one answers) and open loop
(Poisson arrivals at a set rate; latency counted from each request's *scheduled* send time, so a
client or server that falls behind pays for it: no coordinated omission). The load runs in worker
processes of its own (spawned, optionally pinned with os.sched_setaffinity) that record their CPU
share and core placement; the parent merges latencies into p50/p90/p99/p99.9.

To keep the client's CPU per request low, requests are serialized once: gRPC sends prebuilt
ModelInferRequest bytes through a raw unary call (no per-request protobuf work), HTTP writes
prebuilt request bytes on keep-alive connections through an asyncio protocol. Responses are
parsed only for the preflight request and when they fail.

    gen = LoadGenerator(workers=1)
    target = grpc_target("fraud", "127.0.0.1:8001", "fraud_xgb", "input__0", rows)
    result = gen.closed(target, concurrency=16, duration_s=3)
    result = gen.open(target, rate=2000, duration_s=3)
    gen.close()
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import psutil

import harness

GRPC_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
PERCENTILES = harness.PERCENTILES
# Triton's queue policy answers UNAVAILABLE with these messages (an unreachable server too: tell
# them apart by the message, docs/platform-notes.md).
_REJECTION_MESSAGES = ("request timeout expired", "exceeds maximum queue size", "maximum queue size")


class LoadGenError(RuntimeError):
    """The load could not be run against a target (unreachable, unknown model, refused input)."""


# -- targets ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What to send where: `payloads` are complete prebuilt messages (gRPC request bytes, or whole HTTP requests)."""

    name: str
    protocol: str  # "grpc" | "http"
    address: str  # host:port
    payloads: tuple[bytes, ...]
    model: str = ""  # gRPC model name (for messages)
    description: str = ""
    deadline_s: float = 10.0


def grpc_target(name: str, address: str, model: str, input_name: str, rows: np.ndarray, *, output: str | None = None,
                typed_contents: bool = False, description: str = "", deadline_s: float = 10.0) -> Target:
    """One KServe v2 ModelInferRequest per row of `rows` (float32, one row each: batch dimension 1).

    `typed_contents` puts the values in `contents.fp32_contents` instead of `raw_input_contents`
    (both are KServe v2; servers may prefer one).
    """
    from tritonclient.grpc import service_pb2 as pb

    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or len(rows) == 0:
        raise ValueError(f"target {name}: rows must be a non-empty 2-D float array (one request per row), got shape {rows.shape}")
    payloads = []
    for row in rows:
        req = pb.ModelInferRequest(model_name=model)
        tensor = req.inputs.add(name=input_name, datatype="FP32", shape=[1, rows.shape[1]])
        if typed_contents:
            tensor.contents.fp32_contents.extend(row.tolist())
        else:
            req.raw_input_contents.append(row.tobytes())
        if output:
            req.outputs.add(name=output)
        payloads.append(req.SerializeToString())
    return Target(name, "grpc", address, tuple(payloads), model=model, description=description, deadline_s=deadline_s)


def http_target(name: str, address: str, path: str, bodies: Sequence[dict], *, description: str = "", deadline_s: float = 10.0) -> Target:
    """One keep-alive HTTP/1.1 POST of a JSON body per element of `bodies`."""
    host = address.split(":")[0]
    payloads = []
    for body in bodies:
        data = json.dumps(body, separators=(",", ":")).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        payloads.append(head + data)
    return Target(name, "http", address, tuple(payloads), model=path, description=description, deadline_s=deadline_s)


# -- results --------------------------------------------------------------------------------------
@dataclass
class Result:
    target: str
    mode: str
    concurrency: int
    rate: float  # open loop: target arrivals/s (all workers)
    duration_s: float
    sent: int
    ok: int
    errors: dict[str, int]
    error_samples: dict[str, str]
    dropped: int  # open loop: due but never sent (the client too far behind)
    scheduled: int
    throughput: float  # successful responses per second
    achieved_rate: float  # requests sent per second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    max_ms: float
    client_cpu_cores: float  # CPU seconds of all load workers / wall seconds
    client_cpu_us_per_request: float
    send_lag_ms_p99: float
    workers: list[dict] = field(default_factory=list)  # affinity, last CPU, CPU share of each worker
    server_cpu_cores: float | None = None
    server_cpu_us_per_request: float | None = None
    sent_total: int = 0  # every request sent, warm-up included; plus one preflight request per worker
    p50_from_send_ms: float = float("nan")  # open loop: latency from the actual send (the server's share; no client lateness)
    p99_from_send_ms: float = float("nan")

    @property
    def rejected(self) -> int:
        return self.errors.get("rejected", 0)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(target: Target, mode: str, duration_s: float, parts: list[harness.Tally], where: list[dict], rate: float, concurrency: int) -> Result:
    t = harness.Tally.merge(parts)
    s = t.summary()
    wall = max((p.wall_s for p in parts), default=duration_s) or duration_s
    return Result(
        target=target.name, mode=mode, concurrency=concurrency, rate=rate, duration_s=duration_s, sent=t.sent, ok=t.ok,
        errors=dict(t.errors), error_samples=t.error_samples, dropped=t.unsent, scheduled=t.scheduled if mode == "open" else t.sent,
        throughput=t.ok / duration_s, achieved_rate=t.sent / duration_s, p50_ms=s["p50_ms"], p90_ms=s["p90_ms"], p99_ms=s["p99_ms"],
        p999_ms=s["p999_ms"], mean_ms=s["mean_ms"], max_ms=s["max_ms"], client_cpu_cores=t.cpu_s / wall,
        client_cpu_us_per_request=1e6 * t.cpu_s / max(t.sent, 1), send_lag_ms_p99=s.get("send_lag_ms_p99", 0.0),
        workers=[{**w, "cpu_cores": round(p.cpu_s / max(p.wall_s, 1e-9), 3)} for w, p in zip(where, parts)],
        sent_total=sum(p.sent_all for p in parts),
        p50_from_send_ms=s.get("p50_from_send_ms", float("nan")), p99_from_send_ms=s.get("p99_from_send_ms", float("nan")),
    )


# -- the worker side (a harness session) -----------------------------------------------------------
def _classify_grpc(exc: BaseException) -> str:
    import grpc

    if isinstance(exc, (grpc.aio.AioRpcError, grpc.RpcError)):
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and any(m in (exc.details() or "").lower() for m in _REJECTION_MESSAGES):
            return "rejected"
        return "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name.lower()
    return type(exc).__name__


def _grpc_text(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    return (details() if callable(details) else "") or str(exc)


class _GrpcSender:
    """Prebuilt request bytes through a raw unary call: no protobuf work per request."""

    def __init__(self, target: Target, client: str) -> None:
        import grpc

        self.target = target
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(target.address, options=opts)
        if client == "tritonclient":
            from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pbg

            self.payloads = [pb.ModelInferRequest.FromString(p) for p in target.payloads]
            self.call = pbg.GRPCInferenceServiceStub(self.channel).ModelInfer
        else:
            self.payloads = list(target.payloads)
            self.call = self.channel.unary_unary(GRPC_INFER_PATH)  # bytes in, bytes out
        self.timeout = target.deadline_s

    async def send(self, i: int) -> None:
        await self.call(self.payloads[i % len(self.payloads)], timeout=self.timeout)

    classify = staticmethod(_classify_grpc)

    async def preflight(self) -> str:
        from tritonclient.grpc import service_pb2 as pb

        call = self.channel.unary_unary(GRPC_INFER_PATH)
        for attempt in range(10):
            try:
                raw = await call(self.target.payloads[0], timeout=min(self.timeout, 10.0))
                break
            except Exception as exc:  # reported to the caller with the server's words
                kind = self.classify(exc)
                # A queue-policy rejection means "busy", not "misconfigured": try again shortly.
                if kind != "rejected" or attempt == 9:
                    return f"{kind}: {_grpc_text(exc)}"
                await asyncio.sleep(0.05 * (attempt + 1))
        return "" if pb.ModelInferResponse.FromString(raw).outputs else "the response has no outputs"

    async def close(self) -> None:
        await self.channel.close()


class _HttpConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.need = -1  # bytes of the whole response once the header is parsed
        self.body_at = 0
        self.status = 0
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionResetError("connection closed by the server")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            self.status = int(head[9:12])
            i = head.find(b"content-length:")
            if i < 0:
                if self.waiter is not None and not self.waiter.done():
                    self.waiter.set_exception(RuntimeError("response without Content-Length (chunked responses are not supported)"))
                return
            j = head.find(b"\r\n", i)
            self.body_at = end + 4
            self.need = self.body_at + int(head[i + 15:j if j > 0 else None])
        if len(self.buf) >= self.need:
            body = bytes(self.buf[self.body_at:self.need])
            status = self.status
            del self.buf[:self.need]
            self.need = -1
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((status, body))

    async def request(self, payload: bytes) -> tuple[int, bytes]:
        if self.lost is not None:
            raise self.lost
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return await self.waiter


class _HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class _HttpSender:
    """Prebuilt HTTP/1.1 requests on keep-alive connections (one per outstanding request)."""

    def __init__(self, target: Target, client: str) -> None:
        self.target = target
        self.host, port = target.address.rsplit(":", 1)
        self.port = int(port)
        self.idle: list = []
        self.client = client
        self.session = None
        self.timeout = target.deadline_s

    async def _connect(self) -> _HttpConnection:
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(loop.create_connection(_HttpConnection, self.host, self.port), self.timeout)
        return proto

    async def send(self, i: int) -> None:
        payload = self.target.payloads[i % len(self.target.payloads)]
        if self.client == "aiohttp":
            return await self._send_aiohttp(payload)
        conn = self.idle.pop() if self.idle else await self._connect()
        try:
            status, body = await asyncio.wait_for(conn.request(payload), self.timeout)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()  # its state is unknown: never reuse it
            raise
        self.idle.append(conn)
        if status != 200:
            raise _HttpError(status, body)

    async def _send_aiohttp(self, payload: bytes) -> None:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout))
        head, body = payload.split(b"\r\n\r\n", 1)
        path = head.split(b" ")[1].decode()
        async with self.session.post(f"http://{self.target.address}{path}", data=body, headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
            if r.status != 200:
                raise _HttpError(r.status, data)

    def classify(self, exc: BaseException) -> str:
        if isinstance(exc, _HttpError):
            return "rejected" if exc.status in (429, 503) else f"http_{exc.status}"
        if isinstance(exc, asyncio.TimeoutError):
            return "deadline"
        return "unavailable" if isinstance(exc, OSError) else type(exc).__name__

    async def preflight(self) -> str:
        try:
            conn = await self._connect()
            status, body = await asyncio.wait_for(conn.request(self.target.payloads[0]), min(self.timeout, 10.0))
        except Exception as exc:  # reported with its reason
            return f"{self.classify(exc)}: {type(exc).__name__}: {exc}"
        self.idle.append(conn)
        if status != 200:
            return f"HTTP {status}: {body[:300].decode(errors='replace')}"
        try:
            json.loads(body)
        except ValueError:
            return f"the response is not JSON: {body[:100]!r}"
        return ""

    async def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()
        if self.session is not None:
            await self.session.close()


class _Session:
    """What a harness worker holds for a target: its sender, and where the worker runs."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.sender = None

    async def __aenter__(self) -> "_Session":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.sender is not None:
            await self.sender.close()

    async def use(self, target: Target) -> str:
        """Switch to `target` and send one preflight request: "" when it answered, else why not."""
        if self.sender is not None and self.sender.target != target:
            await self.sender.close()
            self.sender = None
        if self.sender is None:
            client = self.settings["grpc_client"] if target.protocol == "grpc" else self.settings["http_client"]
            self.sender = (_GrpcSender if target.protocol == "grpc" else _HttpSender)(target, client)
        self.send, self.classify = self.sender.send, self.sender.classify
        return await self.sender.preflight()

    async def where(self) -> dict:
        return {"affinity": sorted(os.sched_getaffinity(0)), "last_cpu": psutil.Process().cpu_num()}


def session(settings: dict, index: int) -> _Session:
    return _Session(settings)


# -- the parent side -------------------------------------------------------------------------------
class LoadGenerator:
    """A pool of load worker processes (harness.Workers), kept across measurements (spawned once).

    `cpus`: pin the workers to these cores (round-robin one core per worker when there are as
    many cores as workers, else the whole set). `server_pids`: a callable returning the process
    ids whose CPU time (with their children) is charged to the server for each measurement.
    """

    def __init__(self, workers: int = 1, cpus: Sequence[int] | None = None, http_client: str = "raw", grpc_client: str = "raw") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        uvloop = os.environ.get("LOADGEN_LOOP", "uvloop") == "uvloop"
        self._pool = harness.Workers(workers, "loadgen:session", {"http_client": http_client, "grpc_client": grpc_client, "uvloop": uvloop}, cpus=cpus)

    @property
    def workers(self) -> int:
        return self._pool.n

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "LoadGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def closed(self, target: Target, concurrency: int, duration_s: float = 3.0, warmup_s: float = 0.5,
               server_pids: Callable[[], list[int]] | None = None) -> Result:
        """`concurrency` callers (split over the workers) for `duration_s` after `warmup_s`."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        shares = harness.split(concurrency, min(self.workers, concurrency))
        jobs = [{"concurrency": c, "duration_s": duration_s, "warmup_s": warmup_s} for c in shares]
        return self._run(target, "closed", jobs, duration_s, warmup_s, server_pids, 0.0, concurrency)

    def open(self, target: Target, rate: float, duration_s: float = 3.0, warmup_s: float = 0.5, max_inflight: int = 4096,
             server_pids: Callable[[], list[int]] | None = None, seed: int = 0) -> Result:
        """Poisson arrivals at `rate` per second (split over the workers); latency from the scheduled send time."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        jobs = [{"rate": rate / self.workers, "duration_s": duration_s, "warmup_s": warmup_s, "seed": seed * 1000 + w,
                 "offset": w, "stride": self.workers, "max_inflight": max_inflight} for w in range(self.workers)]
        return self._run(target, "open", jobs, duration_s, warmup_s, server_pids, rate, 0)

    def _run(self, target: Target, mode: str, jobs: list[dict], duration_s: float, warmup_s: float, server_pids, rate: float, concurrency: int) -> Result:
        n = len(jobs)
        try:
            failed = [r for r in self._pool.run("use", [{"target": target}] * n, timeout_s=target.deadline_s + 60) if r]
        except harness.WorkerError as exc:
            raise LoadGenError(f"target {target.name}: load worker failed: {exc}") from exc
        if failed:
            what = f"model {target.model!r}" if target.protocol == "grpc" else f"path {target.model!r}"
            raise LoadGenError(f"target {target.name} ({target.protocol} {target.address}, {what}): the first request failed: {failed[0]}")
        # All workers start together at start_at; the server's CPU is read over the counted span.
        start_at = time.monotonic() + 0.2
        self._pool.send(mode, [{**j, "start_at": start_at} for j in jobs])
        cpu = None
        if server_pids is not None:
            time.sleep(max(0.0, start_at + warmup_s - time.monotonic()))
            cpu0 = (harness.cpu_seconds(server_pids()), time.monotonic())
            time.sleep(max(0.0, start_at + warmup_s + duration_s - time.monotonic()))
            cpu = (harness.cpu_seconds(server_pids()) - cpu0[0], time.monotonic() - cpu0[1])
        try:
            got = self._pool.gather(warmup_s + 2 * duration_s + target.deadline_s + 60, n)
            where = self._pool.run("where", [{}] * n, timeout_s=30)
        except harness.WorkerError as exc:
            raise LoadGenError(f"target {target.name}: load worker failed: {exc}") from exc
        parts = [g[0] if mode == "open" else g for g in got]
        res = summarize(target, mode, duration_s, parts, where, rate, concurrency)
        if cpu is not None:
            res.server_cpu_cores = cpu[0] / max(cpu[1], 1e-9)
            res.server_cpu_us_per_request = 1e6 * cpu[0] / max(res.sent, 1)
        return res


H2LOAD_INSTALL = "apt-get install nghttp2-client (Debian/Ubuntu)"


def h2load_missing() -> str | None:
    """None when nghttp2's h2load (a C HTTP/2 load generator) is on PATH, else why not and how to get it."""
    import shutil

    return None if shutil.which("h2load") else f"h2load is not installed ({H2LOAD_INSTALL})"


def _h2load_version() -> str:
    import subprocess

    out = subprocess.run(["h2load", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    return out.splitlines()[0] if out else "h2load"


def h2load_open(target: Target, rate: float, duration_s: float, cpus: Sequence[int] | None = None, *, clients: int = 8,
                streams: int = 4096, workdir: str | None = None, drain: bool = False) -> dict:
    """Open loop at `rate` requests/s from nghttp2's h2load: one C thread, `clients` HTTP/2 connections each sending
    at rate/clients per second (h2load's --rps: evenly spaced, not Poisson), up to `streams` outstanding per connection.

    Why: the Python generator needs ~0.15 ms of CPU per open-loop request, so one core cannot offer more than a
    server pinned to the other core carries; h2load can. Every request is the target's first prebuilt
    ModelInferRequest in gRPC framing. h2load knows HTTP status only (gRPC errors come as HTTP 200 with a
    grpc-status trailer), so the caller counts rejections on the server (Triton's statistics); latencies here
    are of every answer, from the actual send, with h2load's own CPU share and its achieved send rate.

    `drain`: send rate x duration requests and wait for every answer (h2load -n) instead of stopping at the
    duration with requests still open: Triton 2.51's gRPC frontend can crash when in-flight calls are cancelled
    (server#7368), which h2load's stop at -D does to every stream still open.
    """
    out = _h2load(target, ["--rps", str(max(1, round(rate / clients)))], clients, streams, duration_s, cpus, workdir,
                  requests=max(clients, round(rate * duration_s)) if drain else None)
    return {**out, "rate": rate}


def h2load_closed(target: Target, connections: int, streams: int, duration_s: float, cpus: Sequence[int] | None = None, *,
                  workdir: str | None = None, requests: int | None = None) -> dict:
    """Closed loop from h2load: `connections` HTTP/2 connections with `streams` requests outstanding on each (each
    answer sends the next at once), so connections x streams callers. One Python process on 2 shared cores tops out
    near 10-16k req/s on this machine; h2load's closed loop reached 26-34k against the same server. With `requests`
    it sends that many and waits for every answer (h2load -n) instead of stopping at `duration_s` with
    connections x streams calls cancelled (see h2load_open's `drain`)."""
    return _h2load(target, [], connections, streams, duration_s, cpus, workdir, requests=requests)


def _h2load(target: Target, extra: list[str], clients: int, streams: int, duration_s: float, cpus: Sequence[int] | None,
            workdir: str | None, requests: int | None = None) -> dict:
    import resource
    import subprocess
    import tempfile

    if target.protocol != "grpc":
        raise LoadGenError(f"target {target.name}: the h2load generator speaks gRPC only")
    missing = h2load_missing()
    if missing:
        raise LoadGenError(missing)
    body = target.payloads[0]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        body_file, log_file = os.path.join(tmp, "body.bin"), os.path.join(tmp, "log.tsv")
        with open(body_file, "wb") as f:
            f.write(b"\x00" + len(body).to_bytes(4, "big") + body)
        cmd = ["h2load", f"http://{target.address}{GRPC_INFER_PATH}", "-t", "1", "-c", str(clients), "-m", str(streams), *extra,
               *(["-n", str(requests)] if requests else ["-D", str(max(1, round(duration_s)))]), "-d", body_file,
               "-H", "content-type: application/grpc", "-H", "te: trailers", "--log-file", log_file]
        if cpus:
            cmd = ["taskset", "-c", ",".join(str(c) for c in cpus), *cmd]
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=(4 if requests else 1) * duration_s + target.deadline_s + 60)
        wall = time.monotonic() - t0
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise LoadGenError(f"target {target.name}: h2load exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
        rows = np.loadtxt(log_file, dtype=np.int64, ndmin=2) if os.path.getsize(log_file) else np.zeros((0, 3), np.int64)
    lat = rows[:, 2] / 1000.0
    http_ok = int(np.sum((rows[:, 1] >= 200) & (rows[:, 1] < 300))) if len(rows) else 0
    summary = [ln.strip() for ln in done.stdout.splitlines() if ln.strip().startswith(("requests:", "status codes:", "finished in"))]
    span = (rows[:, 0].max() - rows[:, 0].min()) / 1e6 if len(rows) > 1 else float(duration_s)
    # First send to last answer: what a served rate is over when the answers outlast the sends (-n, drained).
    answer_span = ((rows[:, 0] + rows[:, 2]).max() - rows[:, 0].min()) / 1e6 if len(rows) > 1 else float(duration_s)
    pct = np.percentile(lat, PERCENTILES) if len(lat) else [float("nan")] * len(PERCENTILES)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {
        "generator": f"{_h2load_version()}, 1 thread, {clients} connections x {streams} streams",
        "duration_s": span, "answer_span_s": answer_span, "answered": len(rows), "http_2xx": http_ok,
        "achieved_rate": len(rows) / max(span, 1e-9), "latencies_ms": lat,
        "p50_ms": float(pct[0]), "p90_ms": float(pct[1]), "p99_ms": float(pct[2]), "p999_ms": float(pct[3]), "max_ms": float(lat.max()) if len(lat) else float("nan"),
        "client_cpu_cores": cpu / max(wall, 1e-9), "h2load_summary": summary,
    }


def main() -> None:
    """Ad-hoc runs: loadgen.py grpc HOST:PORT MODEL INPUT NFEATURES --concurrency 16 | --rate 1000."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("protocol", choices=["grpc", "http"])
    ap.add_argument("address")
    ap.add_argument("model", help="gRPC model name, or HTTP path (body: {\"features\": [...]})")
    ap.add_argument("--input", default="input__0")
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--cpus", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--http-client", default="raw", choices=["raw", "aiohttp"])
    ap.add_argument("--grpc-client", default="raw", choices=["raw", "tritonclient"])
    args = ap.parse_args()
    rows = np.random.default_rng(0).normal(size=(64, args.features)).astype(np.float32)
    if args.protocol == "grpc":
        t = grpc_target("adhoc", args.address, args.model, args.input, rows)
    else:
        t = http_target("adhoc", args.address, args.model, [{"features": r.tolist()} for r in rows])
    with LoadGenerator(args.workers, args.cpus, http_client=args.http_client, grpc_client=args.grpc_client) as gen:
        r = gen.open(t, args.rate, args.duration) if args.rate else gen.closed(t, max(args.concurrency, 1), args.duration)
    d = r.to_dict()
    print(json.dumps(d, indent=1))


if __name__ == "__main__":
    main()
