"""Timing: every verified candidate in one process, interleaved rounds, per batch size and thread count."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from .runtimes import Runner


@dataclass(frozen=True)
class TimingPlan:
    batch_sizes: tuple[int, ...]
    rounds: int = 3
    cell_budget_s: float = 0.05  # time spent per (candidate, batch size) in each round
    max_calls: int = 400
    min_calls: int = 3


def batches(X: np.ndarray, sizes: tuple[int, ...]) -> dict[int, np.ndarray]:
    """One input per batch size, held-out rows repeated when there are fewer than the batch."""
    return {b: np.ascontiguousarray(np.resize(X, (b, X.shape[1])), dtype=np.float32) for b in sizes}


def measure(runners: dict[Hashable, Runner], X: np.ndarray, plan: TimingPlan, seed: int = 0) -> dict[Hashable, dict[int, float]]:
    """Median µs per call for each runner and batch size.

    Rounds interleave the runners in a shuffled order, so drift on a shared machine (another job,
    frequency scaling) spreads over every candidate instead of penalizing one.
    """
    inputs = batches(X, plan.batch_sizes)
    samples: dict[Hashable, dict[int, list[float]]] = {k: {b: [] for b in plan.batch_sizes} for k in runners}
    for run in runners.values():  # warm-up: first calls allocate arenas, load code pages
        for x in inputs.values():
            run(x)
    rng = random.Random(seed)
    keys = list(runners)
    clock = time.perf_counter_ns
    for _ in range(plan.rounds):
        rng.shuffle(keys)
        for key in keys:
            run = runners[key]
            for b in plan.batch_sizes:
                x = inputs[b]
                out = samples[key][b]
                deadline = time.perf_counter() + plan.cell_budget_s
                calls = 0
                while calls < plan.min_calls or (calls < plan.max_calls and time.perf_counter() < deadline):
                    t0 = clock()
                    run(x)
                    out.append((clock() - t0) / 1000.0)
                    calls += 1
    return {k: {b: float(np.median(v)) for b, v in per.items()} for k, per in samples.items()}


def weighted_latency(latency_us: dict[int, float], weights: dict[int, float]) -> float:
    """Expected µs per call under the spec's batch-size mix."""
    return float(sum(w * latency_us[b] for b, w in weights.items()))
