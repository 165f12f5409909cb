"""The TL2cgen library's batch entry point (compile/_tree_commons.py) against TL2cgen's own Predictor
and the source model: same numbers, every shape, missing values, both thread paths, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import treelite
import tl2cgen
import xgboost as xgb

from scorestack.compile._tree_commons import compile_tl2cgen
from scorestack.compile.registry import ConvertContext, Skip
from scorestack.serve.runtime.scorestack_runtime import TL2cgenRunner

CASES = {
    "binary": ({"objective": "binary:logistic", "max_depth": 5}, lambda X: (np.nan_to_num(X[:, 0]) + X[:, 1] > 0).astype(int)),
    "multiclass": ({"objective": "multi:softprob", "num_class": 3, "max_depth": 4}, lambda X: (np.nan_to_num(X[:, 0]) > 0).astype(int) + (X[:, 1] > 1)),
    "regression": ({"objective": "reg:squarederror", "max_depth": 6}, lambda X: np.nan_to_num(X[:, 0]) * 3 + X[:, 1]),
}


@pytest.mark.parametrize("task", sorted(CASES))
def test_batch_entry_point_equals_tl2cgen_predictor_and_the_source(task, tmp_path):
    rng = np.random.default_rng(7)
    X = rng.normal(size=(1500, 13)).astype(np.float32)
    X[::3, 0] = np.nan  # missing values take the tree's default branch, as in XGBoost
    X[::11, 5] = np.nan
    params, label = CASES[task]
    booster = xgb.train(params, xgb.DMatrix(X, label(X)), 30)
    art = compile_tl2cgen(treelite.frontend.from_xgboost(booster), tmp_path, ConvertContext(task=task, n_features=13, target="y", sample=X[:8]))
    assert art.path.name == "model-tl2cgen.so" and sorted(p.name for p in tmp_path.iterdir()) == ["model-tl2cgen.so"]

    reference = tl2cgen.Predictor(str(art.path), nthread=1).predict(tl2cgen.DMatrix(X))
    one = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    two = TL2cgenRunner(str(art.path), 2, {}, ["y"])  # 1500 rows: split over two threads
    assert one.pool is None and two.pool is not None  # the batch path, not the Predictor fallback
    for runner in (one, two):
        out = runner.run([("features", X)])[0]
        assert out.shape == reference.shape and out.dtype == reference.dtype
        np.testing.assert_array_equal(out, reference)
    for n in (1, 2, 255, 256, 257):  # around the threads' cut-off, and a lone row
        np.testing.assert_array_equal(two.run([("features", X[:n])])[0], reference[:n])
    source = booster.predict(xgb.DMatrix(X)).reshape(len(X), -1)
    np.testing.assert_allclose(reference.reshape(len(X), -1), source, atol=2e-6)


def test_small_batches_through_the_staging_buffers_equal_the_unstaged_path_under_concurrent_callers(tmp_path):
    """Up to 64 rows go through the runner's own buffers (_Staging): any dtype is cast on the way in, each
    call gets its own output array, and callers on several threads at once (the embedded runtime's case)
    each get their own rows' scores, whichever of them found the buffers taken."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(10)
    X = rng.normal(size=(600, 9)).astype(np.float32)
    X[::7, 2] = np.nan
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 6}, xgb.DMatrix(X, (np.nan_to_num(X[:, 2]) + X[:, 0] > 0).astype(int)), 40)
    art = compile_tl2cgen(treelite.frontend.from_xgboost(booster), tmp_path, ConvertContext(task="binary", n_features=9, target="y", sample=X[:4]))
    reference = tl2cgen.Predictor(str(art.path), nthread=1).predict(tl2cgen.DMatrix(X))
    runner = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    first = runner.run([("features", X[:1])])[0]
    second = runner.run([("features", X[1:2].astype(np.float64))])[0]  # float64 rows are cast into the float32 buffer
    assert runner.staging is not None and runner.staging.rows == 64
    np.testing.assert_array_equal(first, reference[:1])
    np.testing.assert_array_equal(second, reference[1:2])  # the first call's array is not overwritten by the second
    np.testing.assert_array_equal(first, reference[:1])
    for lo, n in ((0, 64), (64, 65), (200, 3)):  # 65 rows: past the buffers, the unstaged path
        np.testing.assert_array_equal(runner.run([("features", X[lo : lo + n])])[0], reference[lo : lo + n])

    def one(i):
        return runner.run([("features", X[i : i + 1 + i % 3])])[0]

    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            for i, out in enumerate(pool.map(one, range(500))):
                np.testing.assert_array_equal(out, reference[i : i + 1 + i % 3])


def test_a_wide_models_staging_holds_fewer_rows_not_megabytes():
    from scorestack.serve.runtime.scorestack_runtime import _Staging

    args = lambda n, xp, op: (n, xp, op)
    assert _Staging(30, np.float32, (1, 1), np.float32, args).rows == 64
    assert _Staging(20_000, np.float32, (1, 1), np.float32, args).rows == 13  # 1 MiB // 80,004 bytes a row
    wide = _Staging(1_000_000, np.float32, (1, 3), np.float32, args)
    assert wide.rows == 1 and wide.x.shape == (1, 1_000_000)


def test_wrong_column_count_is_a_clear_error(tmp_path):
    rng = np.random.default_rng(8)
    X = rng.normal(size=(200, 6)).astype(np.float32)
    booster = xgb.train({"objective": "binary:logistic"}, xgb.DMatrix(X, (X[:, 0] > 0).astype(int)), 5)
    art = compile_tl2cgen(treelite.frontend.from_xgboost(booster), tmp_path, ConvertContext(task="binary", n_features=6, target="y", sample=X[:4]))
    runner = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    with pytest.raises(ValueError, match="5 input columns"):
        runner.run([("features", X[:, :5])])
    good = runner.run([("features", X[:1])])[0]  # a first request of the wrong width does not keep its staging
    assert runner.staging.n_cols == 6
    with pytest.raises(ValueError, match="5 input columns"):  # a later bad request leaves the right staging alone
        runner.run([("features", X[:1, :5])])
    assert runner.staging.n_cols == 6
    np.testing.assert_array_equal(runner.run([("features", X[:1])])[0], good)
    fresh = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    with pytest.raises(ValueError, match="5 input columns"):  # a first lone request of the wrong width: its staging goes
        fresh.run([("features", X[:1, :5])])
    assert fresh.staging is None
    np.testing.assert_array_equal(fresh.run([("features", X[:1])])[0], good)
    np.testing.assert_array_equal(good, TL2cgenRunner(str(art.path), 1, {}, ["y"]).run([("features", X[:2])])[0][:1])


def test_a_build_over_its_budget_is_stopped_and_names_the_setting(tmp_path):
    """A model whose generated C takes longer to build than the spec's build_budget_s: every gcc is
    stopped (none outlives the call), the candidate is skipped with the estimate and the setting, and
    nothing half-built is left behind as the artifact."""
    import psutil

    rng = np.random.default_rng(9)
    X = rng.normal(size=(3000, 20)).astype(np.float32)
    # Random labels: trees grow deep (about 1.7 MB of C, a few seconds of gcc).
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 10}, xgb.DMatrix(X, rng.integers(0, 2, size=len(X))), 200)
    model = treelite.frontend.from_xgboost(booster)
    # Too large for the budget even at an optimistic gcc rate: not started.
    ctx = ConvertContext(task="binary", n_features=20, target="y", sample=X[:4], build_budget_s=0.2)
    with pytest.raises(Skip, match=r"TL2cgen: gcc would need more than .* MB of generated C on 2 core\(s\) .* over the spec's `build_budget_s: 0.2`; not started. Raise build_budget_s") as refused:
        compile_tl2cgen(model, tmp_path, ctx)
    fastest = float(str(refused.value).split("more than ")[1].split(" s")[0])
    # A budget the optimistic rate fits but gcc does not: started, then stopped by the estimate or the clock.
    ctx = ConvertContext(task="binary", n_features=20, target="y", sample=X[:4], build_budget_s=max(1.0, fastest * 1.5))
    with pytest.raises(Skip, match=r"TL2cgen: gcc would need .* MB of generated C on 2 core\(s\), over the spec's `build_budget_s: .*`; stopped after .* Raise build_budget_s"):
        compile_tl2cgen(model, tmp_path, ctx)
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() in ("gcc", "cc1")]
    assert not (tmp_path / "model-tl2cgen.so").exists()
