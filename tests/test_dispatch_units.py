"""Per-batch-size dispatch without a server: the band planner, the runtime's band table, and batch profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scorestack.compile import dispatch
from scorestack.compile.profile import load_profiles, profile_for
from scorestack.errors import SpecError
from scorestack.serve.runtime import scorestack_runtime as rt


def test_grid_holds_powers_of_two_the_spec_sizes_and_the_maximum():
    assert dispatch.grid(64) == (1, 2, 4, 8, 16, 32, 64)
    assert dispatch.grid(200, (1, 50, 200, 500)) == (1, 2, 4, 8, 16, 32, 50, 64, 128, 200)


def test_one_format_when_it_is_within_the_margin_everywhere():
    curves = {"onnx": {1: 10.0, 64: 400.0, 1024: 7000.0}, "native": {1: 200.0, 64: 420.0, 1024: 6800.0}}
    plan = dispatch.plan_bands(curves, {1: 0.7, 64: 0.3})
    assert [(b.format, b.min_rows, b.max_rows) for b in plan.bands] == [("onnx", 1, 1024)]
    assert "within 10%" in plan.reason


def test_bands_split_at_the_interpolated_crossover():
    # onnx: 10 + 7 µs/row; native: 200 + 3 µs/row -> equal at 47.5 rows.
    sizes = dispatch.grid(1024)
    curves = {"onnx": {b: 10 + 7.0 * b for b in sizes}, "native": {b: 200 + 3.0 * b for b in sizes}}
    plan = dispatch.plan_bands(curves, {1: 0.5, 1024: 0.5})
    assert [(b.format, b.min_rows, b.max_rows) for b in plan.bands] == [("onnx", 1, 47), ("native", 48, 1024)]
    assert plan.best_single == "onnx" or plan.best_single == "native"


def test_three_formats_three_bands_and_noise_inside_the_margin_does_not_flap():
    sizes = dispatch.grid(1024)
    curves = {
        "onnx": {b: 10 + 8.0 * b for b in sizes},
        "tl2cgen": {b: 40 + 4.0 * b for b in sizes},
        "native": {b: 400 + 3.0 * b for b in sizes},
    }
    # 5% noise that would swap neighbours near a crossover must not create extra bands.
    curves["tl2cgen"][8] *= 1.05
    plan = dispatch.plan_bands(curves, {1: 1.0})
    formats = [b.format for b in plan.bands]
    assert formats == ["onnx", "tl2cgen", "native"]
    starts = [b.min_rows for b in plan.bands]
    assert starts[0] == 1 and all(a < b for a, b in zip(starts, starts[1:]))
    assert plan.bands[-1].max_rows == 1024
    for left, right in zip(plan.bands, plan.bands[1:]):
        assert left.max_rows + 1 == right.min_rows


def _config(params: dict[str, str], max_batch: int = 64) -> dict:
    return {
        "max_batch_size": max_batch,
        "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": ["3"]}],
        "output": [{"name": "probability", "data_type": "TYPE_FP32", "dims": ["1"]}],
        "parameters": {k: {"string_value": v} for k, v in params.items()},
    }


@pytest.mark.parametrize(
    "table, fragment",
    [
        ("not json", r"config parameter scorestack_dispatch cannot be read \(not valid JSON\); recompile the model"),
        (json.dumps([{"min_rows": 2, "runtime": "xgboost", "artifact": "a.json"}]), "band 1: min_rows must be 1"),
        (json.dumps([{"min_rows": 1, "runtime": "xgboost", "artifact": "a.json"}, {"min_rows": 1, "runtime": "xgboost", "artifact": "a.json"}]), "does not ascend"),
        (json.dumps([{"min_rows": 1, "runtime": "nope", "artifact": "a.json"}]), "unknown scorestack_runtime 'nope'"),
    ],
)
def test_a_malformed_dispatch_table_is_refused_with_its_reason(tmp_path, table, fragment):
    with pytest.raises(rt.RuntimeLoadError, match=fragment):
        rt.ModelRuntime("m", str(tmp_path), _config({rt.PARAM_RUNTIME: rt.DISPATCH, rt.PARAM_DISPATCH: table}))


def test_the_runtime_runs_each_batch_on_its_band(tmp_path):
    """Two XGBoost boosters that differ only in a constant shift, as two bands: the output tells which ran."""
    import xgboost as xgb

    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)
    low = xgb.train({"objective": "reg:squarederror", "base_score": 0.0, "max_depth": 2}, xgb.DMatrix(X, y), 5)
    high = xgb.train({"objective": "reg:squarederror", "base_score": 100.0, "max_depth": 2}, xgb.DMatrix(X, y), 5)
    low.save_model(str(tmp_path / "low.json"))
    high.save_model(str(tmp_path / "high.json"))
    table = [{"min_rows": 1, "runtime": "xgboost", "artifact": "low.json"}, {"min_rows": 8, "runtime": "xgboost", "artifact": "high.json"}]
    model = rt.ModelRuntime("m", str(tmp_path), _config({rt.PARAM_RUNTIME: rt.DISPATCH, rt.PARAM_DISPATCH: json.dumps(table)}))
    assert [b.min_rows for b in model.bands] == [1, 8]
    for n, booster in ((1, low), (7, low), (8, high), (64, high)):
        (out,) = model.execute([[X[:n]]])[0]
        np.testing.assert_allclose(out.ravel(), booster.inplace_predict(X[:n]), rtol=0, atol=1e-6)
    # The dynamic batcher joins requests: 4 requests of 2 rows run as one batch of 8, on the second band.
    results = model.execute([[X[i : i + 2]] for i in range(0, 8, 2)])
    joined = np.concatenate([r[0].ravel() for r in results])
    np.testing.assert_allclose(joined, high.inplace_predict(X[:8]), rtol=0, atol=1e-6)


def _stats(name: str, executions: dict[int, int], requests: int, rows: int) -> dict:
    return {
        "name": name,
        "version": "1",
        "inference_count": str(rows),
        "inference_stats": {"success": {"count": str(requests), "ns": "1"}},
        "batch_stats": [{"batch_size": str(b), "compute_infer": {"count": str(n), "ns": "1"}} for b, n in executions.items()],
    }


def test_a_batch_profile_maps_executed_sizes_to_the_grid(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"model_stats": [_stats("fraud", {1: 60, 3: 20, 48: 10, 1000: 10}, 150, 12000), _stats("other", {}, 0, 0)]}))
    profile = profile_for(path, "fraud")
    assert profile.executions == {1: 60, 3: 20, 48: 10, 1000: 10}
    assert profile.requests_per_execution == pytest.approx(1.5)
    weights = profile.weights(dispatch.grid(1024))
    # 3 is nearer 4 than 2 on a log scale; 48 nearer 64 than 32; 1000 nearest 1024.
    assert weights == {1: 0.6, 4: 0.2, 64: 0.1, 1024: 0.1}
    with pytest.raises(SpecError, match="no executed batches for model 'other'"):
        profile_for(path, "other")
    assert set(load_profiles(path)) == {"fraud", "other"}


@pytest.mark.parametrize("text, fragment", [("{", "not JSON"), ("{}", "no `model_stats` list"), ('{"model_stats": [{}]}', "missing `name`")])
def test_a_bad_batch_profile_names_the_problem(tmp_path, text, fragment):
    path = tmp_path / "stats.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=fragment):
        load_profiles(path)


def test_threads_are_chosen_with_the_instances_they_leave():
    from scorestack.compile.measure import choose_threads

    # 2 threads halve batch-1 latency but scale large batches poorly: with 4 CPUs, 1 thread leaves 4
    # instances (4 x 64/400 rows/µs) against 2 instances at 2 threads (2 x 64/300): too little capacity.
    per_t = {1: {1: 40.0, 64: 400.0}, 2: {1: 20.0, 64: 300.0}}
    assert choose_threads(per_t, {1: 1.0}, cpus=4, max_instances=4) == 1
    # On one CPU both leave one instance: the lower latency wins.
    assert choose_threads(per_t, {1: 1.0}, cpus=1, max_instances=4) == 2
    # When 2 threads keep the capacity (large batches scale), they win on latency.
    scaling = {1: {1: 40.0, 64: 400.0}, 2: {1: 20.0, 64: 180.0}}
    assert choose_threads(scaling, {1: 0.5, 64: 0.5}, cpus=4, max_instances=4) == 2
