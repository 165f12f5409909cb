"""The decision of a diagnosis: the dominant phase and the technique that addresses it, with numbers.

Each rule reads what the project knows about the model: the executed batch sizes (Triton's
batch_stats), its served configuration, the compile report's measured latency per format and batch
size, and the request path's feature-fetch metrics.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from scorestack.client.server_stats import ModelStats
    from scorestack.compile.report import CompileReport

# How much faster another format must have measured before a recompile is worth it: below this the
# compile's own timing noise on a shared machine could be the whole difference.
RECOMPILE_GAIN = 0.10
# Triton's compute-infer per execution above this multiple of the compile's measured model time means
# the time goes to the backend around the model, not to the model's format.
OVERHEAD_FACTOR = 3.0
# Requests in Triton on average (Little's law) below which they rarely overlap: nothing for a queue delay to join.
MIN_OVERLAP = 1.5


@dataclass(frozen=True)
class Decision:
    phase: str  # the dominant phase
    share: float  # its share of the measured latency
    technique: str  # what to change, in a few words
    detail: str  # why, with the numbers it was decided from
    command: str | None = None  # the command that applies it, where there is one


@dataclass(frozen=True)
class ServedConfig:
    """The parts of a served model's config.pbtxt the queue rules need."""

    max_batch_size: int
    max_queue_delay_us: int | None  # None: no dynamic batching
    preferred_batch_sizes: tuple[int, ...]
    instances: int
    response_cache: bool

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> "ServedConfig":
        cfg = config.get("config", config)
        db = cfg.get("dynamic_batching")
        groups = cfg.get("instance_group") or [{"count": 1}]
        return cls(
            max_batch_size=int(cfg.get("max_batch_size", 0) or 0),
            max_queue_delay_us=None if db is None else int(db.get("max_queue_delay_microseconds", 0) or 0),
            preferred_batch_sizes=tuple(int(b) for b in (db or {}).get("preferred_batch_size", []) or []),
            instances=sum(int(g.get("count", 1) or 1) for g in groups),
            response_cache=bool((cfg.get("response_cache") or {}).get("enable", False)),
        )


@dataclass(frozen=True)
class FeatureSide:
    """The request path's feature-fetch metrics over the window (features/metrics.py families)."""

    reads_by_backend: dict[str, tuple[int, float]]  # backend -> (store reads, mean ms)
    cache_hits: int
    cache_misses: int
    fetches_per_read: float | None  # coalescing: fetch calls served per store round trip


def _nearest(sizes: list[int], b: int) -> int:
    return min(sizes, key=lambda s: (abs(math.log(s) - math.log(b)), s))


def _weighted_us(curve: Mapping[int, float], batches: Mapping[int, int]) -> float:
    """Mean µs per execution of a format at the executed batch sizes (each mapped to the nearest measured size)."""
    sizes = sorted(curve)
    total = sum(batches.values())
    return sum(n * curve[_nearest(sizes, b)] for b, n in batches.items()) / total


def _curves(report: "CompileReport") -> dict[str, dict[int, float]]:
    """Measured µs per call by format and batch size: the dispatch curves (whole grid) where present."""
    if report.dispatch is not None and report.dispatch.curves_us:
        raw = report.dispatch.curves_us
    else:
        raw = {c.format: c.latency_us for c in report.candidates if c.verified and c.latency_us}
    return {f: {int(b): float(us) for b, us in curve.items()} for f, curve in raw.items() if curve}


def _served_curve(report: "CompileReport", curves: dict[str, dict[int, float]]) -> dict[int, float] | None:
    """What the served version costs per batch size: its format's curve, or per band for a dispatch."""
    if report.selected.format != "dispatch":
        return curves.get(report.selected.format) or {int(b): float(us) for b, us in report.selected.latency_us.items()} or None
    if report.dispatch is None:
        return None
    out: dict[int, float] = {}
    for band in report.dispatch.bands:
        curve = curves.get(band["format"], {})
        for b, us in curve.items():
            if int(band["min_rows"]) <= b <= int(band["max_rows"]):
                out[b] = us
    return out or None


def _batch_text(batches: Mapping[int, int]) -> str:
    total = max(sum(batches.values()), 1)
    top = sorted(batches.items(), key=lambda kv: -kv[1])[:4]
    return ", ".join(f"{b} rows {n / total:.0%}" for b, n in top) + (" ..." if len(batches) > 4 else "")


def recompile_command(report: "CompileReport", repository: Path, stats_file: Path) -> str:
    return f"scorestack compile {shlex.quote(report.spec)} --repository {shlex.quote(str(repository))} --batch-profile {shlex.quote(str(stats_file))}"


def decide_compute(
    share: float,
    stats: "ModelStats",
    report: "CompileReport | None",
    report_path: Path,
    repository: Path,
    stats_file: Path | None,
    window_s: float | None = None,
) -> Decision:
    """Compute dominates: is another measured format faster at the batch sizes this traffic executed?

    `window_s`: the window's length, to tell whether requests overlapped in Triton at all (a queue
    delay can only join requests that are there to join)."""
    batches = dict(stats.batches)
    if not batches:
        return Decision("compute_infer", share, "make the model cheaper", "no executions in the window (every request a cache hit?)")
    executed = _batch_text(batches)
    if report is None:
        return Decision(
            "compute_infer", share, "compile to a faster verified format",
            f"executed batch sizes: {executed}; no compile report at {report_path} to compare formats "
            "(pass --repository with the model repository the model was compiled into)",
        )  # fmt: skip
    curves = _curves(report)
    served = _served_curve(report, curves)
    if not curves or not served:
        return Decision("compute_infer", share, "compile to a faster verified format", f"executed batch sizes: {executed}; the compile report at {report_path} has no measured latencies")
    served_us = _weighted_us(served, batches)
    options = {f: _weighted_us(c, batches) for f, c in curves.items()}
    if len(curves) > 1:
        sizes = sorted({b for c in curves.values() for b in c})
        per_size = {b: min(c[_nearest(sorted(c), b)] for c in curves.values()) for b in sizes}
        options["dispatch (fastest format per batch size)"] = _weighted_us(per_size, batches)
    best, best_us = min(options.items(), key=lambda kv: kv[1])
    measured = f"at the executed batch sizes ({executed}) the compile measured the served {report.selected.format} at {served_us:.0f} µs per execution"
    seen_us = stats.execution_infer_us
    gain_us = served_us - best_us if best_us < served_us * (1 - RECOMPILE_GAIN) else 0.0
    overhead_us = seen_us - served_us if seen_us is not None and seen_us > OVERHEAD_FACTOR * served_us else 0.0
    if gain_us > 0 and gain_us >= overhead_us:
        command = recompile_command(report, repository, stats_file) if stats_file is not None else None
        return Decision(
            "compute_infer", share, f"recompile for the executed batch sizes ({best} is faster there)",
            f"{measured}, {best} at {best_us:.0f} µs ({served_us / best_us:.1f}x)"
            + (f"; Triton spent {seen_us:.0f} µs per execution" if seen_us is not None else ""),
            command,
        )  # fmt: skip
    if overhead_us > 0:
        # Triton spends far longer per execution than the model itself measured: the time goes to the
        # backend's per-execution work (the Python backend's IPC in the local view), which a faster
        # format cannot remove; fewer, fuller executions or a native backend can.
        per_exec = stats.success.count / max(sum(stats.batches.values()), 1)
        # Requests inside Triton on average over the window (Little's law): below ~1.5 they rarely
        # overlap, and a queue delay would add its wait to every request without joining any.
        in_triton = stats.success.ns / (window_s * 1e9) if window_s else None
        if in_triton is not None and in_triton < MIN_OVERLAP:
            join = (
                f"requests rarely overlap ({in_triton:.2f} in Triton on average), so a queue delay would only add its wait: "
                "serve on Triton's native onnxruntime backend (the production container)"
            )
        else:
            join = (
                "raise max_queue_delay_microseconds so more requests share one, or serve on Triton's native onnxruntime "
                "backend (the production container)"
            )
        return Decision(
            "compute_infer", share, "fewer, fuller executions or a native backend (the model is a small part of compute)",
            f"Triton spent {seen_us:.0f} µs per execution where {measured}: {overhead_us / seen_us:.0%} is the backend's "
            f"per-execution overhead; executions join {per_exec:.1f} requests on average: {join}"
            + (f"; recompiling ({best}, {best_us:.0f} µs) would save less" if gain_us > 0 else ""),
        )  # fmt: skip
    return Decision(
        "compute_infer", share, "make the model smaller (the served format is already the fastest measured)",
        f"{measured}; no other format was more than {RECOMPILE_GAIN:.0%} faster ({best} {best_us:.0f} µs): "
        "prune, distill or quantize (the spec's optimization passes), or give instances more threads",
    )  # fmt: skip


def decide_queue(share: float, stats: "ModelStats", config: ServedConfig | None, window_s: float, queue_ms: float) -> Decision:
    """Queueing dominates: is it the batcher's delay (lower it) or busy instances (add some)?"""
    avg_batch = stats.inference_count / max(stats.execution_count, 1)
    executed = _batch_text(stats.batches) if stats.batches else "none"
    busy_ns = stats.compute_input.ns + stats.compute_infer.ns + stats.compute_output.ns
    if config is None:
        return Decision("queue", share, "add instances or lower the queue delay", f"mean queue {queue_ms:.3f} ms; executed batch sizes: {executed}; the model's config was not readable")
    utilization = busy_ns / (window_s * 1e9 * config.instances) if window_s > 0 else 0.0
    target = max(config.preferred_batch_sizes or (config.max_batch_size or 1,))
    delay = config.max_queue_delay_us
    if delay and queue_ms * 1e3 <= delay * 1.5 and avg_batch < target / 2:
        new_delay = 0 if avg_batch < 1.5 else delay // 2
        return Decision(
            "queue", share, f"lower max_queue_delay_microseconds from {delay} to {new_delay}",
            f"requests wait {queue_ms * 1e3:.0f} µs on average, about the batcher's {delay} µs delay, and batches reach only "
            f"{avg_batch:.1f} rows on average (executed: {executed}; preferred {target}): the delay buys little batching; "
            f"instances busy {utilization:.0%}",
        )  # fmt: skip
    return Decision(
        "queue", share, f"add instances (instance_group count {config.instances} -> {config.instances + 1}) or replicas",
        f"requests wait {queue_ms * 1e3:.0f} µs on average (queue delay {delay or 0} µs) while {config.instances} instance(s) "
        f"are busy {utilization:.0%} of the window with batches of {avg_batch:.1f} rows (executed: {executed}); "
        "each instance needs a free core: past the cores, add replicas and scale on queue time",
    )  # fmt: skip


def decide_features(share: float, wait_ms: float, features: FeatureSide | None, in_flight: float) -> Decision:
    """The feature fetch dominates: the backend, the cache or coalescing, from the fetch layer's metrics.

    `in_flight`: requests in flight on average over the window (Little's law: rate x latency);
    coalescing can only join fetches that overlap."""
    if features is None or not features.reads_by_backend:
        return Decision("features", share, "cache, coalesce or read features directly", f"the request waited {wait_ms:.3f} ms for features; the service exports no fetch-layer metrics (share the fetcher's registry)")
    reads = "; ".join(f"{b}: {n} reads, {ms:.3f} ms mean" for b, (n, ms) in features.reads_by_backend.items())
    lookups = features.cache_hits + features.cache_misses
    hit_rate = features.cache_hits / lookups if lookups else None
    cache = f"cache hit rate {hit_rate:.0%}" if hit_rate is not None else "no cacheable views read"
    coalesced = f"{features.fetches_per_read:.1f} fetches per store read" if features.fetches_per_read else "coalescing unknown"
    detail = f"the request waited {wait_ms:.3f} ms for features; store reads {reads}; {cache}; {coalesced}"
    slow = [b for b in features.reads_by_backend if b in ("feast_async", "feast_sync")]
    if slow:
        return Decision("features", share, f"read with the direct Redis reader instead of {slow[0]} (FeatureFetcher backend='auto' or 'direct')", detail)
    if hit_rate is not None and hit_rate < 0.5:
        return Decision("features", share, "cache slow-moving views longer (their cache_ttl_s tag)", detail)
    detail += f"; {in_flight:.1f} requests in flight on average"
    if features.fetches_per_read is not None and features.fetches_per_read < 1.5 and in_flight >= 2:
        return Decision("features", share, "coalesce concurrent fetches (FeatureFetcher coalesce_window_s)", detail)
    slowest, (_, read_ms) = max(features.reads_by_backend.items(), key=lambda kv: kv[1][1])
    return Decision(
        "features", share, f"shorten the store round trip ({slowest} reads take {read_ms:.3f} ms): run Redis next to the service, on a less loaded host",
        detail + ("" if in_flight >= 2 else " (too few to coalesce)"),
    )  # fmt: skip


OTHER_ADVICE = {
    "compute_input": "copy less into the model: fewer or smaller input tensors, shared memory for large ones",
    "compute_output": "copy less out of the model: request only the outputs used, smaller output dtypes",
    "cache": "the response cache's lookups cost more than they save: disable response_cache for this model",
    "validate": "validate once at the edge and without per-field Python work",
    "assemble": "assemble the feature matrix with vectorized numpy, not per-row Python",
    "network": "batch candidates into fewer calls, reuse one gRPC channel, shared memory for large tensors, or run the client next to Triton",
}
