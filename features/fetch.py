"""The async feature-fetch layer of the request path: one `await fetcher.fetch(service, entity_rows)`.

It returns a Feast feature service's numeric features (stored, and on-demand ones computed with
Feast's own transformation code) as a float32 matrix in the model's feature order. It never
raises for a store problem and never waits past its budget: on a timeout, an error or an open
circuit breaker the declared defaults are used and the result says `degraded`. Concurrent fetches
share store round trips (`lanes`); slow-moving views are cached in process.

    fetcher = FeatureFetcher.from_repo(repo_dir)            # fastest verified reader per service
    async with fetcher:
        fraud = await fetcher.fetch("fraud", {"user_id": 42})                          # 1 x 18
        ranking = await fetcher.fetch("ranking", {"user_id": 42, "item_id": item_ids})  # n x 34
        driver = await fetcher.fetch("driver", [{"driver_id": 1001, "val_to_add": 1}])  # + request data
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Sequence

from scorestack import validation
from scorestack.errors import FeatureError, FeatureServiceError
from scorestack.features.assemble import assemble
from scorestack.features.backends import Backend, DirectRedisBackend, Entity, FeastAsyncBackend, FeastThreadBackend, Row, ViewSpec
from scorestack.features.lanes import Lane
from scorestack.features.metrics import FetchMetrics
from scorestack.features.plans import ServicePlan, load_plans
from scorestack.features.resilience import CircuitBreaker, TTLCache
from scorestack.features.results import FeatureResult, FeatureStatus, FetchTimings

if TYPE_CHECKING:
    import feast
    from prometheus_client import CollectorRegistry

__all__ = ["FeatureFetcher", "FeatureResult", "FeatureStatus", "FetchTimings"]

logger = logging.getLogger(__name__)
BackendName = Literal["feast_async", "feast_sync", "direct"]


class FeatureFetcher:
    """Async reader of Feast feature services for the request path.

    Args:
        store: a `feast.FeatureStore` on an applied and materialized repository.
        backend: "auto", one backend name for every service, or a map service -> backend name.
            "auto" picks the fastest reader that can read the store, per service: on Redis the
            direct reader (pipelined HMGET of Feast's hashes; measured 1.8x Feast's async reads for
            one user and 3-8x for one user + 100 items), falling back to "feast_async" where its
            layout does not apply (cluster, versioned views); on any other store "feast_sync"
            (Feast's reads in a worker thread). `backend_reason(service)` says why.
        services: services the caller will use; each is planned now and a refused one raises here
            (default: every registered service; a refused one raises when first used).
        timeout_s: budget of one fetch, including any coalescing wait; past it, defaults.
        coalesce_window_s: fetches to the same backend arriving within this window share one store
            round trip (0, the default: those issued in the same event-loop turn; None: no
            coalescing). A positive window is paid in full by a lone fetch, and asyncio's timers
            round it up to about 1 ms (measured: 200 us cost +1.1 ms p50 at concurrency 1).
        cache: keep rows of views whose `cache_ttl_s` tag is > 0 in process for that long.
        breaker_failures, breaker_cooldown_s: the circuit breaker per backend.
        registry: Prometheus registry for the metrics (default: a new one, `fetcher.registry`).
        max_rows: largest number of entity rows accepted in one fetch.
        verify: at `start`, check each service `auto` gave the direct reader against Feast's own
            reads on entities sampled from the store; a service that differs falls back to
            "feast_async" (`backend_reason` says what differed).
        freeze_heap: at the end of `start`, collect once and move every object then alive out of
            the garbage collector's view (`gc.freeze`: the process's start-up heap, Feast's registry,
            pandas, protobuf modules, never freed anyway). Measured: a full collection over the
            ~340k objects of a fraud service took 200-220 ms, once every ~2000 requests at 64
            concurrent, and every request in flight waited for it (c64 p99 220-280 ms; frozen:
            collections of 1-8 ms, p99 38-57 ms; benchmarks/results/request_path.md). Process-wide:
            False leaves the collector as it is.
        windows: read the windowed counters a view declares (Feast field tags `window_s`,
            `bucket_s`; scorestack.features.velocity) as the sums of their time buckets, in the
            same store round trip as the rest of the view (direct reader; the Feast readers add
            one). False (the default): those features read as Feast stores them (the batch or
            pushed value), as Feast's own `get_online_features` does.
    """

    def __init__(
        self,
        store: "feast.FeatureStore",
        *,
        backend: str | Mapping[str, str] = "auto",
        services: Iterable[str] | None = None,
        timeout_s: float = 0.020,
        coalesce_window_s: float | None = 0.0,
        cache: bool = True,
        cache_max_entries: int = 100_000,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 1.0,
        registry: "CollectorRegistry | None" = None,
        max_rows: int = 10_000,
        verify: bool = True,
        freeze_heap: bool = True,
        windows: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise FeatureError(f"timeout_s: must be > 0, got {timeout_s}")
        if coalesce_window_s is not None and coalesce_window_s < 0:
            raise FeatureError(f"coalesce_window_s: must be >= 0 or None, got {coalesce_window_s}")
        self.store = store
        self.freeze_heap = freeze_heap
        self.windows = windows
        self.timeout_s = float(timeout_s)
        self.max_rows = max_rows
        self._cache: TTLCache[Row] | None = TTLCache(cache_max_entries) if cache else None
        plans, refused, views = load_plans(store, backend)
        named = set(services) if services is not None else set()
        if not isinstance(backend, str):
            named |= {s for s, b in backend.items() if b != "auto"}
        for name in sorted(named):
            if name in refused:
                raise refused[name]
            if name not in plans:
                raise FeatureError(f"services: unknown feature service {name!r}; known: {', '.join([*plans, *refused])}")
        if services is not None:
            plans = {name: plan for name, plan in plans.items() if name in named}
            views = {v.name: v for plan in plans.values() for v in plan.views}
        for exc in refused.values():
            logger.warning("%s (fetching it will raise; the other services are served)", exc)
        self._plans: dict[str, ServicePlan] = plans
        self._refused: dict[str, FeatureServiceError] = {} if services is not None else refused
        self.views: dict[str, ViewSpec] = views
        used_backends = {p.backend for p in plans.values() if p.views}
        self._verify = verify and any(p.auto and p.backend == "direct" and p.views for p in plans.values())
        # A service that fails verification moves to feast_async: its metrics exist from the start.
        self.metrics = FetchMetrics(registry, plans, views, used_backends | ({"feast_async"} if self._verify else set()))
        self.registry = self.metrics.registry
        self._breaker_options = (breaker_failures, breaker_cooldown_s)
        self._window_s = coalesce_window_s
        self._lanes: dict[str, Lane] = {}
        for backend_name in sorted(used_backends):
            self._lanes[backend_name] = self._make_lane(backend_name)
        self._started = False

    def _make_lane(self, backend_name: str) -> Lane:
        used = {v.name: v for plan in self._plans.values() if plan.backend == backend_name for v in plan.views}
        return Lane(self._make_backend(backend_name, used), CircuitBreaker(*self._breaker_options), self._window_s, self.metrics)

    @classmethod
    def from_repo(cls, repo_dir: str | Path | None = None, **options: Any) -> "FeatureFetcher":
        """A fetcher on the feature repository `repo_dir` (default `<workspace>/feature_repo`)."""
        from scorestack.features.store import feature_store

        return cls(feature_store(repo_dir), **options)

    def _make_backend(self, name: str, views: dict[str, ViewSpec]) -> Backend:
        if name == "feast_sync":
            return FeastThreadBackend(views, self.store)
        if name == "feast_async":
            return FeastAsyncBackend(views, self.store)
        config = self.store.config
        return DirectRedisBackend(
            views,
            connection_string=config.online_store.connection_string,
            project=config.project,
            entity_key_serialization_version=config.entity_key_serialization_version,
        )

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> "FeatureFetcher":
        """Open the store clients (inside the event loop that will call `fetch`)."""
        if not self._started:
            for lane in self._lanes.values():
                await lane.backend.start()
                await _warm_up(lane.backend)
            if self._verify:
                await self._verify_direct()
            if self.windows:
                self._attach_windows()
            self._started = True
            if self.freeze_heap:
                gc.collect()
                gc.freeze()
        return self

    def _attach_windows(self) -> None:
        """Give each backend the counters of the windowed views it reads (after verification,
        which compares stored values with Feast's reads)."""
        from scorestack.features.velocity import RedisVelocity, redis_prefix, sync_counters

        for name, lane in self._lanes.items():
            windows = {}
            for view in lane.backend.views.values():
                if view.windows is not None:
                    if name == "direct":
                        windows[view.name] = RedisVelocity(None, view.windows, prefix=redis_prefix(self.store.config.project))
                    else:
                        windows[view.name] = sync_counters(self.store, view.windows)
            lane.backend.windows = windows

    async def _verify_direct(self, timeout_s: float = 5.0) -> None:
        """Keep the direct reader for an `auto` service only where it reads what Feast reads."""
        from dataclasses import replace

        from scorestack.features.verify import compare, sample_entities

        plans = [p for p in self._plans.values() if p.auto and p.backend == "direct" and p.views]
        direct = self._lanes["direct"].backend
        reference = FeastThreadBackend({v.name: v for p in plans for v in p.views}, self.store)
        await reference.start()
        fallen: list[str] = []
        try:
            try:
                sample = await asyncio.wait_for(sample_entities(direct, reference.views, self.store.config.project), timeout_s)
            except Exception as exc:  # an unreachable store is not an error at start
                logger.warning("direct reader not verified at start: %s: %s", type(exc).__name__, exc)
                return
            for plan in plans:
                wanted = {v.name: list(dict.fromkeys([*sample.get(v.name, []), v.probe_entity()])) for v in plan.views}
                n = sum(len(e) for e in wanted.values())
                try:
                    problem = await asyncio.wait_for(compare(direct, reference, wanted), timeout_s)
                except Exception as exc:  # the direct reader failing where Feast reads is a difference too
                    problem = f"{type(exc).__name__}: {exc}"
                if problem is None:
                    self._plans[plan.name] = replace(plan, backend_reason=f"{plan.backend_reason}; read what Feast reads for {n} sampled entities at start")
                else:
                    logger.warning("service %s: direct reader differs from Feast (%s); using feast_async", plan.name, problem)
                    self._plans[plan.name] = replace(
                        plan, backend="feast_async", backend_reason=f"the direct reader differed from Feast at start ({problem}); Feast's async reads instead"
                    )
                    fallen.append(plan.name)
        finally:
            await reference.close()
            direct.round_trips = 0
        if fallen and "feast_async" not in self._lanes:
            lane = self._lanes["feast_async"] = self._make_lane("feast_async")
            await lane.backend.start()
            await _warm_up(lane.backend)

    async def close(self) -> None:
        if self._started:
            self._started = False
            for lane in self._lanes.values():
                await lane.close()

    async def __aenter__(self) -> "FeatureFetcher":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- introspection ----------------------------------------------------------------------------

    @property
    def services(self) -> tuple[str, ...]:
        """The services this fetcher serves (refused ones are not listed; see `refused`)."""
        return tuple(self._plans)

    @property
    def refused(self) -> dict[str, str]:
        """Registered services that cannot be served as numeric model inputs, with why."""
        return {name: str(exc) for name, exc in self._refused.items()}

    def feature_names(self, service: str) -> tuple[str, ...]:
        return self._plan(service).feature_names

    def inputs(self, service: str) -> dict[str, str]:
        """What an entity row of `service` holds: join keys, then request data, each with its Feast type."""
        return dict(self._plan(service).inputs)

    def backend_of(self, service: str) -> str:
        return self._plan(service).backend

    def backend_reason(self, service: str) -> str:
        return self._plan(service).backend_reason

    def round_trips(self, backend: str) -> int:
        """Store round trips made by one backend so far."""
        return self._lanes[backend].backend.round_trips

    def breaker(self, backend: str) -> CircuitBreaker:
        return self._lanes[backend].breaker

    def clear_cache(self) -> None:
        if self._cache is not None:
            self._cache.clear()

    def _plan(self, service: str) -> ServicePlan:
        try:
            return self._plans[service]
        except (KeyError, TypeError):
            if isinstance(service, str) and service in self._refused:
                raise self._refused[service] from None
            raise FeatureError(f"service: unknown feature service {service!r}; known: {', '.join(self._plans)}") from None

    # --- the request path -------------------------------------------------------------------------

    async def fetch(self, service: str, entity_rows: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> FeatureResult:
        """Features of `service` for each entity row, in the model's order.

        `entity_rows` is a list of rows (`[{"user_id": 1}, ...]`, as Feast's `get_online_features`
        takes them, with any request data the service's on-demand views need) or columns
        (`{"user_id": 7, "item_id": [3, 5, 8]}`; a scalar is repeated for every row). Raises
        FeatureError for an unknown or refused service or invalid rows; store failures never raise.
        """
        start = time.perf_counter()
        plan = self._plan(service)
        if not self._started:
            raise FeatureError("fetcher: not started; use `async with fetcher:` or `await fetcher.start()`")
        columns, n = validation.entity_rows(
            entity_rows, plan.inputs, service=service, max_rows=self.max_rows, join_keys=plan.join_keys
        )

        cache = self._cache
        entities: dict[str, list[Entity]] = {}
        found: dict[str, dict[Entity, Row | None]] = {}
        misses: dict[str, list[Entity]] = {}
        hits = 0
        for spec in plan.views:
            entities[spec.name] = view_entities = spec.entities(columns)
            unique = list(dict.fromkeys(view_entities))
            got: dict[Entity, Row | None] = {}
            if cache is not None and spec.cache_ttl_s > 0:
                missed = []
                view = spec.name
                for entity, row in zip(unique, cache.get_many([(view, e) for e in unique])):
                    if row is None:
                        missed.append(entity)
                    else:
                        got[entity] = row
                if got:
                    hits += len(got)
                    self.metrics.child(self.metrics.cache_hits, spec.name).inc(len(got))
                if missed:
                    self.metrics.child(self.metrics.cache_misses, spec.name).inc(len(missed))
            else:
                missed = unique
            found[spec.name] = got
            if missed:
                misses[spec.name] = missed

        reason: str | None = None
        store_s = 0.0
        if misses:
            outcome = await self._lanes[plan.backend].read(misses, start + self.timeout_s)
            store_s = outcome.store_s
            if outcome.rows is None:
                reason = outcome.reason
            else:
                for view, rows in outcome.rows.items():
                    if view not in found:
                        continue
                    found[view].update(rows)
                    spec = self.views[view]
                    if cache is not None and spec.cache_ttl_s > 0:
                        for entity, row in rows.items():
                            if row is not None:
                                cache.put((view, entity), row, spec.cache_ttl_s)

        values, status = assemble(plan, columns, n, entities, found, self.metrics)
        degraded = reason is not None
        total = time.perf_counter() - start
        self.metrics.child(self.metrics.fetch_seconds, service).observe(total)
        self.metrics.child(self.metrics.fetches, service, "degraded" if degraded else "ok").inc()
        return FeatureResult(
            service=service,
            feature_names=plan.feature_names,
            values=values,
            status=status,
            degraded=degraded,
            reason=reason,
            cache_hits=hits,
            backend=plan.backend,
            timings=FetchTimings(total_s=total, store_s=store_s),
        )


async def _warm_up(backend: Backend, timeout_s: float = 5.0) -> None:
    """One untimed read, so the first request does not pay for Feast's registry load and connecting.

    A store that is down now is not an error here: requests will get defaults until it is back.
    """
    try:
        await asyncio.wait_for(backend.read({name: [spec.probe_entity()] for name, spec in backend.views.items()}), timeout_s)
    except Exception as exc:  # see docstring
        logger.warning("feature store warm-up through %s failed: %s: %s", backend.name, type(exc).__name__, exc)
    backend.round_trips = 0
