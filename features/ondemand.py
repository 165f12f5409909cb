"""On-demand feature views, computed with Feast's own transformation code at fetch time.

The transformation gets what Feast's `get_online_features` gives it: the source views' features
(under `view__feature` and plain names), their join keys and the request data from the entity
rows, as Python lists (python mode) or a pyarrow table (pandas mode). Rows whose source features
the store does not have (or could not read in time) are not computed: they get the view's
declared defaults and the worst status of their inputs, as any stored feature would.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from scorestack.errors import FeatureError
from scorestack.features.backends import ViewSpec
from scorestack.features.plans import OdfvSpec
from scorestack.features.results import FeatureStatus

_TO_PYTHON = {"Int64": int, "Int32": int, "Bool": bool, "Float32": float, "Float64": float}


def _python_column(values: np.ndarray, present: np.ndarray, dtype: str) -> list:
    """Stored numbers as the Python values Feast's `to_dict` would hand over (ints stay ints; None
    where the store has no value, as Feast gives it)."""
    convert = _TO_PYTHON.get(dtype, float)
    out = values.tolist() if convert is float else [convert(v) for v in values.tolist()]
    if not present.all():
        out = [v if p else None for v, p in zip(out, present.tolist())]
    return out


_ARROW_NUMPY = {"Int64": np.int64, "Int32": np.int64, "Bool": np.bool_, "Float32": np.float64, "Float64": np.float64}


def _arrow_column(values: np.ndarray, present: np.ndarray, dtype: str):
    """The same column `pa.Table.from_pydict(to_dict())` builds in Feast (Python ints -> int64,
    floats -> double, None -> null), straight from numpy: no Python objects per value."""
    import pyarrow as pa

    array: np.ndarray = values.astype(_ARROW_NUMPY.get(dtype, np.float64))
    return pa.array(array, mask=None if present.all() else ~present)


def compute(
    service: str,
    spec: OdfvSpec,
    n: int,
    columns: Mapping[str, Sequence[Any]],
    view_values: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, list]]],
    views: Mapping[str, ViewSpec],
) -> tuple[np.ndarray, np.ndarray]:
    """Outputs of one on-demand view for `n` rows: float32 values and status codes [n, outputs].

    `view_values[view]` holds per row: the stored values (float64, defaults where absent) and
    statuses of the view's numeric features, the status of the row itself, and the raw
    (non-numeric) values per feature; `columns` the validated join keys and request data per row.

    Rows the store answered are computed with exactly Feast's inputs (None where it has no value),
    so the outputs equal `get_online_features`'. Should the transformation fail on such None
    inputs, the rows with missing inputs get the declared defaults and the others are computed
    again. Rows the store did not answer in time are not computed (defaults, `defaulted`).
    """
    width = len(spec.outputs)
    values = np.tile(spec.defaults, (n, 1))
    worst = np.zeros(n, dtype=np.int8)
    for view, _, idx in spec.sources:
        worst = np.maximum(worst, view_values[view][2])
        if len(idx):
            worst = np.maximum(worst, view_values[view][1][:, idx].max(axis=1))
    status = np.repeat(worst[:, None], width, axis=1)
    answered = np.flatnonzero(worst != FeatureStatus.DEFAULTED)
    if len(answered) == 0:
        return values, status
    try:
        result = _transform(spec, answered, n, columns, view_values, views)
        rows = answered
    except Exception as exc:  # a user's transformation may raise anything
        complete = np.flatnonzero((worst == FeatureStatus.PRESENT) | (worst == FeatureStatus.STALE))
        if len(complete) == len(answered):
            raise FeatureError(f"feature service {service!r}: on-demand feature view {spec.name!r} failed: {type(exc).__name__}: {exc}") from exc
        rows = complete
        result = _transform(spec, rows, n, columns, view_values, views) if len(rows) else {o: [] for o in spec.outputs}

    # A computed value is present (stale if an input was); None or NaN out: missing, as Feast says.
    computed_status = np.where(worst[rows] == FeatureStatus.STALE, FeatureStatus.STALE, FeatureStatus.PRESENT).astype(np.int8)
    for k, name in enumerate(spec.outputs):
        got = result[name]
        if not isinstance(got, (list, tuple, np.ndarray)):
            got = [got] * len(rows)  # a singleton-mode scalar
        if len(got) != len(rows):
            raise FeatureError(f"feature service {service!r}: on-demand feature view {spec.name!r} returned {len(got)} values of {name!r} for {len(rows)} rows")
        try:
            col = np.asarray(got, dtype=np.float64)  # numbers (NaN for nulls): no Python loop
        except (TypeError, ValueError):
            col = np.array([math.nan if v is None else float(v) for v in got], dtype=np.float64)
        absent = np.isnan(col)
        values[rows, k] = np.where(absent, spec.defaults[k], col).astype(np.float32)
        status[rows, k] = np.where(absent, FeatureStatus.MISSING, computed_status)
    return values, status


def _transform(spec: OdfvSpec, rows: np.ndarray, n: int, columns, view_values, views) -> dict[str, list]:
    """Feast's transformation of the on-demand view over `rows`, its outputs as lists."""
    every = len(rows) == n
    take = (lambda seq: list(seq)) if every else (lambda seq: [seq[i] for i in rows])
    inputs: dict[str, list] = {}
    for key in spec.join_keys:
        inputs[key] = take(columns[key])
    for name, _ in spec.request_fields:
        inputs[name] = take(columns[name])
    arrow = spec.mode == "pandas"
    for view, features, idx in spec.sources:
        stored, stored_status = view_values[view][0], view_values[view][1]
        if not every:
            stored, stored_status = stored[rows], stored_status[rows]
        column = _arrow_column if arrow else _python_column
        for feature, j in zip(features, idx):
            present = (stored_status[:, j] == FeatureStatus.PRESENT) | (stored_status[:, j] == FeatureStatus.STALE)
            inputs[f"{view}__{feature}"] = column(stored[:, j], present, views[view].types[j])
        for feature in spec.raw_sources.get(view, ()):
            inputs[f"{view}__{feature}"] = take(view_values[view][3][feature])
    try:
        if spec.mode == "python":
            out = spec.view.transform_dict(inputs)
            return {name: out[name] for name in spec.outputs}
        import pyarrow as pa

        table = spec.view.transform_arrow(pa.Table.from_pydict(inputs), False)
        return {name: table.column(name).to_numpy(zero_copy_only=False) for name in spec.outputs}
    except KeyError as exc:
        raise FeatureError(f"on-demand feature view {spec.name!r} did not return output {exc}") from None
