"""view_matrix's one-entity path (a fraud request's user) gives what the general path gives for the
same entity, in every state a row can be in, and counts the same metrics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from scorestack.features.assemble import NOT_READ, view_matrix
from scorestack.features.backends import Row, ViewSpec
from scorestack.features.metrics import FetchMetrics

NOW = time.time()
SPEC = ViewSpec(
    name="v",
    join_keys=("user_id",),
    key_types=("Int64",),
    features=("a", "b", "c"),
    types=("Float32", "Int64", "Float64"),
    defaults=np.array([0.5, 7.0, -1.0], dtype=np.float32),
    ttl_s=60.0,
    cache_ttl_s=0.0,
    raw_features=("m",),
)
ROWS = {
    "fresh, all found": Row(np.array([1.0, 2.0, 3.0]), np.array([True, True, True]), NOW - 1, ({"k": 1},)),
    "fresh, one missing": Row(np.array([1.0, 0.0, 3.0]), np.array([True, False, True]), NOW - 1, (None,)),
    "stale": Row(np.array([1.0, 2.0, 3.0]), np.array([True, True, False]), NOW - 600, ({"k": 2},)),
    "no timestamp": Row(np.array([4.0, 5.0, 6.0]), np.array([True, True, True]), float("nan"), ("x",)),
    "not in the store": None,
    "not read in time": NOT_READ,
}


def _counts(metrics: FetchMetrics) -> dict[str, float]:
    return {
        reason: metrics.defaults.labels("v", reason)._value.get() for reason in ("missing", "degraded")
    } | {"stale": metrics.stale.labels("v")._value.get()}


@pytest.mark.parametrize("case", sorted(ROWS))
def test_one_entity_equals_the_general_path(case):
    row = ROWS[case]
    one_metrics, many_metrics = FetchMetrics(views=["v"]), FetchMetrics(views=["v"])
    rows = {} if row is NOT_READ else {1: row}
    one = view_matrix(SPEC, [1], rows, NOW, one_metrics)
    # The general path: the same entity beside one not read (its counts are subtracted below).
    many = view_matrix(SPEC, [1, 2], rows, NOW, many_metrics)
    for got, general in zip(one[:3], many[:3]):
        assert got.dtype == general.dtype and got.shape == (1, *general.shape[1:])
        np.testing.assert_array_equal(got, general[:1])
    assert one[3] == {"m": [many[3]["m"][0]]}
    general_counts = _counts(many_metrics)
    general_counts["degraded"] -= 3  # entity 2 was not read: 3 values defaulted
    assert _counts(one_metrics) == general_counts


def test_one_entity_values_and_statuses():
    m = FetchMetrics(views=["v"])
    values, status, row_status, raw = view_matrix(SPEC, [1], {1: ROWS["stale"]}, NOW, m)
    np.testing.assert_array_equal(values, [[1.0, 2.0, -1.0]])  # the value not found takes its default
    np.testing.assert_array_equal(status, [[2, 2, 1]])  # STALE, STALE, MISSING
    assert row_status.tolist() == [2] and raw == {"m": [{"k": 2}]}
    values, status, row_status, raw = view_matrix(SPEC, [1], {}, NOW, m)
    np.testing.assert_array_equal(values, [[0.5, 7.0, -1.0]])
    np.testing.assert_array_equal(status, [[3, 3, 3]])  # DEFAULTED: not read in time
    assert row_status.tolist() == [3] and raw == {"m": [None]}
    assert _counts(m) == {"missing": 1, "degraded": 3, "stale": 2}
