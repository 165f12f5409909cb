"""Admission control in TritonClient (client/admission.py): a per-model in-flight limit that refuses calls
before they reach Triton, fixed or adaptive (AIMD on observed latency).

The Gate's arithmetic is checked with a stepped clock (pure logic, no server involved); enforcement is checked
against the real Triton with a model whose batcher holds every request 200 ms (a 200 ms queue delay waiting for
a preferred batch of 64 that never fills), so calls are really in flight while the others arrive.
"""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from skl2onnx import to_onnx
from sklearn.ensemble import GradientBoostingClassifier

from scorestack.client.admission import AdaptiveLimit, Gate, policy_of
from scorestack.client.triton import TritonClient
from scorestack.errors import OverloadedError, RequestValidationError
from conftest import LocalTriton, settled_statistics
from scorestack.serve.environment import ensure_server_environment

N_FEATURES = 8
HOLD_US = 200_000
CONFIG = f"""
name: "held"
backend: "onnxruntime"
max_batch_size: 64
input [{{ name: "X" data_type: TYPE_FP32 dims: [{N_FEATURES}] }}]
output [
  {{ name: "probabilities" data_type: TYPE_FP32 dims: [2] }},
  {{ name: "label" data_type: TYPE_INT64 dims: [1] }}
]
dynamic_batching {{
  max_queue_delay_microseconds: {HOLD_US}
  preferred_batch_size: [64]
  default_queue_policy {{ timeout_action: REJECT default_timeout_microseconds: 5000000 allow_timeout_override: true max_queue_size: 256 }}
}}
instance_group [{{ count: 1 kind: KIND_CPU }}]
"""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- the arithmetic -----------------------------------------------------------------------------------
def test_a_fixed_limit_refuses_past_it_and_never_moves():
    gate = Gate(3, initial=99, target_ms=1.0)
    assert [gate.try_acquire() for _ in range(5)] == [True, True, True, False, False]
    gate.release(10.0, "shed", 3)  # congestion says nothing to a fixed limit
    assert gate.try_acquire() and not gate.try_acquire()
    assert gate.snapshot() == {"policy": "fixed", "limit": 3, "in_flight": 3, "admitted": 4, "refused": 3, "congestion": 0,
                               "decreases": 0, "target_ms": 1.0}


def test_adaptive_cuts_once_per_round_trip_and_grows_by_about_one_per_full_window():
    clock = Clock()
    gate = Gate(AdaptiveLimit(initial=20, min_limit=2, max_limit=24, backoff=0.5), initial=99, target_ms=10.0, clock=clock)
    assert gate.limit == 20
    for _ in range(20):
        assert gate.try_acquire()
    # Twenty responses of one congested moment (each 30 ms > the 10 ms target) cut the limit once.
    clock.t = 1.0
    for _ in range(20):
        gate.release(0.030, "ok", 20)
    assert gate.limit == 10 and gate.decreases == 1 and gate.congestion == 20
    # One round trip later, another slow response cuts again; a rejection counts like a slow response.
    clock.t = 1.031
    gate.try_acquire()
    gate.release(0.001, "shed", 1)
    assert gate.limit == 5 and gate.decreases == 2
    clock.t = 1.032
    gate.try_acquire()
    gate.release(0.5, "shed", 1)  # within the same round trip (the latest was 0.5 s): no cut
    assert gate.limit == 5
    # Fast responses with the limit in use (at least half of it in flight) add 1/limit each: +1 per window.
    clock.t = 5.0
    for _ in range(5):
        gate.try_acquire()
        gate.release(0.002, "ok", 5)
    grown = gate.limit
    assert 5.9 < grown < 6.0  # 5 + 1/5 + 1/5.2 + ...
    # ... but not while the limit is mostly unused: a quiet client keeps what it has.
    for _ in range(50):
        gate.try_acquire()
        gate.release(0.002, "ok", 2)
    assert gate.limit == grown
    # Errors that say nothing about load leave it alone; the bounds hold.
    gate.try_acquire()
    gate.release(9.0, "other", 6)
    assert gate.limit == grown
    for step in range(20):
        clock.t = 10.0 + step
        gate.try_acquire()
        gate.release(1.0, "shed", 1)
    assert gate.limit == 2  # min_limit
    for _ in range(2000):
        gate.try_acquire()
        gate.release(0.001, "ok", 24)
    assert gate.limit == 24  # max_limit
    assert gate.in_flight == 0


@pytest.mark.parametrize("bad, words", [
    (0, "max_in_flight must be a positive int"), (-3, "max_in_flight must be a positive int"), (True, "max_in_flight must be a positive int"),
    (2.5, "max_in_flight must be a positive int"), ("fast", "max_in_flight: 'fast' is not a policy"),
])
def test_a_bad_policy_is_refused_naming_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        policy_of(bad)
    with pytest.raises(ValueError, match=words):
        TritonClient("127.0.0.1:1", max_in_flight=bad)


@pytest.mark.parametrize("kwargs, words", [
    ({"min_limit": 0}, "min_limit must be >= 1"), ({"min_limit": 5, "max_limit": 4}, "max_limit \\(4\\) must be >= min_limit"),
    ({"initial": 9000}, "initial \\(9000\\) must be within"), ({"target_ms": 0}, "target_ms must be a positive"),
    ({"backoff": 1.0}, "backoff must be within"),
])
def test_a_bad_adaptive_limit_is_refused_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=f"AdaptiveLimit.{words}"):
        AdaptiveLimit(**kwargs)


# -- against the real Triton --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def held(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    rng = np.random.default_rng(3)
    X = rng.normal(size=(2000, N_FEATURES)).astype(np.float32)
    model = GradientBoostingClassifier(n_estimators=10, max_depth=3, random_state=0).fit(X, (X[:, 0] > 0).astype(int))
    (root / "repo" / "held" / "1").mkdir(parents=True)
    (root / "repo" / "held" / "1" / "model.onnx").write_bytes(to_onnx(model, X[:1], options={id(model): {"zipmap": False}}).SerializeToString())
    (root / "repo" / "held" / "config.pbtxt").write_text(CONFIG)
    with LocalTriton(root / "repo", server_env=ensure_server_environment()) as server:
        yield server, root / "repo"


def _stats(server, at_least: int = 0) -> tuple[int, int]:
    """Triton's success and fail counts for `held`, once they add up to `at_least` (a backend reports a
    request's statistics after sending its response: read right after the reply, a count can lag)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        done = lambda st: sum(_counts(st)) >= at_least
        return _counts(settled_statistics(client, "held", done))
    finally:
        client.close()


def _counts(stats) -> tuple[int, int]:
    s = stats.model_stats[0].inference_stats
    return s.success.count, s.fail.count


def test_a_fixed_limit_refuses_the_excess_before_it_reaches_triton(held):
    server, repo = held
    rows = np.random.default_rng(7).normal(size=(21, N_FEATURES)).astype(np.float32)
    expected = ort.InferenceSession(str(repo / "held" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]).run(["probabilities"], {"X": rows})[0]
    success0, fail0 = _stats(server)

    async def run():
        client = TritonClient(server.grpc_url, deadline_s=10.0, max_in_flight=4)
        try:
            await client.model_info("held")  # metadata first: the burst's calls then reach admission in order

            async def one(i):
                try:
                    return (await client.infer("held", {"X": rows[i:i + 1]})).outputs["probabilities"]
                except OverloadedError as exc:
                    return exc

            burst = await asyncio.gather(*(one(i) for i in range(20)))
            with pytest.raises(RequestValidationError):  # bad input is refused by validation, and takes no slot
                await client.infer("held", {"X": rows[:1, :3]})
            after = await one(20)  # every slot was given back
            return burst, after, client.admission("held")
        finally:
            await client.close()

    burst, after, state = asyncio.run(run())
    served = [i for i, r in enumerate(burst) if not isinstance(r, Exception)]
    refused = [r for r in burst if isinstance(r, OverloadedError)]
    assert served == [0, 1, 2, 3] and len(refused) == 16
    for i in served:
        np.testing.assert_allclose(burst[i], expected[i:i + 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after, expected[20:21], rtol=1e-5, atol=1e-6)
    assert all(r.local for r in refused)
    msg = str(refused[0])
    assert "model 'held'" in msg and "4 of its calls" in msg and "limit 4, max_in_flight" in msg and "raise max_in_flight" in msg
    # Triton saw exactly the admitted calls: 4 + the one after, none of the refused.
    success, fail = _stats(server, at_least=success0 + fail0 + 5)
    assert (success - success0, fail - fail0) == (5, 0)
    assert state == {"policy": "fixed", "limit": 4, "in_flight": 0, "admitted": 5, "refused": 16, "congestion": 0, "decreases": 0,
                     "target_ms": 2500.0}


def test_the_adaptive_limit_backs_off_while_the_server_is_slower_than_the_target(held):
    """The batcher holds calls up to 200 ms; with a 50 ms target each batch is congestion, so the limit
    falls from 8 batch by batch (6, 4, 3, 2, 1), and the callers' extra calls are refused locally."""
    server, _ = held
    rows = np.random.default_rng(8).normal(size=(64, N_FEATURES)).astype(np.float32)
    success0, fail0 = _stats(server)

    async def run():
        client = TritonClient(server.grpc_url, deadline_s=10.0, max_in_flight=AdaptiveLimit(initial=8, target_ms=50.0))
        served = refused = 0
        limits = []
        try:
            await client.model_info("held")
            async def caller(k):
                nonlocal served, refused
                for i in range(4):
                    try:
                        await client.infer("held", {"X": rows[(k * 4 + i) % 64:(k * 4 + i) % 64 + 1]})
                        served += 1
                        limits.append(client.admission("held")["limit"])
                    except OverloadedError as exc:
                        assert exc.local
                        refused += 1
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(caller(k) for k in range(8)))
            return served, refused, limits, client.admission("held")
        finally:
            await client.close()

    served, refused, limits, state = asyncio.run(run())
    # A call that joins a batch just before it fires can come back under the target (and add 1/limit), so
    # the checks are on the cuts: each batch's first response sent after the last cut cut the limit.
    assert limits[0] == 6 and min(limits) <= 2 and state["decreases"] >= 3 and state["limit"] <= 8 * 0.8 ** 3
    assert state["congestion"] >= 8 and refused == state["refused"] > 0 and state["in_flight"] == 0
    assert served + refused == 32
    success, fail = _stats(server, at_least=success0 + fail0 + served)
    assert (success - success0, fail - fail0) == (served, 0)  # Triton saw the admitted calls, all answered
