"""Where does the time go? Triton's per-model statistics (+ the client's phases) -> a breakdown and a decision.

Any deployment: `watch` reads Triton's statistics over a window of live traffic and sends nothing;
`client/replay.py` sends rows at a concurrency or rate; with the client's exported histograms
(client/metrics.py) the request path is diagnosed end to end. `measure` times requests sent through
any service's `send(i)` against Triton's statistics (the demo's traffic uses it:
scorestack.demo.traffic).

Phases of one service request (`measure`, `Breakdown`), as a user would optimize them:
- features: waiting for the feature store on the critical path (the fetch overlaps validation)
- client: validating the request and assembling the feature matrix in the model's order
- queue: time in Triton's scheduler queue (dynamic batcher, busy instances)
- compute: Triton compute input + infer + output (the model itself)
- network: the rest of the Triton call as the client saw it (gRPC, serialization, the event loop)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from scorestack.client.advice import OTHER_ADVICE, Decision, FeatureSide, ServedConfig, decide_compute, decide_features, decide_queue
from scorestack.client.metrics import Scrape
from scorestack.client.server_stats import SERVER_PHASES, ModelStats, failures_by_reason, fetch_text, read_statistics, settled
from scorestack.client.triton import TritonClient
from scorestack.errors import InferenceError
from scorestack.serve.security import ClientTls, load_admin_key

if TYPE_CHECKING:
    from scorestack.compile.report import CompileReport

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
    for i in range(warmup):
        await send(i)
    before = await server_snapshot(triton, model)
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


# --- any deployment: passive watching, replay, and the client's exported metrics ----------------

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ClientSide:
    """What the client measured for a model over the window (replay, or a service's exported histograms)."""

    service: str
    requests: int
    mean_ms: dict[str, float]  # per phase the client timed, and `total`
    p50_ms: float | None = None  # replay only: per-request totals are known
    p99_ms: float | None = None
    triton_calls_per_request: float = 1.0


@dataclass(frozen=True)
class Diagnosis:
    """Where one model's time went over a window, and what to do about it.

    `phases_ms` are mean milliseconds per request of named phases; they and `unattributed_ms` add
    up to `measured_ms`: Triton's mean request time when only the server was watched, the client's
    mean latency when the client side is known (replay, --client-metrics).
    """

    model: str
    mode: str  # passive | replay | client-metrics
    window_s: float
    requests: int  # Triton successes in the window
    failed: int
    failures: dict[str, int]  # by Triton's reason (REJECTED: queue policy), when /metrics was read
    rejected: int | None  # queue-policy rejections; None when /metrics was not read
    cache_hits: int
    cache_hit_rate: float
    executions: int
    rows: int
    batch_sizes: dict[int, int]  # executed batch size -> executions
    server_total_ms: dict[str, float]  # window totals: Triton's `success` and each server phase
    server_mean_ms: float  # Triton's mean time per successful request
    phases_ms: dict[str, float]
    measured_ms: float
    unattributed_ms: float
    attributed_share: float
    dominant: str
    decision: Decision
    client: ClientSide | None = None
    notes: tuple[str, ...] = ()


def _server_phases(stats: ModelStats) -> tuple[dict[str, float], dict[str, float], float]:
    """(mean ms per request of each server phase present, window totals in ms, mean request ms)."""
    n = max(stats.success.count, 1)
    totals = {"success": stats.success.ns / 1e6}
    means: dict[str, float] = {}
    for phase in SERVER_PHASES:
        ns = stats.phase_ns(phase)
        totals[phase] = ns / 1e6
        if phase != "cache" or ns > 0:
            means[phase] = ns / n / 1e6
    return means, totals, stats.success.ns / n / 1e6


def _decision(
    dominant: str,
    share: float,
    stats: ModelStats,
    ctx: "ModelContext",
    window_s: float,
    phases: Mapping[str, float],
) -> Decision:
    if dominant == "compute_infer":
        return decide_compute(share, stats, ctx.report, ctx.report_path, ctx.repository, ctx.stats_file, window_s)
    if dominant == "queue":
        return decide_queue(share, stats, ctx.config, window_s, phases["queue"])
    if dominant == "features":
        in_flight = ctx.client_requests * ctx.client_latency_ms / 1e3 / window_s if window_s > 0 else 0.0
        return decide_features(share, phases["features"], ctx.features, in_flight)
    technique = OTHER_ADVICE.get(dominant, "look closer at this phase")
    return Decision(dominant, share, technique, f"{dominant} is {phases[dominant]:.3f} ms of {sum(phases.values()):.3f} ms named per request")


@dataclass(frozen=True)
class ModelContext:
    """What the decision may read about one model besides its statistics."""

    config: ServedConfig | None
    report: "CompileReport | None"
    report_path: Path
    repository: Path
    stats_file: Path | None
    features: FeatureSide | None = None
    notes: tuple[str, ...] = ()
    client_requests: int = 0  # the client's requests in the window and their mean latency (Little's law)
    client_latency_ms: float = 0.0


def diagnose_model(
    mode: str,
    stats: ModelStats,
    window_s: float,
    ctx: ModelContext,
    *,
    client: ClientSide | None = None,
    client_phases: Mapping[str, float] | None = None,
    failures: Mapping[str, int] | None = None,
) -> Diagnosis:
    """One model's diagnosis from Triton's window statistics and, when known, the client's phases.

    With a client side, Triton's phases are scaled to one client request (a request that made
    several concurrent calls waited about one call's server time), `network` is the client's
    Triton call minus Triton's request time, and the client's other named phases join them.
    """
    server_means, totals, server_mean = _server_phases(stats)
    notes = list(ctx.notes)
    if client is None:
        phases = dict(server_means)
        measured = server_mean
    else:
        scale = min(client.triton_calls_per_request, 1.0)
        infer = client.mean_ms.get("infer", 0.0)
        phases = {k: v for k, v in (client_phases or {}).items()}
        phases.update({k: v * scale for k, v in server_means.items()})
        phases["network"] = max(infer - server_mean * scale, 0.0)
        if infer < server_mean * scale:
            notes.append(f"the client's Triton call ({infer:.3f} ms) is shorter than Triton's mean request ({server_mean * scale:.3f} ms): other traffic shares the model")
        measured = client.mean_ms.get("total", 0.0)
    named = sum(phases.values())
    unattributed = measured - named
    if stats.success.count == 0:
        dominant = "none"
        decision = Decision("none", 0.0, "watch while traffic flows", f"no successful request reached {stats.model!r} in the {window_s:.1f} s window ({stats.fail.count} failed)")
    else:
        dominant = max(phases, key=phases.__getitem__)
        share = phases[dominant] / measured if measured > 0 else 0.0
        if client is not None:
            ctx = replace(ctx, client_requests=client.requests, client_latency_ms=measured)
        decision = _decision(dominant, share, stats, ctx, window_s, phases)
    rejected = None if failures is None else int(failures.get("REJECTED", 0))
    return Diagnosis(
        model=stats.model,
        mode=mode,
        window_s=window_s,
        requests=stats.success.count,
        failed=stats.fail.count,
        failures=dict(failures or {}),
        rejected=rejected,
        cache_hits=stats.cache_hit.count,
        cache_hit_rate=stats.cache_hit.count / max(stats.success.count, 1),
        executions=stats.execution_count,
        rows=stats.inference_count,
        batch_sizes=dict(stats.batches),
        server_total_ms=totals,
        server_mean_ms=server_mean,
        phases_ms=phases,
        measured_ms=measured,
        unattributed_ms=unattributed,
        attributed_share=(named / measured) if measured > 0 else 0.0,
        dominant=dominant,
        decision=decision,
        client=client,
        notes=tuple(notes),
    )


def load_report(repository: Path, model: str) -> "tuple[CompileReport | None, Path, str | None]":
    """The model's compile report (<repository>/<model>/report.json), or None with the reason."""
    path = repository / model / "report.json"
    if not path.is_file():
        return None, path, None
    from pydantic import ValidationError

    from scorestack.compile.report import CompileReport

    try:
        return CompileReport.model_validate_json(path.read_text()), path, None
    except (OSError, ValueError, ValidationError) as exc:
        return None, path, f"compile report {path} unreadable ({str(exc).splitlines()[0]}); deciding without it"


async def _served_config(triton: TritonClient, model: str) -> ServedConfig | None:
    from tritonclient.utils import InferenceServerException

    try:
        return ServedConfig.from_json(await triton.grpc.get_model_config(model, as_json=True, client_timeout=5))
    except InferenceServerException:
        return None


async def _ready_models(triton: TritonClient, stats: Mapping[str, ModelStats]) -> list[str]:
    """Every model Triton reports statistics for that is ready now."""
    from tritonclient.utils import InferenceServerException

    ready = []
    for name in stats:
        try:
            if await triton.grpc.is_model_ready(name, client_timeout=5):
                ready.append(name)
        except InferenceServerException:
            continue
    return ready


def client_named_phases(means: Mapping[str, float]) -> dict[str, float]:
    """The client's own phases on the critical path: every timed phase but the Triton call (`infer`,
    split with Triton's statistics), `total`, and the fetch's own duration when the request's wait
    for it (`features_wait`) is known: the fetch overlaps validation, the wait does not."""
    out = {p: ms for p, ms in means.items() if p not in ("infer", "total", "features", "features_wait")}
    if "features_wait" in means or "features" in means:
        out["features"] = means.get("features_wait", means.get("features", 0.0))
    return out


def save_profile(path: Path, deltas: Sequence[ModelStats]) -> Path:
    """The window's statistics in Triton's JSON shape: `scorestack compile --batch-profile` reads them."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_stats": [d.to_triton_json() for d in deltas]}, indent=1))
    return path


@dataclass(frozen=True)
class Target:
    """Where the deployment is and what the diagnosis may read besides it."""

    url: str
    models: tuple[str, ...] = ()  # () = every ready model
    repository: Path | None = None  # compile reports: <repository>/<model>/report.json
    metrics_url: str | None = None  # Triton's /metrics (failure reasons: queue-policy rejections)
    stats_file: Path | None = None  # where the window's statistics are saved for --batch-profile
    tls: ClientTls | None = None


def open_client(target: Target) -> TritonClient:
    # The admin key comes from the environment only (serve.security.load_admin_key): never argv.
    return TritonClient(target.url, deadline_s=5.0, tls=target.tls or ClientTls.from_env(), admin_key=load_admin_key())


async def model_context(triton: TritonClient, target: Target, model: str, features: FeatureSide | None = None) -> ModelContext:
    from scorestack.paths import default_repository

    repository = (target.repository or default_repository()).resolve()
    report, report_path, problem = load_report(repository, model)
    return ModelContext(
        config=await _served_config(triton, model),
        report=report,
        report_path=report_path,
        repository=repository,
        stats_file=target.stats_file,
        features=features,
        notes=(problem,) if problem else (),
    )


def read_failures(target: Target) -> dict[str, dict[str, int]] | None:
    return None if target.metrics_url is None else failures_by_reason(fetch_text(target.metrics_url), target.metrics_url)


def failure_delta(before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None, model: str) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    b, a = before.get(model, {}), after.get(model, {})
    return {r: a[r] - b.get(r, 0) for r in a if a[r] - b.get(r, 0) > 0}


async def watch(
    target: Target,
    window_s: float,
    *,
    client_metrics: str | None = None,
    on_start: Callable[[list[str]], None] | None = None,
) -> list[Diagnosis]:
    """Passive: read Triton's statistics (and the client's metrics) before and after `window_s` of
    live traffic; sends no inference. `on_start(models)` runs once the first readings are taken."""
    import time

    if window_s <= 0:
        raise ValueError(f"window: {window_s} s; give a positive number of seconds of live traffic to watch")
    async with open_client(target) as triton:
        before = await read_statistics(triton, target.models or None)
        models = list(target.models) if target.models else await _ready_models(triton, before)
        if not models:
            raise InferenceError(f"Triton at {target.url} has no ready model to diagnose")
        missing = [m for m in models if m not in before]
        if missing:
            raise InferenceError(f"model(s) {missing} not served by Triton at {target.url}; it serves {sorted(before)}")
        fail_before = read_failures(target)
        client_before = Scrape.read(client_metrics) if client_metrics else None
        started = time.monotonic()
        if on_start is not None:
            on_start(models)
        await asyncio.sleep(window_s)
        client_after = Scrape.read(client_metrics) if client_metrics else None
        after = await read_statistics(triton, models)
        window = time.monotonic() - started
        fail_after = read_failures(target)
        deltas = [after[m] - before[m] for m in models]
        if target.stats_file is not None:
            save_profile(target.stats_file, deltas)
        out = []
        client_delta = client_after.minus(client_before) if client_after is not None and client_before is not None else None
        for delta in deltas:
            failures = failure_delta(fail_before, fail_after, delta.model)
            if client_delta is None:
                ctx = await model_context(triton, target, delta.model)
                out.append(diagnose_model("passive", delta, window, ctx, failures=failures))
                continue
            sides = client_delta.request_phases(delta.model)
            ctx = await model_context(triton, target, delta.model, client_delta.feature_side())
            if not sides:
                ctx = replace(ctx, notes=(*ctx.notes, f"the client metrics at {client_metrics} have no requests to {delta.model!r} in the window"))
                out.append(diagnose_model("passive", delta, window, ctx, failures=failures))
                continue
            for service, means, count in sides:
                client = ClientSide(service, count, means, triton_calls_per_request=delta.success.count / max(count, 1))
                named = client_named_phases(means)
                out.append(diagnose_model("client-metrics", delta, window, ctx, client=client, client_phases=named, failures=failures))
        return out


def to_json(diagnoses: Sequence[Diagnosis], **extra: Any) -> dict[str, Any]:
    """A JSON document of the diagnoses (`scorestack diagnose --json`)."""
    from dataclasses import asdict

    return {"schema_version": SCHEMA_VERSION, **extra, "models": [asdict(d) for d in diagnoses]}


def render_diagnoses(diagnoses: Sequence[Diagnosis]) -> str:
    """A plain-text report: per model, the phases with their share, the traffic, and the decision."""
    lines: list[str] = []
    for d in diagnoses:
        who = f" via {d.client.service} ({d.client.requests} client requests)" if d.client else ""
        lines.append(f"model {d.model} — {d.mode}, {d.window_s:.1f} s window, {d.requests} requests{who}")
        width = max(len(p) for p in (*d.phases_ms, "unattributed"))
        lines.append(f"  {'phase'.ljust(width)}  {'ms/request':>10}  {'share':>6}")
        for phase, ms in sorted(d.phases_ms.items(), key=lambda kv: -kv[1]):
            mark = "  <- dominant" if phase == d.dominant else ""
            lines.append(f"  {phase.ljust(width)}  {ms:>10.3f}  {ms / d.measured_ms if d.measured_ms else 0:>6.1%}{mark}")
        lines.append(f"  {'unattributed'.ljust(width)}  {d.unattributed_ms:>10.3f}  {d.unattributed_ms / d.measured_ms if d.measured_ms else 0:>6.1%}")
        basis = "client-measured mean latency" if d.client else "Triton's mean request time"
        lines.append(f"  {'total'.ljust(width)}  {d.measured_ms:>10.3f}  {1:>6.0%}  ({basis}; {d.attributed_share:.1%} attributed to named phases)")
        if d.client and d.client.p50_ms is not None:
            lines.append(f"  client latency p50 {d.client.p50_ms:.3f} ms, p99 {d.client.p99_ms:.3f} ms")
        batches = ", ".join(f"{b}: {n}" for b, n in d.batch_sizes.items()) or "none"
        lines.append(f"  executed batch sizes (size: executions): {batches}; {d.rows} rows in {d.executions} executions")
        rejected = "unknown (pass --metrics-url)" if d.rejected is None else str(d.rejected)
        lines.append(f"  response cache hits {d.cache_hits} ({d.cache_hit_rate:.0%}); failed {d.failed}, of them rejected by the queue policy {rejected}")
        for note in d.notes:
            lines.append(f"  note: {note}")
        dec = d.decision
        lines.append(f"  decision: {dec.phase} is {dec.share:.0%} of the time -> {dec.technique}")
        lines.append(f"    {dec.detail}")
        if dec.command:
            lines.append(f"    run: {dec.command}")
        lines.append("")
    return "\n".join(lines)
