"""Prometheus metrics of the fetch layer, on a registry of the fetcher's own (or one it is given)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as _values

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


@contextmanager
def in_process_values() -> Iterator[None]:
    """Create metric values in process memory even when Feast switched prometheus_client to multiprocess mode.

    `import feast` sets PROMETHEUS_MULTIPROCESS_DIR (feast/metrics.py, for its Gunicorn server), which
    makes every metric value a file shared by all registries of the process with the same name and
    labels: two fetchers would count into each other. Values are created when a labelled child is;
    every child is created here, up front, with the in-memory value class.
    """
    saved = _values.ValueClass
    _values.ValueClass = _values.MutexValue
    try:
        yield
    finally:
        _values.ValueClass = saved


class FetchMetrics:
    """The metric families; label values are services, feature views and backend names (all pre-created)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        services: Iterable[str] = (),
        views: Iterable[str] = (),
        backends: Iterable[str] = (),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        with in_process_values():
            self._create(self.registry, tuple(services), tuple(views), tuple(backends))

    def child(self, family, *labels: str):
        """`family.labels(*labels)`, looked up once: the request path updates ~8 children per fetch,
        and prometheus_client's `labels()` validates and locks on every call (~4 µs each). A child not
        pre-created is created in process memory (see in_process_values)."""
        key = (id(family), labels)
        found = self._children.get(key)
        if found is None:
            with in_process_values():
                found = self._children[key] = family.labels(*labels)
        return found

    def _create(self, r: CollectorRegistry, services: tuple[str, ...], views: tuple[str, ...], backends: tuple[str, ...]) -> None:
        self.fetch_seconds = Histogram(
            "scorestack_feature_fetch_seconds", "Wall time of one fetch call.", ["service"], registry=r, buckets=_LATENCY_BUCKETS
        )
        self.fetches = Counter(
            "scorestack_feature_fetches_total", "Fetch calls by outcome (ok or degraded).", ["service", "outcome"], registry=r
        )
        self.store_read_seconds = Histogram(
            "scorestack_feature_store_read_seconds", "Wall time of one store round trip.", ["backend"], registry=r, buckets=_LATENCY_BUCKETS
        )
        self.store_reads = Counter(
            "scorestack_feature_store_reads_total",
            "Store round trips by outcome (ok, timeout, error, rejected by the open breaker).",
            ["backend", "outcome"],
            registry=r,
        )
        self.coalesced = Histogram(
            "scorestack_feature_coalesced_requests",
            "Fetch calls served by one store round trip.",
            ["backend"],
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.cache_hits = Counter("scorestack_feature_cache_hits_total", "Entity rows served from the cache.", ["feature_view"], registry=r)
        self.cache_misses = Counter(
            "scorestack_feature_cache_misses_total", "Entity rows of cacheable views read from the store.", ["feature_view"], registry=r
        )
        self.defaults = Counter(
            "scorestack_feature_defaults_total",
            "Feature values replaced by their declared default (reason: missing, or the store failing: degraded).",
            ["feature_view", "reason"],
            registry=r,
        )
        self.stale = Counter("scorestack_feature_stale_total", "Feature values older than their view's ttl.", ["feature_view"], registry=r)
        self.breaker_state = Gauge(
            "scorestack_feature_breaker_state", "Circuit breaker per backend: 0 closed, 1 open, 2 half-open.", ["backend"], registry=r
        )
        for service in services:
            self.fetch_seconds.labels(service)
            for outcome in ("ok", "degraded"):
                self.fetches.labels(service, outcome)
        for backend in backends:
            self.store_read_seconds.labels(backend)
            self.coalesced.labels(backend)
            self.breaker_state.labels(backend)
            for outcome in ("ok", "timeout", "error", "rejected"):
                self.store_reads.labels(backend, outcome)
        for view in views:
            self.cache_hits.labels(view)
            self.cache_misses.labels(view)
            self.stale.labels(view)
            for reason in ("missing", "degraded"):
                self.defaults.labels(view, reason)
