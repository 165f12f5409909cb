"""The phases of one service request, measured: where its milliseconds went, as a user would optimize them.

`measure` sends requests through any service's `send(i)` (the demo's traffic uses it:
scorestack.demo.traffic) and combines the client's per-phase timings with the change in Triton's
statistics over the run (`server_snapshot`) into a `Breakdown`:
- features: waiting for the feature store on the critical path (the fetch overlaps validation)
- client: validating the request and assembling the feature matrix in the model's order
- queue: time in Triton's scheduler queue (dynamic batcher, busy instances)
- compute: Triton compute input + infer + output (the model itself)
- network: the rest of the Triton call as the client saw it (gRPC, serialization, the event loop)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from scorestack.client.server_stats import settled
from scorestack.client.triton import TritonClient
from scorestack.errors import InferenceError

ADVICE = {
    "features": "feature fetch dominates: cache slow-moving views, coalesce concurrent fetches, use the direct Redis reader for many entities (features/)",
    "client": "request handling dominates: validate once at the edge, assemble with vectorized numpy, avoid per-row Python work",
    "queue": "queueing dominates: add model instances (instance_group count), lower max_queue_delay_microseconds, or add replicas and scale on queue time",
    "compute": "model compute dominates: compile to a faster verified format, quantize, or prune/distill to a smaller model (scorestack compile passes)",
    "network": "network/serialization dominates: batch candidates into fewer calls, reuse one gRPC channel, use shared memory for large tensors",
}


@dataclass(frozen=True)
class ServerSnapshot:
    """Cumulative Triton statistics of one model (nanoseconds and counts)."""

    success_count: int
    success_ns: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    cache_hit_count: int
    inference_count: int
    execution_count: int


async def server_snapshot(triton: TritonClient, model: str) -> ServerSnapshot:
    """Triton's statistics API is restricted on a server started with an admin key: send it (triton.admin_key)."""
    from tritonclient.utils import InferenceServerException

    from scorestack.serve.control import admin_refusal

    try:
        stats = await triton.grpc.get_inference_statistics(model, headers=triton.admin_headers, as_json=True, client_timeout=5)
    except InferenceServerException as exc:
        message = exc.message() or str(exc)
        if "restricted" in message.lower():
            raise admin_refusal(triton.url, triton.admin_key, f"the statistics of model {model!r}", message) from exc
        raise InferenceError(f"model {model!r}: statistics unavailable from Triton at {triton.url}: {message}") from exc
    # One entry per served version (a model keeps two by default): summed, as the model's traffic
    # moves to the new version after a hot swap (entry 0 alone was the old, idle one: all zeros).
    entries = stats.get("model_stats") or [{}]

    def g(name: str, key: str) -> int:
        return sum(int(e.get("inference_stats", {}).get(name, {}).get(key, 0) or 0) for e in entries)

    def total(key: str) -> int:
        return sum(int(e.get(key, 0) or 0) for e in entries)

    return ServerSnapshot(
        success_count=g("success", "count"),
        success_ns=g("success", "ns"),
        queue_ns=g("queue", "ns"),
        compute_input_ns=g("compute_input", "ns"),
        compute_infer_ns=g("compute_infer", "ns"),
        compute_output_ns=g("compute_output", "ns"),
        cache_hit_count=g("cache_hit", "count"),
        inference_count=total("inference_count"),
        execution_count=total("execution_count"),
    )


@dataclass
class Breakdown:
    """Mean milliseconds per request of each phase, with the dominant phase and what to do about it."""

    service: str
    model: str
    requests: int
    phases_ms: dict[str, float]
    p50_total_ms: float
    p99_total_ms: float
    degraded: int
    avg_batch: float
    dominant: str = ""
    advice: str = ""
    client_phase_p50: dict[str, float] = field(default_factory=dict)
    client_phase_p99: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by error type (e.g. OverloadedError)

    def __post_init__(self) -> None:
        self.dominant = max(self.phases_ms, key=self.phases_ms.__getitem__)
        self.advice = ADVICE[self.dominant]


def breakdown(
    service: str,
    model: str,
    timings: Sequence[dict[str, float]],
    calls: int,
    before: ServerSnapshot,
    after: ServerSnapshot,
    degraded: int = 0,
) -> Breakdown:
    """Combine client timings of `len(timings)` requests (which made `calls` Triton calls) with the server delta."""
    n = len(timings)
    if n == 0:
        raise ValueError("breakdown needs at least one request")
    mean = lambda key: float(np.mean([t.get(key, 0.0) for t in timings]))
    served = max(after.success_count - before.success_count, 1)
    per_call = lambda ns: (ns / served) / 1e6
    queue = per_call(after.queue_ns - before.queue_ns)
    compute = per_call(
        (after.compute_input_ns - before.compute_input_ns)
        + (after.compute_infer_ns - before.compute_infer_ns)
        + (after.compute_output_ns - before.compute_output_ns)
    )
    server_request = per_call(after.success_ns - before.success_ns)
    calls_per_request = calls / n
    infer = mean("infer")
    # Concurrent chunks overlap: a request that made several calls waited about one call's server
    # time, not their sum.
    scale = min(calls_per_request, 1.0)
    queue_r, compute_r, server_r = (x * scale for x in (queue, compute, server_request))
    network = max(infer - server_r, 0.0)
    phases = {
        "features": mean("features_wait"),
        "client": mean("validate") + mean("assemble"),
        "queue": queue_r,
        "compute": compute_r,
        "network": network,
    }
    totals = np.array([t["total"] for t in timings])
    executions = max(after.execution_count - before.execution_count, 1)
    keys = ("validate", "features", "features_wait", "assemble", "infer", "total")
    return Breakdown(
        service=service,
        model=model,
        requests=n,
        phases_ms=phases,
        p50_total_ms=float(np.percentile(totals, 50)),
        p99_total_ms=float(np.percentile(totals, 99)),
        degraded=degraded,
        avg_batch=(after.inference_count - before.inference_count) / executions,
        client_phase_p50={k: float(np.percentile([t.get(k, 0.0) for t in timings], 50)) for k in keys},
        client_phase_p99={k: float(np.percentile([t.get(k, 0.0) for t in timings], 99)) for k in keys},
    )


async def measure(
    triton: TritonClient,
    service: str,
    model: str,
    send: Callable[[int], Awaitable[Any]],
    n: int,
    *,
    concurrency: int = 1,
    warmup: int = 10,
) -> Breakdown:
    """Send `n` requests through `send(i)` (returning a result with `timings_ms`, `degraded`, maybe `chunks`).

    A request that fails with an InferenceError (e.g. rejected by the queue policy under load) is
    counted in `errors`, not timed: the breakdown describes the requests that were served.
    """
    # Triton counts a request after its response is sent: the starting reading waits until the
    # warm-up calls are counted, so none of them lands inside the measured window.
    pre = await server_snapshot(triton, model)
    warm_calls = 0
    for i in range(warmup):
        warm_calls += getattr(await send(i), "chunks", 1)
    before = await settled(lambda: server_snapshot(triton, model), lambda s: s.success_count - pre.success_count >= warm_calls)
    results: list[Any] = []
    errors: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            try:
                results.append(await send(warmup + i))
            except InferenceError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    await asyncio.gather(*(one(i) for i in range(n)))
    calls = sum(getattr(r, "chunks", 1) for r in results)
    after = await settled(lambda: server_snapshot(triton, model), lambda s: s.success_count - before.success_count >= calls)
    if not results:
        raise InferenceError(f"model {model!r}: all {n} {service} requests failed: {errors}")
    b = breakdown(service, model, [r.timings_ms for r in results], calls, before, after, sum(bool(r.degraded) for r in results))
    b.errors = errors
    return b


def render(breakdowns: Sequence[Breakdown]):
    """A rich Table of per-phase p50/p99 and the diagnosis per service."""
    from rich.table import Table

    table = Table(title="Where the time goes (ms per request)")
    for col in ("service", "phase", "p50", "p99", "mean"):
        table.add_column(col, justify="right" if col in ("p50", "p99", "mean") else "left")
    for b in breakdowns:
        for key in ("validate", "features", "features_wait", "assemble", "infer", "total"):
            table.add_row(b.service, key, f"{b.client_phase_p50[key]:.3f}", f"{b.client_phase_p99[key]:.3f}", "")
        for key, value in b.phases_ms.items():
            table.add_row(b.service, f"[bold]{key}[/bold] (mean)", "", "", f"{value:.3f}")
    return table


def diagnosis_line(b: Breakdown) -> str:
    share = b.phases_ms[b.dominant] / max(sum(b.phases_ms.values()), 1e-9)
    failed = f" ({sum(b.errors.values())} failed: {', '.join(f'{k} {v}' for k, v in b.errors.items())})" if b.errors else ""
    return (
        f"{b.service}: p50 {b.p50_total_ms:.2f} ms, p99 {b.p99_total_ms:.2f} ms over {b.requests} requests{failed}; "
        f"{b.dominant} is {share:.0%} of the time -> {b.advice}"
    )
