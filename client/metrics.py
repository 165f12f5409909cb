"""Per-phase latency histograms of the request paths: exported with prometheus-client, and read back.

`scorestack diagnose --client-metrics URL` scrapes them (`Scrape`) and joins them with Triton's statistics.

    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, service="fraud", model="fraud_xgb")
    result = await fraud.score(transaction)
    metrics.observe(result.timings_ms)          # validate, features, features_wait, assemble, infer, total
    server = serve(9108, registry)              # GET http://127.0.0.1:9108/metrics
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Mapping

from prometheus_client import CollectorRegistry, Histogram, start_http_server

from scorestack.client.advice import FeatureSide
from scorestack.client.server_stats import fetch_text
from scorestack.errors import InferenceError
from scorestack.features.metrics import in_process_values

METRIC = "scorestack_request_phase_seconds"

# The phases the request paths time (client/timing.py). `features` is the fetch's own duration, which
# overlaps validation; `features_wait` is what the request waited for it on the critical path. Queue
# wait and network are not visible to a client: `diagnose --client-metrics` splits them out of
# `infer` with Triton's statistics.
PHASES = ("validate", "features", "features_wait", "assemble", "infer", "total")

# 50 µs .. 2.5 s: a cache hit at the floor and a request that ran into its deadline both land in a bucket.
BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

_PHASE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_families: "weakref.WeakKeyDictionary[CollectorRegistry, Histogram]" = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _family(registry: CollectorRegistry) -> Histogram:
    """One histogram family per registry, shared by every RequestMetrics on it (one per service)."""
    with _families_lock:
        family = _families.get(registry)
        if family is None:
            family = Histogram(
                METRIC,
                "Wall time of one phase of one request on the request path (seconds).",
                ["service", "model", "phase"],
                registry=registry,
                buckets=BUCKETS,
            )
            _families[registry] = family
        return family


class RequestMetrics:
    """Histograms of one service's request phases, labelled (service, model, phase).

    `observe(phases_ms)` takes a request's phase timings in milliseconds, as the request paths
    report them (`FraudScore.timings_ms`, `RankedItems.timings_ms`), and records them in seconds.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, service: str, model: str) -> None:
        if not service or not model:
            raise ValueError("RequestMetrics needs a service name and the Triton model it calls (service=..., model=...)")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.service = service
        self.model = model
        self._histogram = _family(self.registry)
        self._children: dict[str, object] = {}
        self._lock = threading.Lock()
        for phase in PHASES:
            self._child(phase)

    def _child(self, phase: str):
        child = self._children.get(phase)
        if child is None:
            if not _PHASE_NAME.match(phase):
                raise ValueError(f"phase {phase!r}: use lower-case letters, digits and '_' (e.g. features_wait)")
            # In-process values even after `import feast` switched prometheus_client to multiprocess
            # files (features/metrics.py says why).
            with self._lock, in_process_values():
                child = self._children.get(phase) or self._histogram.labels(self.service, self.model, phase)
                self._children[phase] = child
        return child

    def observe(self, phases_ms: Mapping[str, float]) -> None:
        """Record one request's phases (milliseconds; `total` is the request's wall time)."""
        for phase, ms in phases_ms.items():
            value = float(ms)
            if value < 0 or value != value:
                raise ValueError(f"phase {phase!r}: {ms!r} ms is not a duration; timings are non-negative milliseconds")
            self._child(phase).observe(value / 1e3)


def serve(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1"):
    """Serve `registry` at http://addr:port/metrics from a daemon thread; returns (server, thread).

    Binds loopback by default (metrics name services and models); stop with `server.shutdown()`.
    """
    return start_http_server(port, addr=addr, registry=registry)


@dataclass(frozen=True)
class Scrape:
    """One reading of a Prometheus text endpoint: (sample name, labels) -> value."""

    url: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def read(cls, url: str) -> "Scrape":
        from prometheus_client.parser import text_string_to_metric_families

        text = fetch_text(url)
        samples = {}
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        except ValueError as exc:
            raise InferenceError(f"metrics at {url}: not Prometheus text ({exc}); give the service's /metrics endpoint") from exc
        return cls(url, samples)

    def minus(self, before: "Scrape") -> "Scrape":
        return Scrape(self.url, {k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def _select(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        out = []
        for (n, lbl), v in self.samples.items():
            d = dict(lbl)
            if n == name and all(d.get(k) == v2 for k, v2 in labels.items()):
                out.append((d, v))
        return out

    def request_phases(self, model: str) -> list[tuple[str, dict[str, float], int]]:
        """Per service calling `model`: (service, mean ms per phase, requests), from the request-path
        histograms (client/metrics.py) over the window."""
        sums: dict[str, dict[str, float]] = {}
        counts: dict[str, dict[str, float]] = {}
        for labels, v in self._select(f"{METRIC}_sum", model=model):
            sums.setdefault(labels["service"], {})[labels["phase"]] = v
        for labels, v in self._select(f"{METRIC}_count", model=model):
            counts.setdefault(labels["service"], {})[labels["phase"]] = v
        out = []
        for service, by_phase in sorted(counts.items()):
            n = int(round(by_phase.get("total", 0.0)))
            if n <= 0:
                continue
            means = {p: sums[service].get(p, 0.0) * 1e3 / n for p, c in by_phase.items() if c > 0}
            out.append((service, means, n))
        return out

    def feature_side(self) -> FeatureSide | None:
        """The fetch layer's metrics (features/metrics.py), when the service exports them on the same endpoint."""
        reads: dict[str, tuple[int, float]] = {}
        for labels, n in self._select("scorestack_feature_store_read_seconds_count"):
            if n > 0:
                total_s = sum(v for l2, v in self._select("scorestack_feature_store_read_seconds_sum", backend=labels["backend"]))
                reads[labels["backend"]] = (int(n), total_s * 1e3 / n)
        if not reads:
            return None
        hits = int(sum(v for _, v in self._select("scorestack_feature_cache_hits_total")))
        misses = int(sum(v for _, v in self._select("scorestack_feature_cache_misses_total")))
        co_n = sum(v for _, v in self._select("scorestack_feature_coalesced_requests_count"))
        co_sum = sum(v for _, v in self._select("scorestack_feature_coalesced_requests_sum"))
        return FeatureSide(reads, hits, misses, co_sum / co_n if co_n else None)
