"""Triton's own accounting of a model: cumulative statistics, their change over a window, /metrics scrapes.

Triton keeps, per model and version, cumulative counts and nanoseconds of successful and failed
requests, time queued, and time in compute input / infer / output, with the same per executed
batch size (`batch_stats`). The difference of two readings is what the model did in between.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from scorestack.errors import InferenceError

if TYPE_CHECKING:
    from scorestack.client.triton import TritonClient

SERVER_PHASES = ("queue", "compute_input", "compute_infer", "compute_output", "cache")
_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
DEFAULT_TIMEOUT_S = 5.0
# Triton counts a request when it releases it, which can come just after the client has its
# response: a reading taken right after the last answer may miss the last few.
SETTLE_TIMEOUT_S = 2.0
_T = TypeVar("_T")


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0

    def __sub__(self, other: "Duration") -> "Duration":
        return Duration(self.count - other.count, self.ns - other.ns)

    def __add__(self, other: "Duration") -> "Duration":
        return Duration(self.count + other.count, self.ns + other.ns)


@dataclass(frozen=True)
class ModelStats:
    """One model's statistics (every version summed): cumulative from Triton, or a window's change."""

    model: str
    success: Duration = Duration()
    fail: Duration = Duration()
    queue: Duration = Duration()
    compute_input: Duration = Duration()
    compute_infer: Duration = Duration()
    compute_output: Duration = Duration()
    cache_hit: Duration = Duration()
    cache_miss: Duration = Duration()
    inference_count: int = 0  # rows inferred (cache hits excluded)
    execution_count: int = 0  # model executions (one per formed batch)
    batches: Mapping[int, int] = field(default_factory=dict)  # executed batch size -> executions
    batch_infer_ns: Mapping[int, int] = field(default_factory=dict)  # executed batch size -> compute infer ns of those executions

    def __sub__(self, before: "ModelStats") -> "ModelStats":
        if before.model != self.model:
            raise ValueError(f"statistics of {self.model!r} minus those of {before.model!r}")
        delta = {name: getattr(self, name) - getattr(before, name) for name in _DURATIONS}
        batches = {b: n - before.batches.get(b, 0) for b, n in self.batches.items()}
        batch_ns = {b: ns - before.batch_infer_ns.get(b, 0) for b, ns in self.batch_infer_ns.items()}
        if min((d.count for d in delta.values()), default=0) < 0 or self.inference_count < before.inference_count:
            # Counters only grow: a drop means the model was unloaded and loaded again in between.
            raise InferenceError(f"model {self.model!r}: Triton's counters went down during the window (model reloaded?); diagnose again")
        return replace(
            self,
            **delta,
            inference_count=self.inference_count - before.inference_count,
            execution_count=self.execution_count - before.execution_count,
            batches={b: n for b, n in sorted(batches.items()) if n > 0},
            batch_infer_ns={b: batch_ns[b] for b, n in sorted(batches.items()) if n > 0},
        )

    @property
    def execution_infer_us(self) -> float | None:
        """Mean compute-infer time of one execution (one formed batch), µs; None without executions."""
        n = sum(self.batches.values())
        return sum(self.batch_infer_ns.values()) / n / 1e3 if n else None

    def phase_ns(self, phase: str) -> int:
        """Server time of one named phase; `cache` is the response cache's lookups and insertions."""
        if phase == "cache":
            return self.cache_hit.ns + self.cache_miss.ns
        return getattr(self, phase).ns

    def to_triton_json(self) -> dict[str, Any]:
        """This as one entry of Triton's statistics JSON (what `scorestack compile --batch-profile` reads)."""
        return {
            "name": self.model,
            "version": "",
            "inference_count": str(self.inference_count),
            "execution_count": str(self.execution_count),
            "inference_stats": {n: {"count": str(d.count), "ns": str(d.ns)} for n in _DURATIONS for d in [getattr(self, n)]},
            "batch_stats": [
                {"batch_size": str(b), "compute_infer": {"count": str(n), "ns": str(self.batch_infer_ns.get(b, 0))}} for b, n in self.batches.items()
            ],
        }


def _int(value: Any) -> int:
    return int(value or 0)  # Triton's JSON writes uint64 as strings and leaves zeros out


def parse_statistics(doc: Mapping[str, Any]) -> dict[str, ModelStats]:
    """Triton's statistics JSON (`model_stats` list) -> ModelStats per model name, versions summed."""
    out: dict[str, ModelStats] = {}
    for entry in doc.get("model_stats") or []:
        name = entry["name"]
        inf = entry.get("inference_stats") or {}
        batches: dict[int, int] = {}
        batch_ns: dict[int, int] = {}
        for b in entry.get("batch_stats") or []:
            size, infer = _int(b.get("batch_size")), b.get("compute_infer") or {}
            batches[size] = batches.get(size, 0) + _int(infer.get("count"))
            batch_ns[size] = batch_ns.get(size, 0) + _int(infer.get("ns"))
        stats = ModelStats(
            name,
            **{n: Duration(_int((inf.get(n) or {}).get("count")), _int((inf.get(n) or {}).get("ns"))) for n in _DURATIONS},
            inference_count=_int(entry.get("inference_count")),
            execution_count=_int(entry.get("execution_count")),
            batches=batches,
            batch_infer_ns=batch_ns,
        )
        prev = out.get(name)
        if prev is not None:  # another version of the same model
            merged = {b: prev.batches.get(b, 0) + stats.batches.get(b, 0) for b in {*prev.batches, *stats.batches}}
            merged_ns = {b: prev.batch_infer_ns.get(b, 0) + stats.batch_infer_ns.get(b, 0) for b in merged}
            stats = replace(
                stats,
                **{n: getattr(prev, n) + getattr(stats, n) for n in _DURATIONS},
                inference_count=prev.inference_count + stats.inference_count,
                execution_count=prev.execution_count + stats.execution_count,
                batches=dict(sorted(merged.items())),
                batch_infer_ns=dict(sorted(merged_ns.items())),
            )
        out[name] = stats
    return out


async def read_statistics(triton: "TritonClient", models: Sequence[str] | None = None) -> dict[str, ModelStats]:
    """Cumulative statistics of `models` (default: every model Triton reports), with the admin key
    when the server restricts its statistics API (`triton.admin_key`)."""
    from tritonclient.utils import InferenceServerException

    from scorestack.serve.control import admin_refusal

    what = "every model" if not models else ", ".join(repr(m) for m in models)
    out: dict[str, ModelStats] = {}
    for name in models or [""]:
        try:
            doc = await triton.grpc.get_inference_statistics(name, headers=triton.admin_headers, as_json=True, client_timeout=DEFAULT_TIMEOUT_S)
        except InferenceServerException as exc:
            message = exc.message() or str(exc)
            if "restricted" in message.lower():
                raise admin_refusal(triton.url, triton.admin_key, f"the statistics of {what}", message) from exc
            target = f"model {name!r}" if name else "models"
            if name and ("not available" in message or "not found" in message.lower()):
                raise InferenceError(f"model {name!r}: not served by Triton at {triton.url} (Triton said: {message})") from exc
            raise InferenceError(f"{target}: statistics unavailable from Triton at {triton.url}: {message}") from exc
        out.update(parse_statistics(doc))
    return out


async def settled(read: Callable[[], Awaitable[_T]], counted: Callable[[_T], bool], timeout_s: float = SETTLE_TIMEOUT_S) -> _T:
    """Re-read statistics (`read`) until `counted(reading)` says every request sent is in it, or
    `timeout_s` passes: a bounded poll of the counter, never a guess at how long Triton takes.
    Returns the last reading either way; the caller's own check of its counts then decides."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    reading = await read()
    while not counted(reading) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
        reading = await read()
    return reading


def fetch_text(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """GET a Prometheus text endpoint; InferenceError naming the URL when it does not answer."""
    if not url.startswith(("http://", "https://")):
        raise InferenceError(f"metrics URL {url!r}: give the full address, e.g. http://127.0.0.1:8002/metrics")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        raise InferenceError(f"metrics at {url} did not answer within {timeout_s:g} s: {getattr(exc, 'reason', exc)}") from exc


def failures_by_reason(metrics_text: str, url: str = "the metrics endpoint") -> dict[str, dict[str, int]]:
    """Triton's `nv_inference_request_failure` counters: model -> reason (REJECTED, BACKEND, ...) -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    try:
        for family in text_string_to_metric_families(metrics_text):
            if family.name != "nv_inference_request_failure":
                continue
            for sample in family.samples:
                model, reason = sample.labels.get("model", ""), sample.labels.get("reason", "OTHER")
                by_reason = out.setdefault(model, {})
                by_reason[reason] = by_reason.get(reason, 0) + int(sample.value)
    except ValueError as exc:
        raise InferenceError(f"metrics at {url}: not Prometheus text ({exc}); give Triton's metrics endpoint, e.g. http://127.0.0.1:8002/metrics") from exc
    return out
