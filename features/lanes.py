"""Coalescing lanes: one store reader behind a coalescing window, a time budget and a circuit breaker.

Fetches to the same reader arriving within the window share one store round trip; each waits at
most until its own deadline, and a failing store opens the breaker so later fetches get defaults
without touching it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from scorestack.features.backends import Backend, Entity, Row, Wanted
from scorestack.features.metrics import FetchMetrics
from scorestack.features.resilience import CircuitBreaker


@dataclass
class Outcome:
    rows: dict[str, dict[Entity, Row | None]] | None  # None: the store was not read
    reason: str | None
    store_s: float


_GRACE_S = 0.002


def _discard_result(tasks: set):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late failure of an abandoned read is expected, not news

    return done


class Lane:
    """One backend behind a coalescing window, a budget and a circuit breaker."""

    def __init__(self, backend: Backend, breaker: CircuitBreaker, window_s: float | None, metrics: FetchMetrics) -> None:
        self.backend = backend
        self.breaker = breaker
        self.window_s = window_s
        self.metrics = metrics
        self._pending: dict[str, dict[Entity, None]] | None = None
        self._pending_future: asyncio.Future | None = None
        self._pending_deadline = 0.0
        self._pending_requests = 0
        self._tasks: set[asyncio.Task] = set()
        self._set_breaker_gauge()

    def _set_breaker_gauge(self) -> None:
        self.metrics.child(self.metrics.breaker_state, self.backend.name).set(int(self.breaker.state))

    async def read(self, wanted: Wanted, deadline: float) -> Outcome:
        loop = asyncio.get_running_loop()
        if self.window_s is None:
            future = loop.create_future()
            self._spawn(self._run({v: dict.fromkeys(ids) for v, ids in wanted.items()}, deadline, 1, future))
        else:
            if self._pending is None:
                self._pending, self._pending_future = {}, loop.create_future()
                self._pending_deadline, self._pending_requests = deadline, 0
                if self.window_s > 0:
                    loop.call_later(self.window_s, self._flush)
                else:
                    loop.call_soon(self._flush)
            for view, ids in wanted.items():
                self._pending.setdefault(view, {}).update(dict.fromkeys(ids))  # duplicates read once
            # The earliest deadline: the shared read ends (and the breaker counts it) before any of
            # its callers' budgets; a later joiner loses at most the window.
            self._pending_deadline = min(self._pending_deadline, deadline)
            self._pending_requests += 1
            future = self._pending_future
        try:
            # The read resolves the future by `deadline`; the grace only covers a stalled event loop.
            # asyncio.timeout, not wait_for (which wraps the wait in a task of its own: ~25 µs a call).
            async with asyncio.timeout(max(deadline - time.perf_counter(), 0.0) + _GRACE_S):
                return await asyncio.shield(future)
        except TimeoutError:
            return Outcome(None, "timeout", max(deadline - time.perf_counter(), 0.0))

    def _flush(self) -> None:
        wanted, future = self._pending, self._pending_future
        deadline, requests = self._pending_deadline, self._pending_requests
        self._pending = self._pending_future = None
        if wanted is not None and future is not None:
            self._spawn(self._run(wanted, deadline, requests, future))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, pending: dict[str, dict[Entity, None]], deadline: float, requests: int, future: asyncio.Future) -> None:
        outcome = Outcome(None, "closed", 0.0)
        try:
            outcome = await self._read_guarded({v: list(ids) for v, ids in pending.items()}, deadline, requests)
        finally:
            if not future.done():
                future.set_result(outcome)

    async def _read_guarded(self, wanted: dict[str, list[Entity]], deadline: float, requests: int) -> Outcome:
        name = self.backend.name
        if not self.breaker.allow():
            self.metrics.child(self.metrics.store_reads, name, "rejected").inc()
            return Outcome(None, "breaker_open", 0.0)
        self._set_breaker_gauge()
        self.metrics.child(self.metrics.coalesced, name).observe(requests)
        start = time.perf_counter()
        reason: str | None = None
        # Not asyncio.wait_for: after the timeout it also waits for the cancelled read to unwind
        # (disconnecting, Feast's clean-up). asyncio.wait ends at the budget whatever the read does;
        # the cancelled read unwinds in the background.
        task = asyncio.get_running_loop().create_task(self.backend.read(wanted))
        done, _ = await asyncio.wait({task}, timeout=max(deadline - start, 1e-4))
        if not done:
            task.cancel()
            self._tasks.add(task)
            task.add_done_callback(_discard_result(self._tasks))
            reason, outcome = "timeout", "timeout"
        elif task.cancelled():
            reason, outcome = "closed", "error"
        elif task.exception() is not None:
            exc = task.exception()
            reason, outcome = f"error: {type(exc).__name__}: {exc}", "error"
        else:
            rows, outcome = task.result(), "ok"
        elapsed = time.perf_counter() - start
        self.metrics.child(self.metrics.store_read_seconds, name).observe(elapsed)
        self.metrics.child(self.metrics.store_reads, name, outcome).inc()
        if reason is not None:
            self.breaker.record_failure()
            self._set_breaker_gauge()
            return Outcome(None, reason, elapsed)
        self.breaker.record_success()
        self._set_breaker_gauge()
        return Outcome({v: dict(zip(ids, rows[v])) for v, ids in wanted.items()}, None, elapsed)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()
