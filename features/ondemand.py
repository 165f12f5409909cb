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


def _python_column(values: np.ndarray, dtype: str) -> list:
    """Stored numbers as the Python values Feast's `to_dict` would hand over (ints stay ints)."""
    convert = _TO_PYTHON.get(dtype, float)
    if convert is float:
        return values.tolist()
    return [convert(v) for v in values.tolist()]


def compute(
    service: str,
    spec: OdfvSpec,
    n: int,
    columns: Mapping[str, Sequence[Any]],
    view_values: Mapping[str, tuple[np.ndarray, np.ndarray]],
    views: Mapping[str, ViewSpec],
) -> tuple[np.ndarray, np.ndarray]:
    """Outputs of one on-demand view for `n` rows: float32 values and status codes [n, outputs].

    `view_values[view]` holds the rows' stored values (float64, defaults where absent) and statuses
    per read feature of the view; `columns` the validated join keys and request data per row.
    """
    width = len(spec.outputs)
    values = np.tile(spec.defaults, (n, 1))
    status = np.full((n, width), FeatureStatus.PRESENT, dtype=np.int8)
    worst = np.zeros(n, dtype=np.int8)
    for view, _, idx in spec.sources:
        if len(idx):
            worst = np.maximum(worst, view_values[view][1][:, idx].max(axis=1))
    complete = (worst == FeatureStatus.PRESENT) | (worst == FeatureStatus.STALE)
    status[:] = worst[:, None]
    rows = np.flatnonzero(complete)
    if len(rows) == 0:
        return values, status
    every = len(rows) == n
    take = (lambda seq: list(seq)) if every else (lambda seq: [seq[i] for i in rows])

    inputs: dict[str, list] = {}
    for key in spec.join_keys:
        inputs[key] = take(columns[key])
    for name, _ in spec.request_fields:
        inputs[name] = take(columns[name])
    for view, features, idx in spec.sources:
        stored = view_values[view][0] if every else view_values[view][0][rows]
        for feature, j in zip(features, idx):
            inputs[f"{view}__{feature}"] = _python_column(stored[:, j], views[view].types[j])

    try:
        if spec.mode == "python":
            out = spec.view.transform_dict(inputs)
            result = {name: out[name] for name in spec.outputs}
        else:
            import pyarrow as pa

            table = spec.view.transform_arrow(pa.Table.from_pydict(inputs), False)
            result = {name: table.column(name).to_pylist() for name in spec.outputs}
    except KeyError as exc:
        raise FeatureError(f"feature service {service!r}: on-demand feature view {spec.name!r} did not return output {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a user's transformation may raise anything; name it
        raise FeatureError(f"feature service {service!r}: on-demand feature view {spec.name!r} failed: {type(exc).__name__}: {exc}") from exc

    for k, name in enumerate(spec.outputs):
        got = result[name]
        if not isinstance(got, (list, tuple)):
            got = [got] * len(rows)  # a singleton-mode scalar
        if len(got) != len(rows):
            raise FeatureError(f"feature service {service!r}: on-demand feature view {spec.name!r} returned {len(got)} values of {name!r} for {len(rows)} rows")
        col = np.array([math.nan if v is None else float(v) for v in got], dtype=np.float64)
        absent = np.isnan(col)
        col = np.where(absent, spec.defaults[k], col).astype(np.float32)
        values[rows, k] = col
        if absent.any():
            status[rows[absent], k] = FeatureStatus.MISSING
    return values, status
