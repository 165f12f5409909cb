"""Timing plans and the weighted latency that selection minimizes.

The timing itself runs in the server environment, inside the verification worker
(serve/runtime/worker.py), through the same runtime code Triton calls.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimingPlan:
    batch_sizes: tuple[int, ...]
    rounds: int = 3
    cell_budget_s: float = 0.05  # time spent per (candidate, batch size) in each round
    max_calls: int = 400
    min_calls: int = 3


def weighted_latency(latency_us: dict[int, float], weights: dict[int, float]) -> float:
    """Expected µs per call under the spec's batch-size mix."""
    return float(sum(w * latency_us[b] for b, w in weights.items()))
