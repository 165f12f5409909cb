"""Prometheus metrics of the fetch layer, on a registry of the fetcher's own (or one it is given)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class FetchMetrics:
    """The metric families; label values are services, feature views and backend names."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
