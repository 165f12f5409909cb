"""The dynamic-batching settings the compiler derives (compile/emit.derive_settings), checked on values."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from scorestack.compile import emit
from scorestack.compile.profile import BatchProfile
from scorestack.compile.spec import ModelSpec


def _spec(tmp_path: Path, budget_ms: float = 10.0, sizes=(1, 8, 64), queue_policy: bool = True) -> ModelSpec:
    return ModelSpec.model_validate({
        "name": "m",
        "source": {"path": str(tmp_path / "m.json"), "format": "xgboost-json"},
        "task": "binary",
        "inputs": {"features": [f"f{i}" for i in range(4)]},
        "serving": {"batch_sizes": list(sizes), "latency_budget_ms": budget_ms, "queue_policy": queue_policy},
        "holdout": str(tmp_path / "h.npz"),
    })


LATENCY = {1: 20.0, 8: 60.0, 64: 446.0}


def test_no_queue_delay_for_a_lone_request(tmp_path):
    """A lone request never waits for company: the delay is 0; the timeout is the budget's slack."""
    s = emit.derive_settings(_spec(tmp_path), LATENCY, threads=1, cpus=2)
    assert s.max_queue_delay_us == 0
    assert s.instance_count == 4 and s.max_batch_size == 64  # 2 run at once, doubled for the queue policy
    assert s.default_timeout_us == int(10_000 - emit.SERVER_OVERHEAD_US - 446.0)
    assert s.max_queue_size == 2 * (s.default_timeout_us // 446) * 64
    assert any(r.startswith("max_queue_delay_microseconds = 0:") for r in s.rules)


@pytest.mark.parametrize("requests, joined", [(1000, "1.00"), (5000, "5.00")])
def test_a_batch_profile_never_adds_a_delay(tmp_path, requests, joined):
    profile = BatchProfile(model="m", executions={1: 1000}, requests=requests, rows=requests)
    s = emit.derive_settings(_spec(tmp_path), LATENCY, threads=1, cpus=2, profile=profile)
    assert s.max_queue_delay_us == 0
    assert any(r.startswith(f"batch profile: {joined} requests per execution") for r in s.rules)


@pytest.mark.parametrize("queue_policy", [False, True])
def test_emitted_config_has_no_delay_and_the_queue_policy_the_spec_asks_for(tmp_path, queue_policy):
    """The settings as config.pbtxt text, parsed by Triton's own schema: REJECT after the budget's
    slack by default; `serving.queue_policy: false` leaves the policy out (the batcher pre-fetches;
    benchmarks/results/queue_policy.md says what each costs on Triton 2.51)."""
    from scorestack.compile.registry import Artifact

    spec = _spec(tmp_path, queue_policy=queue_policy)
    s = emit.derive_settings(spec, LATENCY, threads=1, cpus=2)
    assert s.queue_policy is queue_policy
    artifact = Artifact(format="onnx", path=tmp_path / "model.onnx", artifact_name="model.onnx", runtime="onnxruntime", backend="python")
    cfg = emit.write_config(tmp_path / "out", emit.build_config(spec, artifact, s, 1))
    text = (tmp_path / "out" / "config.pbtxt").read_text()
    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert parsed == cfg
    db = parsed.dynamic_batching
    assert parsed.HasField("dynamic_batching") and db.max_queue_delay_microseconds == 0
    assert db.HasField("default_queue_policy") is queue_policy
    if queue_policy:
        assert "timeout_action: REJECT" in text
        assert db.default_queue_policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
        assert db.default_queue_policy.default_timeout_microseconds == s.default_timeout_us
        assert db.default_queue_policy.max_queue_size == s.max_queue_size
        assert any(r.startswith(f"default_timeout_microseconds = max(queue delay + 100, slack) = {s.default_timeout_us}") for r in s.rules)
        assert any(r.startswith("queue policy on (serving.queue_policy: true, the default)") for r in s.rules)
    else:
        assert "queue_policy" not in text
        assert any(r.startswith(f"no queue policy (serving.queue_policy: false; it would be a timeout of {s.default_timeout_us} µs") for r in s.rules)
    # Two run at once on 2 CPUs; with the queue policy twice that, so an instance is waiting when the batcher looks.
    assert parsed.instance_group[0].count == (4 if queue_policy else 2)


@pytest.mark.parametrize("cpus, threads, queue_policy, gpu, expected", [
    (2, 1, True, False, 4), (2, 1, False, False, 2), (2, 2, True, False, 2), (16, 1, True, False, 8),
    (16, 1, False, False, 4), (2, 1, True, True, 1),
])
def test_instances_with_the_queue_policy_are_twice_those_that_run_at_once(tmp_path, cpus, threads, queue_policy, gpu, expected):
    """Triton 2.51's batcher with a queue policy waits for an idle instance and is not woken when one
    frees up (benchmarks/results/instances.md): the extra instances keep one waiting. The queue size
    counts only the instances that run at once (they drain it)."""
    s = emit.derive_settings(_spec(tmp_path, queue_policy=queue_policy), LATENCY, threads=threads, cpus=cpus, gpu=gpu)
    assert s.instance_count == expected
    running = 1 if gpu else min(emit.MAX_INSTANCES, cpus // threads)
    if queue_policy:
        assert s.max_queue_size == min(emit.MAX_QUEUE_SIZE, running * (s.default_timeout_us // 446) * 64)
    rule = next(r for r in s.rules if r.startswith("instances that run at once"))
    assert f"= {running}" in rule and "instance_group count = " in rule
    assert ("500 ms" in rule) is (expected != running)
