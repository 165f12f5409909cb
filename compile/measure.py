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


# A thread count is a candidate only if the machine's capacity with it (instances × rows per second)
# is within this share of the best: more threads per instance lower one request's latency but leave
# fewer instances, and a server that cannot carry the load has no latency to speak of.
MIN_CAPACITY_SHARE = 0.9


def choose_threads(per_threads: dict[int, dict[int, float]], weights: dict[int, float], cpus: int, max_instances: int) -> int:
    """Threads per instance, chosen together with the instance count it leaves (CPUs // threads):
    the lowest weighted latency among thread counts whose capacity is within MIN_CAPACITY_SHARE of the best.

    Capacity with t threads = min(max_instances, CPUs // t) instances × the best rows per µs any
    measured batch size reaches at t."""
    capacity = {t: min(max_instances, max(1, cpus // t)) * max(b / us for b, us in lat.items()) for t, lat in per_threads.items()}
    best = max(capacity.values())
    eligible = [t for t in per_threads if capacity[t] >= MIN_CAPACITY_SHARE * best]
    return min(eligible, key=lambda t: (weighted_latency(per_threads[t], weights), t))
