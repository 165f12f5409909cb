"""The peers' load generator: nghttp2's h2load, one C client for every target and protocol.

HTTP/1.1 (one request outstanding per keep-alive connection) and gRPC over h2c (prebuilt
ModelInferRequest, streams on up to GRPC_CONNECTIONS connections); fixed request counts, every answer
awaited (Triton 2.51's gRPC frontend handles cancelled calls badly, server#7368); h2load's per-request
log gives the percentiles. h2load sees HTTP status only, so the suite checks answers for value first and
counts Triton's failures from its statistics. docs/benchmarks.md ("The load generator") says why.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

import harness

GRPC_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
H2LOAD_INSTALL = "apt-get install nghttp2-client (Debian/Ubuntu; scripts/setup.sh does it where apt-get is available)"
GRPC_CONNECTIONS = 8  # at most this many HTTP/2 connections; the rest of the concurrency is streams on them
OPEN_HTTP_CONNECTIONS = 64


class LoadGenError(RuntimeError):
    """The load could not be run against a target (h2load missing or failing, nothing answered)."""


@dataclass(frozen=True)
class Target:
    """One prebuilt request and where it goes: `path` on `address`, HTTP/1.1 or gRPC (h2c)."""

    name: str
    protocol: str  # "grpc" | "http"
    address: str  # host:port
    path: str
    body: bytes
    headers: tuple[str, ...] = ()
    description: str = ""


def grpc_target(name: str, address: str, model: str, input_name: str, row: np.ndarray, *, description: str = "") -> Target:
    """A KServe v2 ModelInferRequest of one float32 row (shape [1, n]) in gRPC framing."""
    from tritonclient.grpc import service_pb2 as pb

    row = np.ascontiguousarray(row, dtype=np.float32).reshape(1, -1)
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=input_name, datatype="FP32", shape=list(row.shape))
    req.raw_input_contents.append(row.tobytes())
    msg = req.SerializeToString()
    return Target(name, "grpc", address, GRPC_INFER_PATH, b"\x00" + len(msg).to_bytes(4, "big") + msg,
                  ("content-type: application/grpc", "te: trailers"), description)


def http_target(name: str, address: str, path: str, body: bytes, *, content_type: str = "application/json",
                headers: Sequence[str] = (), description: str = "") -> Target:
    """An HTTP/1.1 POST of `body` (JSON, or Triton's binary tensor extension with its header) on keep-alive connections."""
    return Target(name, "http", address, path, body, (f"content-type: {content_type}", *headers), description)


def h2load_missing() -> str | None:
    """None when h2load is on PATH, else why not and how to get it."""
    return None if shutil.which("h2load") else f"h2load is not installed ({H2LOAD_INSTALL})"


def version() -> str:
    out = subprocess.run(["h2load", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    return out.splitlines()[0] if out else "h2load"


def shape(target: Target, concurrency: int) -> tuple[int, int]:
    """(connections, streams per connection) for `concurrency` outstanding requests."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if target.protocol == "http":
        return concurrency, 1
    connections = min(concurrency, GRPC_CONNECTIONS)
    return connections, math.ceil(concurrency / connections)


def run(target: Target, connections: int, streams: int, requests: int, *, rps: int | None = None,
        cpus: Sequence[int] | None = None, pids: Callable[[], list[int]] | None = None, timeout_s: float = 120.0) -> dict:
    """One h2load run of `requests` requests (every answer awaited); `rps` per connection makes it an open loop.

    Returns the answers' latency percentiles (ms, from the actual send), the served rate over first send to last
    answer, HTTP status counts, h2load's CPU in cores, and with `pids` the server's CPU µs per request."""
    missing = h2load_missing()
    if missing:
        raise LoadGenError(missing)
    requests = max(requests, connections)
    with tempfile.TemporaryDirectory() as tmp:
        body_file, log_file = os.path.join(tmp, "body"), os.path.join(tmp, "log.tsv")
        with open(body_file, "wb") as f:
            f.write(target.body)
        cmd = ["h2load", f"http://{target.address}{target.path}", "-t", "1", "-c", str(connections), "-m", str(streams),
               "-n", str(requests), "-d", body_file, "--log-file", log_file, *(["--h1"] if target.protocol == "http" else []),
               *(["--rps", str(rps)] if rps else [])]
        for h in target.headers:
            cmd += ["-H", h]
        if cpus:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        server0 = harness.cpu_seconds(pids()) if pids else None
        usage0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise LoadGenError(f"target {target.name}: h2load did not finish {requests} requests in {timeout_s:.0f} s") from exc
        wall = time.monotonic() - t0
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        server_s = harness.cpu_seconds(pids()) - server0 if pids else None
        if done.returncode != 0:
            raise LoadGenError(f"target {target.name}: h2load exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
        rows = np.loadtxt(log_file, dtype=np.int64, ndmin=2) if os.path.getsize(log_file) else np.zeros((0, 3), np.int64)
    if len(rows) == 0:
        raise LoadGenError(f"target {target.name}: no request was answered ({done.stdout.strip()[-400:]})")
    lat = rows[:, 2] / 1000.0
    ok = int(np.sum((rows[:, 1] >= 200) & (rows[:, 1] < 300)))
    span = max(((rows[:, 0] + rows[:, 2]).max() - rows[:, 0].min()) / 1e6, 1e-9)
    statuses = {str(s): int(n) for s, n in zip(*np.unique(rows[:, 1], return_counts=True))}
    pct = np.percentile(lat, harness.PERCENTILES)
    out = {"requests": int(len(rows)), "http_ok": ok, "http_statuses": statuses, "seconds": span, "throughput": ok / span,
           "p50_ms": float(pct[0]), "p90_ms": float(pct[1]), "p99_ms": float(pct[2]), "p999_ms": float(pct[3]),
           "max_ms": float(lat.max()), "client_cpu_cores": ((usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)) / max(wall, 1e-9),
           "connections": connections, "streams": streams, "wall_s": wall}
    if server_s is not None:
        out["server_cpu_us_per_request"] = 1e6 * server_s / len(rows)
        out["server_cpu_cores"] = server_s / max(wall, 1e-9)
    if rps:
        out["rate"] = rps * connections
        out["achieved_rate"] = len(rows) / max((rows[:, 0].max() - rows[:, 0].min()) / 1e6, 1e-9)
    return out


def closed(target: Target, concurrency: int, duration_s: float, *, cpus: Sequence[int] | None = None,
           pids: Callable[[], list[int]] | None = None) -> dict:
    """Closed loop at `concurrency` for about `duration_s`: a first run of ~a quarter of that (warm-up, not kept)
    sizes the measured one."""
    connections, streams = shape(target, concurrency)
    probe = run(target, connections, streams, max(50 * concurrency, 200), cpus=cpus, timeout_s=60 + 30 * duration_s)
    n = max(20 * concurrency, round(probe["requests"] / probe["seconds"] * duration_s))
    return {**run(target, connections, streams, n, cpus=cpus, pids=pids, timeout_s=60 + 30 * duration_s), "concurrency": concurrency}


def open_loop(target: Target, rate: float, duration_s: float, *, cpus: Sequence[int] | None = None,
              pids: Callable[[], list[int]] | None = None) -> dict:
    """Open loop at about `rate` requests/s for `duration_s`: evenly spaced sends from each connection
    (HTTP/1.1: 64 connections, one outstanding each; gRPC: 8 connections, up to 4,096 streams each)."""
    connections = OPEN_HTTP_CONNECTIONS if target.protocol == "http" else GRPC_CONNECTIONS
    streams = 1 if target.protocol == "http" else 4096
    rps = max(1, round(rate / connections))
    return run(target, connections, streams, round(rps * connections * duration_s), rps=rps, cpus=cpus, pids=pids,
               timeout_s=60 + 30 * duration_s)
