"""The benchmark harness's bookkeeping (benchmarks/harness.py): what its loops count, with sends whose outcome
the test decides (an answer after a set time, or a named failure). Its loops against real servers are
tested through the load generator (test_loadgen.py) and the soak (test_soak.py)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness


class Boom(RuntimeError):
    pass


def _send(fail_every: int = 0, wait_s: float = 0.0):
    async def send(i: int) -> int:
        if wait_s:
            await asyncio.sleep(wait_s)
        if fail_every and i % fail_every == 0:
            raise Boom(f"request {i}")
        return i

    return send


def test_closed_loop_by_count_counts_every_request_once():
    t = asyncio.run(harness.closed_loop(_send(fail_every=5), 4, n=100, keep=True))
    assert t.sent == t.sent_all == 100
    assert t.errors == {"Boom": 20} and t.ok == 80 and len(t.latencies_ms) == 80
    assert sorted(t.values) == [i for i in range(100) if i % 5]
    assert t.error_samples["Boom"].startswith("Boom: request ")
    s = t.summary()
    assert s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]


def test_closed_loop_warm_up_is_sent_but_not_counted():
    t = asyncio.run(harness.closed_loop(_send(wait_s=0.002), 2, duration_s=0.3, warmup_s=0.1))
    assert 0 < t.sent < t.sent_all
    assert t.ok == t.sent and t.errors_total == 0
    assert t.wall_s == pytest.approx(0.3, abs=0.05)


def test_open_loop_evenly_spaced_windows_partition_the_schedule():
    windows = asyncio.run(harness.open_loop(_send(fail_every=7, wait_s=0.001), 400.0, duration_s=0.5, window_s=0.25, poisson=False))
    assert len(windows) == 2
    whole = harness.Tally.merge(windows)
    # 400/s for 0.5 s, evenly spaced from the start: requests 0..199, each due in exactly one window.
    assert whole.scheduled == whole.sent == 200 and whole.unsent == 0
    assert whole.ok + whole.errors_total == whole.sent
    assert whole.errors == {"Boom": len(range(0, 200, 7))}
    assert [w.scheduled for w in windows] == [100, 100]
    assert len(whole.lags_ms) == 200 and len(whole.sent_latencies_ms) == whole.ok


def test_open_loop_shared_by_stride_sends_each_request_once():
    async def both():
        got: list[int] = []

        async def send(i: int) -> None:
            got.append(i)

        parts = await asyncio.gather(*(harness.open_loop(send, 300.0, duration_s=0.2, poisson=False, offset=j, stride=3) for j in range(3)))
        return got, [p[0] for p in parts]

    got, parts = asyncio.run(both())
    assert sorted(got) == list(range(60))
    assert sum(p.sent for p in parts) == 60


def test_the_in_flight_cap_makes_requests_late_not_lost():
    # 200/s with each answer taking 50 ms and one request in flight at a time: the client falls behind.
    (t,) = asyncio.run(harness.open_loop(_send(wait_s=0.05), 200.0, duration_s=0.2, poisson=False, max_inflight=1, late_after_ms=10))
    assert t.scheduled == 40
    assert t.sent + t.unsent == t.scheduled and t.ok == t.sent
    assert t.late >= t.sent - 1  # all but the first started late
    # Those still not started a window (here the whole 0.2 s) after the end are counted as unsent, not dropped silently.
    assert t.unsent > 0
    # Latency counts from the due time: the waiting is in it.
    assert max(t.latencies_ms) > 5 * min(t.sent_latencies_ms)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(harness.closed_loop(_send(), 0, n=1))
    with pytest.raises(ValueError, match="duration_s or n"):
        asyncio.run(harness.closed_loop(_send(), 1))
    with pytest.raises(ValueError, match="rate"):
        asyncio.run(harness.open_loop(_send(), 0.0, duration_s=1.0))


def test_the_meter_charges_this_process_and_the_machine():
    m = harness.Meter(os.getpid(), [os.getpid()])
    sum(i * i for i in range(3_000_000))  # CPU in this process
    lap = m.lap()
    assert lap["client_pct"] > 10 and lap["host_pct"] >= lap["client_pct"] - 5
    mem = harness.memory(os.getpid(), [os.getpid()])
    assert mem["client_mib"] > 10 and mem["tritonserver_mib"] == mem["client_mib"]
