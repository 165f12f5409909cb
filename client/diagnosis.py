"""One model's diagnosis over a window: its time split into named phases, the dominant one, and what to do.

`diagnose_model` reads Triton's statistics of the window (client/server_stats.py) and, when the
client side is known (replay, a service's exported histograms), the client's own phases; the
decision comes from client/advice.py. A `Diagnosis` is shown as plain text (`render_diagnoses`) or
JSON (`to_json`, `scorestack diagnose --json`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from scorestack.client.advice import OTHER_ADVICE, Decision, FeatureSide, ServedConfig, decide_compute, decide_features, decide_queue
from scorestack.client.server_stats import SERVER_PHASES, ModelStats

if TYPE_CHECKING:
    from scorestack.compile.report import CompileReport

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


def client_named_phases(means: Mapping[str, float]) -> dict[str, float]:
    """The client's own phases on the critical path: every timed phase but the Triton call (`infer`,
    split with Triton's statistics), `total`, and the fetch's own duration when the request's wait
    for it (`features_wait`) is known: the fetch overlaps validation, the wait does not."""
    out = {p: ms for p, ms in means.items() if p not in ("infer", "total", "features", "features_wait")}
    if "features_wait" in means or "features" in means:
        out["features"] = means.get("features_wait", means.get("features", 0.0))
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
