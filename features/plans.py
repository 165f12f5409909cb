"""Fetch plans from Feast's applied registry: per feature service, what to read, compute and return.

A plan says which views to read (only the features some service needs), which on-demand views to
compute from them and from request data, where each output goes in the model's order, and which
reader serves the service. A service whose outputs are not numeric model inputs gets a refusal
instead of a plan; the other services keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from scorestack.errors import FeatureError, FeatureServiceError
from scorestack.features.backends import ViewSpec
from scorestack.features.velocity import spec_from_view
from scorestack.validation import KEY_TYPES

if TYPE_CHECKING:
    import feast

BACKENDS = ("feast_async", "feast_sync", "direct")
# Feast types a model input may have: read as a number, handed to the model as float32.
NUMERIC_TYPES = frozenset(("Float32", "Float64", "Int32", "Int64", "Bool"))
# Request data an on-demand view may take (Feast converts it by the request source's schema).
REQUEST_TYPES = NUMERIC_TYPES | {"String"}
_VALUE_TYPE_NAMES = {"INT64": "Int64", "INT32": "Int32", "STRING": "String"}


@dataclass(frozen=True)
class StoredOutput:
    """Features of one stored view that a service returns."""

    view: str
    columns: np.ndarray  # indices of the features within the view's read features
    positions: np.ndarray  # where they go in the service's output


@dataclass(frozen=True, eq=False)
class OdfvSpec:
    """One on-demand feature view as a service computes it, with Feast's own transformation."""

    name: str  # the name the service knows it by (its alias, if the service renamed it)
    view: Any  # the feast.OnDemandFeatureView: its transform_dict / transform_arrow do the work
    mode: str  # python or pandas
    sources: tuple[tuple[str, tuple[str, ...], np.ndarray], ...]  # (view, numeric features, their indices in the view's read features)
    raw_sources: dict[str, tuple[str, ...]]  # view -> non-numeric features it reads (Map, Json, String...)
    request_fields: tuple[tuple[str, str], ...]  # (name, Feast type)
    join_keys: tuple[str, ...]  # entity columns of its sources, handed to the transformation as Feast does
    outputs: tuple[str, ...]  # the features the service projects
    defaults: np.ndarray  # float32 per output
    positions: np.ndarray  # where the outputs go in the service's output


@dataclass(frozen=True)
class ServicePlan:
    """Everything one `fetch(service, rows)` needs, decided once from the registry."""

    name: str
    feature_names: tuple[str, ...]
    feature_types: tuple[str, ...]
    views: tuple[ViewSpec, ...]  # every stored view read (outputs and on-demand sources)
    stored: tuple[StoredOutput, ...]
    odfvs: tuple[OdfvSpec, ...]
    inputs: dict[str, str]  # join keys, then request fields -> Feast type (what an entity row holds)
    join_keys: tuple[str, ...]
    request_fields: tuple[str, ...]
    backend: str
    backend_reason: str  # why this backend: what `auto` measured and checked, or "asked"
    auto: bool = False  # chosen by `auto` (the direct reader is then verified against Feast at start)


@dataclass
class _Draft:
    """A service's needs before the views' read features are known (phase one of two)."""

    name: str
    outputs: list[tuple[str, str, str]] = field(default_factory=list)  # (kind "view"/"odfv", view name, feature)
    types: list[str] = field(default_factory=list)
    needs: dict[str, list[str]] = field(default_factory=dict)  # stored view -> numeric features read
    raw_needs: dict[str, list[str]] = field(default_factory=dict)  # stored view -> non-numeric features an on-demand view reads
    odfvs: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict)  # alias -> (odfv, projected outputs)
    key_types: dict[str, str] = field(default_factory=dict)
    request: dict[str, str] = field(default_factory=dict)


def type_name(dtype: Any) -> str:
    """Feast's name of a field type: Float32, Int64, String, Map, Array(Float32), Struct(...)."""
    return str(dtype)


def _refuse(service: str, message: str) -> FeatureServiceError:
    return FeatureServiceError(f"feature service {service!r}: {message}")


def _default(service: str, owner: str, f, view_tags: Mapping[str, str] | None = None) -> float:
    """A feature's declared default: its field tag `default`, else its view's tag `default:<feature>`
    (on-demand views must use the latter: Feast compares their fields, tags included, with what it
    infers from the transformation), else 0."""
    raw = (f.tags or {}).get("default", (view_tags or {}).get(f"default:{f.name}", 0.0))
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise _refuse(service, f"feature {owner}:{f.name} has tag default={raw!r}; it must be a number") from None


def _key_types(store: "feast.FeatureStore", view, service: str, entities: Mapping[str, Any]) -> tuple[str, ...]:
    columns = {c.name: type_name(c.dtype) for c in getattr(view, "entity_columns", [])}
    types = []
    for key in view.join_keys:
        kind = columns.get(key)
        if kind is None:  # older registries: the entity's value type
            entity = next((e for e in entities.values() if e.join_key == key), None)
            kind = _VALUE_TYPE_NAMES.get(entity.value_type.name, entity.value_type.name) if entity is not None else "unknown"
        if kind not in KEY_TYPES:
            raise _refuse(service, f"join key {key!r} of view {view.name!r} has type {kind}; supported: {', '.join(KEY_TYPES)}")
        types.append(kind)
    return tuple(types)


def _add_view(draft: _Draft, store, view_name: str, features, stored: dict[str, Any], entities, *, why: str, raw_ok: bool = False) -> None:
    view = stored.get(view_name)
    if view is None:
        raise _refuse(draft.name, f"{why or 'it projects '}{view_name!r}, which is neither a feature view nor an on-demand feature view in the registry")
    for key, kind in zip(view.join_keys, _key_types(store, view, draft.name, entities)):
        if draft.key_types.setdefault(key, kind) != kind:
            raise _refuse(draft.name, f"join key {key!r} is {draft.key_types[key]} in one view and {kind} in {view_name!r}")
    needs = draft.needs.setdefault(view_name, [])
    for f in features:
        kind = type_name(f.dtype)
        if kind not in NUMERIC_TYPES and raw_ok:
            raw = draft.raw_needs.setdefault(view_name, [])
            if f.name not in raw:
                raw.append(f.name)
            continue
        if kind not in NUMERIC_TYPES:
            raise _refuse(
                draft.name,
                f"{why}feature {view_name}:{f.name} has type {kind}; only numeric features "
                f"({', '.join(sorted(NUMERIC_TYPES))}) can be model inputs: remove it from the service or serve it elsewhere",
            )
        if f.name not in needs:
            needs.append(f.name)


def _draft(store, service, stored: dict[str, Any], odfvs: dict[str, Any], entities) -> _Draft:
    draft = _Draft(service.name)
    for projection in service.feature_view_projections:
        if projection.join_key_map:
            raise _refuse(service.name, f"view {projection.name!r} is projected with a join key map {dict(projection.join_key_map)}, which the fetch layer does not support")
        alias = projection.name_alias or projection.name
        if projection.name in odfvs:
            odfv = odfvs[projection.name]
            _check_odfv(draft, store, odfv, stored, entities)
            outputs = tuple(f.name for f in projection.features)
            draft.odfvs[alias] = (odfv, outputs)
            for f in projection.features:
                kind = type_name(f.dtype)
                if kind not in NUMERIC_TYPES:
                    raise _refuse(
                        service.name,
                        f"feature {alias}:{f.name} (on-demand) has type {kind}; only numeric features "
                        f"({', '.join(sorted(NUMERIC_TYPES))}) can be model inputs: remove it from the service or serve it elsewhere",
                    )
                draft.outputs.append(("odfv", alias, f.name))
                draft.types.append(kind)
        else:
            _add_view(draft, store, projection.name, projection.features, stored, entities, why="")
            for f in projection.features:
                draft.outputs.append(("view", projection.name, f.name))
                draft.types.append(type_name(f.dtype))
    names = [f for _, _, f in draft.outputs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise _refuse(service.name, f"features {duplicates} appear twice; rename one with FeatureView.with_name or drop it")
    clash = set(draft.request) & set(draft.key_types)
    if clash:
        raise _refuse(service.name, f"request data {sorted(clash)} has the name of a join key")
    return draft


def _check_odfv(draft: _Draft, store, odfv, stored, entities) -> None:
    if odfv.write_to_online_store:
        raise _refuse(draft.name, f"on-demand feature view {odfv.name!r} has write_to_online_store=True; the fetch layer computes on-demand views at read time only")
    if odfv.aggregations:
        raise _refuse(draft.name, f"on-demand feature view {odfv.name!r} declares aggregations, which the fetch layer does not compute")
    if odfv.mode not in ("python", "pandas"):
        raise _refuse(draft.name, f"on-demand feature view {odfv.name!r} has mode {odfv.mode!r}; supported: python, pandas")
    for projection in odfv.source_feature_view_projections.values():
        if projection.join_key_map:
            raise _refuse(draft.name, f"on-demand feature view {odfv.name!r} reads {projection.name!r} through a join key map, which is not supported")
        _add_view(draft, store, projection.name, projection.features, stored, entities, why=f"on-demand feature view {odfv.name!r} reads ", raw_ok=True)
    for source in odfv.source_request_sources.values():
        for f in source.schema:
            kind = type_name(f.dtype)
            if kind not in REQUEST_TYPES:
                raise _refuse(draft.name, f"request field {f.name!r} of {source.name!r} has type {kind}; supported: {', '.join(sorted(REQUEST_TYPES))}")
            if draft.request.setdefault(f.name, kind) != kind:
                raise _refuse(draft.name, f"request field {f.name!r} is {draft.request[f.name]} in one source and {kind} in {source.name!r}")


def _view_spec(view, features: list[str], raw_features: list[str], key_types: tuple[str, ...], service: str) -> ViewSpec:
    fields = {f.name: f for f in view.features}
    order = [f.name for f in view.features if f.name in features]  # the view's own order
    return ViewSpec(
        name=view.name,
        join_keys=tuple(view.join_keys),
        key_types=key_types,
        features=tuple(order),
        types=tuple(type_name(fields[f].dtype) for f in order),
        defaults=np.array([_default(service, view.name, fields[f], view.tags) for f in order], dtype=np.float32),
        ttl_s=view.ttl.total_seconds() if view.ttl else 0.0,
        cache_ttl_s=float(view.tags.get("cache_ttl_s", 0.0)),
        raw_features=tuple(f.name for f in view.features if f.name in raw_features),
        windows=spec_from_view(view),
    )


def load_plans(
    store: "feast.FeatureStore", backend: str | Mapping[str, str] = "auto"
) -> tuple[dict[str, ServicePlan], dict[str, FeatureServiceError], dict[str, ViewSpec]]:
    """Plans of the servable feature services, refusals of the others, and the views they read."""
    services = store.list_feature_services()
    if not services:
        raise FeatureError("repo_dir: no feature services registered; run `feast apply` (or `scorestack features apply`) first")
    stored = {v.name: v for v in store.list_feature_views()}
    odfvs = {v.name: v for v in store.list_on_demand_feature_views()}
    entities = {e.name: e for e in store.list_entities()}
    drafts: dict[str, _Draft] = {}
    refused: dict[str, FeatureServiceError] = {}
    for service in services:
        try:
            drafts[service.name] = _draft(store, service, stored, odfvs, entities)
        except FeatureServiceError as exc:
            refused[service.name] = exc
    _check_backend_names(backend, [s.name for s in services])

    # Phase two: a view is read with the union of what the servable services need from it.
    needs: dict[str, list[str]] = {}
    raw_needs: dict[str, list[str]] = {}
    for draft in drafts.values():
        for into, got in ((needs, draft.needs), (raw_needs, draft.raw_needs)):
            for view, features in got.items():
                union = into.setdefault(view, [])
                union += [f for f in features if f not in union]
    views: dict[str, ViewSpec] = {}
    for name, features in needs.items():
        owner = next(d for d in drafts.values() if name in d.needs)
        try:
            views[name] = _view_spec(stored[name], features, raw_needs.get(name, []), tuple(owner.key_types[k] for k in stored[name].join_keys), owner.name)
        except FeatureServiceError as exc:
            for d in [d for d in drafts.values() if name in d.needs]:
                refused[d.name] = exc
                del drafts[d.name]
    online = str(getattr(store.config.online_store, "type", "sqlite"))
    direct_reason = direct_unsupported(store)
    plans = {}
    for name, draft in drafts.items():
        try:
            plans[name] = _plan(draft, views, backend, online, direct_reason)
        except FeatureServiceError as exc:
            refused[name] = exc
    return plans, refused, views


def _plan(draft: _Draft, views: Mapping[str, ViewSpec], backend, online: str, direct_reason: str | None) -> ServicePlan:
    position = {(kind, owner, f): i for i, (kind, owner, f) in enumerate(draft.outputs)}
    stored_out = []
    for view, _ in draft.needs.items():
        spec = views[view]
        out = [(spec.features.index(f), position[("view", view, f)]) for f in spec.features if ("view", view, f) in position]
        if out:
            stored_out.append(StoredOutput(view, np.array([c for c, _ in out], np.intp), np.array([p for _, p in out], np.intp)))
    odfv_specs = []
    for alias, (odfv, outputs) in draft.odfvs.items():
        fields = {f.name: f for f in odfv.features}
        projections = list(odfv.source_feature_view_projections.values())
        numeric = {p.name: [f.name for f in p.features if f.name in views[p.name].features] for p in projections}
        sources = tuple(
            (p.name, tuple(numeric[p.name]), np.array([views[p.name].features.index(f) for f in numeric[p.name]], np.intp))
            for p in projections
        )
        raw_sources = {p.name: tuple(f.name for f in p.features if f.name in views[p.name].raw_features) for p in projections}
        join_keys = tuple(dict.fromkeys(k for view, _, _ in sources for k in views[view].join_keys))
        request = tuple((f.name, type_name(f.dtype)) for s in odfv.source_request_sources.values() for f in s.schema)
        odfv_specs.append(
            OdfvSpec(
                name=alias,
                view=odfv,
                mode=odfv.mode,
                sources=sources,
                raw_sources=raw_sources,
                request_fields=request,
                join_keys=join_keys,
                outputs=outputs,
                defaults=np.array([_default(draft.name, alias, fields[o], odfv.tags) if o in fields else 0.0 for o in outputs], np.float32),
                positions=np.array([position[("odfv", alias, o)] for o in outputs], np.intp),
            )
        )
    chosen, reason, auto = _choose(draft.name, backend, online, direct_reason)
    return ServicePlan(
        name=draft.name,
        feature_names=tuple(f for _, _, f in draft.outputs),
        feature_types=tuple(draft.types),
        views=tuple(views[v] for v in draft.needs),
        stored=tuple(stored_out),
        odfvs=tuple(odfv_specs),
        inputs={**draft.key_types, **draft.request},
        join_keys=tuple(draft.key_types),
        request_fields=tuple(draft.request),
        backend=chosen,
        backend_reason=reason,
        auto=auto,
    )


# --- which reader serves a service -------------------------------------------------------------------


def direct_unsupported(store: "feast.FeatureStore") -> str | None:
    """Why the direct Redis reader cannot read this store's layout (None: it can)."""
    config = store.config
    online = config.online_store
    if str(getattr(online, "type", "")) != "redis":
        return f"the online store is {getattr(online, 'type', 'unknown')}, not redis"
    redis_type = str(getattr(getattr(online, "redis_type", "redis"), "value", getattr(online, "redis_type", "redis")))
    if redis_type != "redis":
        return f"redis_type {redis_type} (the direct reader speaks to one Redis server)"
    if config.entity_key_serialization_version != 3:
        return f"entity_key_serialization_version {config.entity_key_serialization_version} (the direct reader knows 3)"
    if getattr(config.registry, "enable_online_feature_view_versioning", False):
        return "online feature view versioning is on (versioned hash fields)"
    return None


def _check_backend_names(backend: str | Mapping[str, str], services: list[str]) -> None:
    if isinstance(backend, str):
        names = {backend}
    else:
        unknown = set(backend) - set(services)
        if unknown:
            raise FeatureError(f"backend: unknown feature service(s) {sorted(unknown)}; known: {', '.join(services)}")
        names = set(backend.values())
    for name in names:
        if name != "auto" and name not in BACKENDS:
            raise FeatureError(f"backend: {name!r}; expected one of auto, {', '.join(BACKENDS)}")


def _choose(service: str, backend: str | Mapping[str, str], online: str, direct_reason: str | None) -> tuple[str, str, bool]:
    asked = backend if isinstance(backend, str) else backend.get(service, "auto")
    if asked == "auto":
        if online != "redis":
            return "feast_sync", f"{online} online store: Feast's reads in a worker thread (the only reader for it)", True
        if direct_reason is None:
            return "direct", "fastest measured on Redis (benchmarks/results/features.md: one user, and one user + 100 items)", True
        return "feast_async", f"the direct reader cannot read this store ({direct_reason}); Feast's async reads instead", True
    if asked in ("feast_async", "direct") and online != "redis":
        raise FeatureError(f"backend: {asked!r} needs the Redis online store; this repository's online store is {online}")
    if asked == "direct" and direct_reason is not None:
        raise FeatureError(f"backend: 'direct' cannot read this store: {direct_reason}; use feast_async")
    return asked, "asked", False
