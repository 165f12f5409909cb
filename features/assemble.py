"""Assembly: the rows read per view become one float32 matrix in the service's order, with statuses.

Per view, each entity's stored values (or the declared defaults) and a status per value; then the
on-demand views computed from those and the request data; then the service's columns picked out.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from scorestack.features.backends import Entity, ViewSpec
from scorestack.features.metrics import FetchMetrics
from scorestack.features.ondemand import compute
from scorestack.features.plans import ServicePlan
from scorestack.features.results import FeatureStatus

NOT_READ = object()  # an entity the store was not asked about in time (timeout, error, open breaker)

# Plain ints: an IntEnum member handed to numpy costs an enum attribute lookup per use.
_PRESENT, _MISSING, _STALE, _DEFAULTED = (int(s) for s in (FeatureStatus.PRESENT, FeatureStatus.MISSING, FeatureStatus.STALE, FeatureStatus.DEFAULTED))


def _one_entity(spec: ViewSpec, row: Any, now: float, metrics: FetchMetrics) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, list]]:
    """view_matrix for a single entity (a fraud request's user): the same result without stacking."""
    width = len(spec.features)
    raw: dict[str, list] = {}
    if row is NOT_READ or row is None:
        defaults = spec.defaults.astype(np.float64)
        code = _DEFAULTED if row is NOT_READ else _MISSING
        values, status, row_status = defaults[None, :], np.full((1, width), code, dtype=np.int8), np.array([code], dtype=np.int8)
        if spec.raw_features:
            raw = {feature: [None] for feature in spec.raw_features}
        if row is NOT_READ:
            metrics.child(metrics.defaults, spec.name, "degraded").inc(width)
        else:
            metrics.child(metrics.defaults, spec.name, "missing").inc(width)
        return values, status, row_status, raw
    have = np.asarray(row.found, dtype=bool)
    stale = spec.ttl_s > 0 and now - row.event_ts > spec.ttl_s
    code = _STALE if stale else _PRESENT
    n_found = int(np.count_nonzero(have))
    if n_found == width:  # the usual case, every value stored: no np.where
        # A view of the row's own array, which the fetcher may keep in its cache: read it, never write it
        # (assemble copies it into the service's matrix; on-demand inputs are built as new lists).
        values = row.values.reshape(1, width)
        status = np.full((1, width), code, dtype=np.int8)
    else:
        values = np.where(have, row.values, spec.defaults.astype(np.float64))[None, :]
        status = np.full((1, width), _MISSING, dtype=np.int8)
        status[0, have] = code
    if spec.raw_features:
        raw = {feature: [row.raw[j]] for j, feature in enumerate(spec.raw_features)}
    if n_found < width:
        metrics.child(metrics.defaults, spec.name, "missing").inc(width - n_found)
    if stale and n_found:
        metrics.child(metrics.stale, spec.name).inc(n_found)
    return values, status, np.array([code], dtype=np.int8), raw


def view_matrix(
    spec: ViewSpec, entities: list[Entity], rows: Mapping[Entity, Any], now: float, metrics: FetchMetrics
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, list]]:
    """One view for the rows' entities: values (float64, defaults where absent) and statuses
    [n, features], the status of each row as a whole [n], and the raw values per raw feature."""
    n, width = len(entities), len(spec.features)
    if n == 1:
        return _one_entity(spec, rows.get(entities[0], NOT_READ), now, metrics)
    unique = list(dict.fromkeys(entities))
    defaults = spec.defaults.astype(np.float64)
    u_values = np.tile(defaults, (len(unique), 1))
    u_status = np.full((len(unique), width), FeatureStatus.MISSING, dtype=np.int8)
    got = [rows.get(entity, NOT_READ) for entity in unique]
    not_read = [k for k, row in enumerate(got) if row is NOT_READ]
    read_k = [k for k, row in enumerate(got) if row is not None and row is not NOT_READ]
    read_rows = got if len(read_k) == len(got) else [got[k] for k in read_k]
    n_stale = 0
    u_row = np.full(len(unique), FeatureStatus.MISSING, dtype=np.int8)
    if not_read:
        u_status[not_read] = FeatureStatus.DEFAULTED
        u_row[not_read] = FeatureStatus.DEFAULTED
    if read_rows:
        # One vectorized pass over every row read, not numpy calls per row.
        # concatenate + reshape: np.stack expands each row's array first (500 rows: 230 against 50 µs).
        have = np.concatenate([r.found for r in read_rows]).reshape(len(read_rows), width)
        stored = np.concatenate([r.values for r in read_rows]).reshape(len(read_rows), width)
        event_ts = np.array([r.event_ts for r in read_rows])
        stale = (now - event_ts > spec.ttl_s) if spec.ttl_s > 0 else np.zeros(len(read_rows), dtype=bool)
        u_values[read_k] = np.where(have, stored, defaults)
        u_status[read_k] = np.where(have, np.where(stale[:, None], FeatureStatus.STALE, FeatureStatus.PRESENT), FeatureStatus.MISSING)
        n_stale = int(have[stale].sum())
        u_row[read_k] = np.where(stale, FeatureStatus.STALE, FeatureStatus.PRESENT)
    raw: dict[str, list] = {}
    if spec.raw_features:
        by_k = dict(zip(read_k, read_rows))
        for j, feature in enumerate(spec.raw_features):
            column = [by_k[k].raw[j] if k in by_k else None for k in range(len(unique))]
            raw[feature] = column
    n_degraded = len(not_read) * width
    n_missing = int(np.count_nonzero(u_status == FeatureStatus.MISSING))
    if n_missing:
        metrics.child(metrics.defaults, spec.name, "missing").inc(n_missing)
    if n_degraded:
        metrics.child(metrics.defaults, spec.name, "degraded").inc(n_degraded)
    if n_stale:
        metrics.child(metrics.stale, spec.name).inc(n_stale)
    if len(unique) == n:
        return u_values, u_status, u_row, raw  # the usual case: no duplicate entities, rows already in order
    if len(unique) == 1:  # one user for every candidate
        inverse = np.zeros(n, dtype=np.intp)
    else:
        position = {entity: k for k, entity in enumerate(unique)}
        inverse = np.fromiter((position[e] for e in entities), dtype=np.intp, count=n)
    raw = {feature: [column[k] for k in inverse] for feature, column in raw.items()}
    return u_values[inverse], u_status[inverse], u_row[inverse], raw


def assemble(
    plan: ServicePlan,
    columns: Mapping[str, Sequence[Any]],
    n: int,
    entities: Mapping[str, list[Entity]],
    found: Mapping[str, Mapping[Entity, Any]],
    metrics: FetchMetrics,
) -> tuple[np.ndarray, np.ndarray]:
    """The service's float32 values and int8 statuses [n, features]."""
    now = time.time()
    values = np.empty((n, len(plan.feature_names)), dtype=np.float32)
    status = np.empty((n, len(plan.feature_names)), dtype=np.int8)
    per_view = {spec.name: view_matrix(spec, entities[spec.name], found[spec.name], now, metrics) for spec in plan.views}
    for out in plan.stored:
        view_values, view_status, _, _ = per_view[out.view]
        values[:, out.positions] = view_values[:, out.columns]
        status[:, out.positions] = view_status[:, out.columns]
    views = {spec.name: spec for spec in plan.views}
    for odfv in plan.odfvs:
        values[:, odfv.positions], status[:, odfv.positions] = compute(plan.name, odfv, n, columns, per_view, views)
    return values, status
