"""Batch profiles: the batch sizes a served model actually executed, from Triton's own statistics.

`scorestack compile --batch-profile FILE` takes the JSON Triton returns for model statistics
(`GET /v2/models/<name>/stats`, `GET /v2/models/stats`, or tritonclient's
`get_inference_statistics(as_json=True)`) and recompiles each model for the traffic it saw.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from scorestack.errors import SpecError


@dataclass(frozen=True)
class BatchProfile:
    """What one model executed: executions per batch size, and the requests and rows behind them."""

    model: str
    executions: dict[int, int]  # batch size -> executions (Triton's batch_stats compute_infer count)
    requests: int  # successful inference requests
    rows: int  # inference_count: rows inferred (a request of n rows counts n)

    @property
    def requests_per_execution(self) -> float:
        """How many requests the dynamic batcher joined per execution on average (1.0: none joined)."""
        return self.requests / max(1, sum(self.executions.values()))

    def weights(self, sizes: tuple[int, ...]) -> dict[int, float]:
        """Executed time share per measured batch size: each executed size maps to the nearest measured
        size on a log scale (so a 48-row batch counts as 32 or 64), weighted by its executions."""
        counts: dict[int, float] = {}
        for b, n in self.executions.items():
            nearest = min(sizes, key=lambda s: (abs(math.log(s) - math.log(b)), s))
            counts[nearest] = counts.get(nearest, 0.0) + n
        total = sum(counts.values())
        return {b: c / total for b, c in sorted(counts.items())}


def _int(value: object, where: str) -> int:
    try:
        return int(value)  # Triton's JSON writes uint64 counters as strings
    except (TypeError, ValueError):
        raise SpecError(f"{where}: expected a count, got {value!r}") from None


def load_profiles(path: str | Path) -> dict[str, BatchProfile]:
    """Every model's profile in a Triton statistics JSON file, by model name (versions summed)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise SpecError(f"--batch-profile {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise SpecError(f"--batch-profile {path}: not JSON ({exc}); save Triton's statistics, e.g. `curl localhost:8000/v2/models/stats > {path.name}`") from None
    stats = doc.get("model_stats") if isinstance(doc, dict) else None
    if not isinstance(stats, list):
        raise SpecError(f"--batch-profile {path}: no `model_stats` list; expected Triton's statistics JSON (GET /v2/models/<name>/stats)")
    merged: dict[str, tuple[dict[int, int], int, int]] = {}
    for i, entry in enumerate(stats):
        where = f"--batch-profile {path}: model_stats[{i}]"
        name = entry.get("name")
        if not name:
            raise SpecError(f"{where}: missing `name`")
        executions, requests, rows = merged.get(name, ({}, 0, 0))
        for b in entry.get("batch_stats") or []:
            size = _int(b.get("batch_size"), f"{where}.batch_stats.batch_size")
            count = _int((b.get("compute_infer") or {}).get("count", 0), f"{where}.batch_stats.compute_infer.count")
            if size > 0 and count > 0:
                executions[size] = executions.get(size, 0) + count
        success = (entry.get("inference_stats") or {}).get("success") or {}
        requests += _int(success.get("count", 0), f"{where}.inference_stats.success.count")
        rows += _int(entry.get("inference_count", 0), f"{where}.inference_count")
        merged[name] = (executions, requests, rows)
    return {name: BatchProfile(name, dict(sorted(e.items())), r, n) for name, (e, r, n) in merged.items()}


def profile_for(path: str | Path, model: str) -> BatchProfile:
    """The profile of `model` in the statistics file; a clear error when it executed nothing there."""
    profiles = load_profiles(path)
    profile = profiles.get(model)
    if profile is None or not profile.executions:
        have = ", ".join(f"{n} ({sum(p.executions.values())} executions)" for n, p in profiles.items()) or "none"
        raise SpecError(f"--batch-profile {path}: no executed batches for model {model!r} (models in the file: {have}); serve it under traffic first, then save its statistics")
    return profile
