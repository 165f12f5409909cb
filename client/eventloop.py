"""An asyncio event loop that polls briefly before it sleeps: lower latency for a lone request on a VM.

On a virtual machine a core with nothing to run halts, and waking it for the next event (the Redis
reply, Triton's answer) goes through the hypervisor: tens of microseconds each time, several times a
request. A quiet service pays this on every request; a busy one never does, because its cores do not
halt. `spinning_loop(spin_us)` returns a selector event loop whose wait for I/O first polls without
blocking for up to `spin_us` microseconds and only then sleeps. It costs CPU only while the loop would
otherwise sit idle with a reply due soon; a loop with work to do never spins.

    from scorestack.client.eventloop import run
    run(main(), spin_us=50)                      # asyncio.run with the spinning loop

    with asyncio.Runner(loop_factory=lambda: spinning_loop(50)) as runner:
        runner.run(main())

`benchmarks/bench_e2e.py` measures it (the scorestack and hand-written services, with and without).
It replaces uvloop, not combines with it (uvloop's loop is libuv's own).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
DEFAULT_SPIN_US = 50.0


class SpinningSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]  # epoll on Linux
    """The platform's selector, polled without blocking for up to `spin_s` before a blocking wait."""

    def __init__(self, spin_s: float) -> None:
        super().__init__()
        self.spin_s = spin_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return super().select(0)
        spin = self.spin_s if timeout is None else min(self.spin_s, timeout)
        end = time.perf_counter() + spin
        while True:
            ready = super().select(0)
            if ready:
                return ready
            if time.perf_counter() >= end:
                break
        return super().select(None if timeout is None else max(timeout - spin, 0.0))


def spinning_loop(spin_us: float = DEFAULT_SPIN_US) -> asyncio.AbstractEventLoop:
    """A new selector event loop that polls for up to `spin_us` µs before it sleeps (0: a plain loop)."""
    if not 0 <= spin_us <= 10_000:
        raise ValueError(f"spin_us: must be within [0, 10000] microseconds (50 is a good start), got {spin_us}")
    return asyncio.SelectorEventLoop(SpinningSelector(spin_us / 1e6) if spin_us else None)


def run(main: Coroutine[Any, Any, T], *, spin_us: float = DEFAULT_SPIN_US) -> T:
    """`asyncio.run(main)` on a spinning loop."""
    with asyncio.Runner(loop_factory=lambda: spinning_loop(spin_us)) as runner:
        return runner.run(main)
