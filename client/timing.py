"""Per-phase timings of one request, in milliseconds."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    """Collects named phases (ms) of one request; `total` is wall time from construction."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + (time.perf_counter() - t) * 1e3

    def set(self, name: str, ms: float) -> None:
        self.phases[name] = ms

    def finish(self) -> dict[str, float]:
        self.phases["total"] = (time.perf_counter() - self._start) * 1e3
        return dict(self.phases)
