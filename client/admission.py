"""Admission control in the client: a per-model limit on requests in flight; past it a call is refused at once.

Why in the client: Triton 2.51 has no in-flight limit (its queue policy sheds only what reached the
scheduler), and above its capacity a rejection costs its gRPC frontend about as much as serving the
request does, so goodput collapses (README, Benchmarks: overload from h2load). A call refused here costs
the server nothing. The maintainers' own answer is the same (triton-inference-server/server#4753:
anything beyond instance count and queue "would have to be on the client side").

Two policies, per model and per client (one channel per process):
- a fixed limit (`max_in_flight=N`): at most N of this client's calls to the model in flight;
- `AdaptiveLimit` (`max_in_flight="adaptive"`): additive increase, multiplicative decrease on the
  latency the client observes, the way TCP finds a link's capacity (and Netflix's concurrency-limits and
  Envoy's adaptive concurrency filter apply it to RPCs). It needs no knowledge of the server's capacity or
  of how many other clients share it: each backs off when the server is slow for everyone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveLimit:
    """AIMD on observed latency.

    - A response slower than the target, a rejection by Triton's queue policy or a deadline exceeded is
      congestion: the limit is multiplied by `backoff`, at most once per round trip: only a call sent
      after the last cut can cut again (the responses of one congested moment count once, as a TCP window
      halves once per loss event).
    - Any other response adds 1 / limit while the limit is in use (at least half of it was in flight when
      the call started), so a fully used limit grows by about 1 per round trip.
    - The limit stays within [min_limit, max_limit].

    `target_ms` None: half the model's queue timeout from its config (the compiler derives the timeout as
    the latency budget less the server overhead and the model's time at its largest batch), or, for a
    model without one, a quarter of the client's deadline. Half, because AIMD keeps the latency around
    its target and the p99 above it: measured (benchmarks/results/admission.md, open loop at 120% and
    150% of capacity), a 9.3 ms target gave a served p99 of 10.7-12.4 ms against a 10 ms budget, a
    4.65 ms target 6.4-7.4 ms. `initial` None: the model's instances x max_batch_size (at least 16): what the
    server can hold executing and joining without a queue."""

    initial: int | None = None
    min_limit: int = 1
    max_limit: int = 4096
    target_ms: float | None = None
    backoff: float = 0.8

    def __post_init__(self) -> None:
        if self.min_limit < 1:
            raise ValueError(f"AdaptiveLimit.min_limit must be >= 1, got {self.min_limit}")
        if self.max_limit < self.min_limit:
            raise ValueError(f"AdaptiveLimit.max_limit ({self.max_limit}) must be >= min_limit ({self.min_limit})")
        if self.initial is not None and not self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(f"AdaptiveLimit.initial ({self.initial}) must be within [min_limit {self.min_limit}, max_limit {self.max_limit}]")
        if self.target_ms is not None and not (self.target_ms > 0 and math.isfinite(self.target_ms)):
            raise ValueError(f"AdaptiveLimit.target_ms must be a positive number of milliseconds, got {self.target_ms}")
        if not 0 < self.backoff < 1:
            raise ValueError(f"AdaptiveLimit.backoff must be within (0, 1), got {self.backoff}")


def policy_of(max_in_flight: "int | str | AdaptiveLimit | None") -> "int | AdaptiveLimit | None":
    """The TritonClient argument checked: None (no limit), a positive int, "adaptive" or an AdaptiveLimit."""
    if max_in_flight is None or isinstance(max_in_flight, AdaptiveLimit):
        return max_in_flight
    if isinstance(max_in_flight, str):
        if max_in_flight == "adaptive":
            return AdaptiveLimit()
        raise ValueError(f"max_in_flight: {max_in_flight!r} is not a policy; use a positive int, \"adaptive\", an AdaptiveLimit or None (no limit)")
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be a positive int, \"adaptive\", an AdaptiveLimit or None (no limit), got {max_in_flight!r}")
    return max_in_flight


class Gate:
    """One model's admission state in one client. Single-threaded (the client's event loop)."""

    def __init__(self, policy: "int | AdaptiveLimit", *, initial: int, target_ms: float, clock=time.monotonic) -> None:
        self.adaptive = isinstance(policy, AdaptiveLimit)
        self.policy = policy
        if isinstance(policy, AdaptiveLimit):
            self.limit = float(min(policy.max_limit, max(policy.min_limit, policy.initial if policy.initial is not None else initial)))
        else:
            self.limit = float(policy)
        self.target_s = target_ms / 1e3
        self.clock = clock
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0
        self.congestion = 0  # congested responses seen
        self.decreases = 0  # times the limit was cut
        self._last_cut = -math.inf

    def try_acquire(self) -> bool:
        """Take a slot (True) or refuse (False) without waiting."""
        if self.in_flight >= int(self.limit):
            self.refused += 1
            return False
        self.in_flight += 1
        self.admitted += 1
        return True

    def release(self, latency_s: float, outcome: str, in_flight_at_start: int) -> None:
        """Give the slot back. `outcome`: "ok", "shed" (queue-policy rejection or deadline exceeded) or
        "other" (an error that says nothing about load: no sample)."""
        self.in_flight -= 1
        if not self.adaptive or outcome == "other":
            return
        p = self.policy
        assert isinstance(p, AdaptiveLimit)
        now = self.clock()
        if outcome == "shed" or latency_s > self.target_s:
            self.congestion += 1
            if now - latency_s >= self._last_cut:  # sent after the last cut
                self.limit = max(float(p.min_limit), math.floor(self.limit * p.backoff))
                self._last_cut = now
                self.decreases += 1
        elif 2 * in_flight_at_start >= self.limit:
            self.limit = min(float(p.max_limit), self.limit + 1.0 / self.limit)

    def snapshot(self) -> dict:
        return {"policy": "adaptive" if self.adaptive else "fixed", "limit": int(self.limit), "in_flight": self.in_flight,
                "admitted": self.admitted, "refused": self.refused, "congestion": self.congestion, "decreases": self.decreases,
                "target_ms": round(self.target_s * 1e3, 3)}


def gate_for(policy: "int | AdaptiveLimit", *, queue_timeout_us: int, instances: int, max_batch_size: int, deadline_s: float) -> Gate:
    """A model's gate with AdaptiveLimit's documented defaults filled from its config: the target is half
    the queue timeout (a quarter of the client's deadline without one), the initial limit instances x
    max_batch_size (at least 16)."""
    target_ms = queue_timeout_us / 2e3 if queue_timeout_us > 0 else deadline_s * 1e3 / 4
    if isinstance(policy, AdaptiveLimit) and policy.target_ms is not None:
        target_ms = policy.target_ms
    return Gate(policy, initial=max(16, instances * max(1, max_batch_size)), target_ms=target_ms)
