"""Exact, windowed velocity counters: atomic increments into time buckets, summed at read.

The read-modify-write of `push.CounterUpdate` (new value = value just fetched + this event) loses
an increment whenever two replicas score the same entity at once, and never forgets old events.
Here every event is one atomic write into the bucket of *its own* event time:

- Redis (production): one Lua script per event. It first sets an idempotency marker for the
  event id (`SET NX EX`), and only if that marker is new adds the event to its bucket hash
  (`HINCRBYFLOAT` per feature) and refreshes the bucket's expiry. Redis runs a script atomically,
  so any number of writer processes add exactly once each; a retry after a lost reply cannot
  double count (the marker is already there). Measured against an optimistic WATCH/MULTI
  transaction with retry in benchmarks/bench_velocity.py (results/velocity.md).
- SQLite (the embedded default, one process): `INSERT ... ON CONFLICT DO UPDATE SET v = v + ?`
  in one transaction, with the event id as a primary key for the same idempotency.

A window of `window_s` seconds at a resolution of `bucket_s` (stated per feature) sums the last
`window_s // bucket_s` buckets (the current one included), so an event counts for between
`window_s - bucket_s` and `window_s` seconds after its event time. The fraud counters: 1 h at 60 s
buckets (60 buckets), 24 h at 1 h buckets (24). Reading all of them is one pipelined round trip
(one HMGET per bucket, 84 for the fraud view).

Only additive features are supported (counts and sums); a distinct count (distinct cards) is not
additive across buckets and is left to the batch job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from scorestack.errors import FeatureError

Clock = Callable[[], float]


@dataclass(frozen=True)
class WindowedFeature:
    """One additive feature over a sliding window.

    Args:
        name: the feature's name (as in the Feast view).
        window_s: the window's length in seconds (3600 for "last 1 h").
        source: the event field added to the feature, or None to add 1 (a count).
        bucket_s: the window's resolution: an event counts for between window_s - bucket_s and
            window_s seconds after its event time.
    """

    name: str
    window_s: int
    source: str | None = None
    bucket_s: int = 60


@dataclass(frozen=True)
class VelocitySpec:
    """The windowed counters of one entity kind, at one bucket resolution.

    Args:
        name: the counters' name (the Feast view's name); part of every key.
        bucket_s: the resolution: events are summed into buckets of this many seconds.
        features: the windowed features.
        dedup_s: how long an event id is remembered (a retry later than this would count twice).
    """

    name: str
    features: tuple[WindowedFeature, ...]
    dedup_s: int = 3600

    def __post_init__(self) -> None:
        for f in self.features:
            if f.bucket_s < 1 or f.window_s < f.bucket_s or f.window_s % f.bucket_s:
                raise FeatureError(f"{f.name}: window {f.window_s} s is not a multiple of its {f.bucket_s} s bucket")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def resolutions(self) -> dict[int, tuple[WindowedFeature, ...]]:
        """bucket_s -> the features kept at that resolution (each resolution has its own buckets)."""
        out: dict[int, list[WindowedFeature]] = {}
        for f in self.features:
            out.setdefault(f.bucket_s, []).append(f)
        return {b: tuple(fs) for b, fs in sorted(out.items())}

    def longest_s(self, bucket_s: int) -> int:
        return max(f.window_s for f in self.resolutions[bucket_s])

    @staticmethod
    def bucket(t: float, bucket_s: int) -> int:
        """The start (epoch seconds) of the bucket of `bucket_s` seconds holding time `t`."""
        return int(math.floor(t / bucket_s)) * bucket_s

    def buckets(self, now: float) -> list[tuple[int, int]]:
        """(bucket_s, bucket start) of every bucket some window ending at `now` covers, newest first."""
        out = []
        for bucket_s in self.resolutions:
            current = self.bucket(now, bucket_s)
            out += [(bucket_s, current - i * bucket_s) for i in range(self.longest_s(bucket_s) // bucket_s)]
        return out

    def deltas(self, event: Mapping[str, Any]) -> dict[str, float]:
        """What `event` adds to each feature."""
        return {f.name: 1.0 if f.source is None else float(event[f.source]) for f in self.features}

    def sums(self, now: float, per_bucket: Mapping[tuple[int, int], Mapping[str, float]]) -> dict[str, float]:
        """Each feature's window sum at `now` from the buckets' stored values ((bucket_s, start) -> values)."""
        out = {}
        for f in self.features:
            current = self.bucket(now, f.bucket_s)
            oldest = current - (f.window_s // f.bucket_s - 1) * f.bucket_s
            out[f.name] = sum(v.get(f.name, 0.0) for (bs, b), v in per_bucket.items() if bs == f.bucket_s and oldest <= b <= current)
        return out

    def reference(self, now: float, events: Sequence[tuple[float, Mapping[str, Any]]]) -> dict[str, float]:
        """The exact window sums computed from an event log of (event time, event): the check."""
        per_bucket: dict[tuple[int, int], dict[str, float]] = {}
        for t, event in events:
            deltas = self.deltas(event)
            for f in self.features:
                slot = per_bucket.setdefault((f.bucket_s, self.bucket(t, f.bucket_s)), {})
                slot[f.name] = slot.get(f.name, 0.0) + deltas[f.name]
        return self.sums(now, per_bucket)


# KEYS[1] = event marker, KEYS[2..] = one bucket hash per resolution;
# ARGV = dedup ttl, then per bucket hash: its ttl, its number of fields n, then n (field, delta) pairs.
_ADD_SCRIPT = """
if not redis.call('SET', KEYS[1], 1, 'NX', 'EX', ARGV[1]) then return 0 end
local a = 2
for k = 2, #KEYS do
  local ttl, n = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  for i = 1, n do
    redis.call('HINCRBYFLOAT', KEYS[k], ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  redis.call('EXPIRE', KEYS[k], ttl)
end
return 1
"""


class RedisVelocity:
    """Windowed counters in Redis (sync client; one instance per process or thread).

    Keys: `<prefix><spec.name>:<entity>:<bucket start>` (a hash: feature -> sum), expiring one
    bucket after the longest window; `<prefix><spec.name>:seen:<event id>` marks a written event.
    """

    def __init__(self, client, spec: VelocitySpec, *, prefix: str = "scorestack:velocity:", clock: Clock = time.time) -> None:
        self.client = client
        self.spec = spec
        self.prefix = f"{prefix}{spec.name}:"
        self.clock = clock
        self._add = client.register_script(_ADD_SCRIPT) if client is not None else None  # None: keys only

    def _key(self, entity: Any, bucket_s: int, bucket: int) -> str:
        return f"{self.prefix}{entity}:{bucket_s}:{bucket}"

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> bool:
        """Add one event to the bucket of its own time; False when this event id was already added.

        Raises the client's error when Redis cannot be reached: the caller counts it as failed
        (and may retry with the same `event_id`: it is never added twice).
        """
        t = self.clock() if event_time is None else event_time
        deltas = self.spec.deltas(event)
        keys = [f"{self.prefix}seen:{event_id}"]
        args: list[Any] = [self.spec.dedup_s]
        for bucket_s, features in self.spec.resolutions.items():
            keys.append(self._key(entity, bucket_s, self.spec.bucket(t, bucket_s)))
            # Kept one bucket past the longest window: the bucket ages out after its last use.
            args += [self.spec.longest_s(bucket_s) + bucket_s, len(features)]
            for f in features:
                args += [f.name, repr(deltas[f.name])]
        return bool(self._add(keys=keys, args=args))

    def read_commands(self, entity: Any, now: float) -> list[tuple[str, list[str]]]:
        """The HMGETs reading `entity`'s windows, to be sent in one pipeline with other reads."""
        names = {bs: [f.name for f in fs] for bs, fs in self.spec.resolutions.items()}
        return [(self._key(entity, bs, b), names[bs]) for bs, b in self.spec.buckets(now)]

    def sums_from(self, now: float, replies: Sequence[Sequence[bytes | None]]) -> dict[str, float]:
        names = {bs: [f.name for f in fs] for bs, fs in self.spec.resolutions.items()}
        per_bucket = {}
        for (bs, b), reply in zip(self.spec.buckets(now), replies):
            per_bucket[(bs, b)] = {n: float(v) for n, v in zip(names[bs], reply) if v is not None}
        return self.spec.sums(now, per_bucket)

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        """Every feature's window sum for `entity`, in one round trip."""
        now = self.clock() if now is None else now
        pipe = self.client.pipeline(transaction=False)
        for key, fields in self.read_commands(entity, now):
            pipe.hmget(key, fields)
        return self.sums_from(now, pipe.execute())


class SqliteVelocity:
    """Windowed counters in SQLite for the embedded, one-process default (same semantics as Redis)."""

    def __init__(self, path: str, spec: VelocitySpec, *, clock: Clock = time.time) -> None:
        import sqlite3

        self.spec = spec
        self.clock = clock
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS velocity_bucket (name TEXT, entity TEXT, bucket_s INTEGER, bucket INTEGER, feature TEXT,"
            " value REAL, PRIMARY KEY (name, entity, bucket_s, bucket, feature))"
        )
        self.db.execute("CREATE TABLE IF NOT EXISTS velocity_seen (name TEXT, event_id TEXT, at REAL, PRIMARY KEY (name, event_id))")
        import threading

        self._lock = threading.Lock()  # one connection, used from the writer's and the readers' threads

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> bool:
        with self._lock:
            return self._add(entity, event_id, event, event_time)

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        with self._lock:
            return self._read(entity, now)

    def _add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> bool:
        t = self.clock() if event_time is None else event_time
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            seen = db.execute("INSERT OR IGNORE INTO velocity_seen VALUES (?, ?, ?)", (self.spec.name, event_id, t)).rowcount
            if seen:
                deltas = self.spec.deltas(event)
                db.executemany(
                    "INSERT INTO velocity_bucket VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (name, entity, bucket_s, bucket, feature) DO UPDATE SET value = value + excluded.value",
                    [(self.spec.name, str(entity), f.bucket_s, self.spec.bucket(t, f.bucket_s), f.name, deltas[f.name]) for f in self.spec.features],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return bool(seen)

    def _read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        now = self.clock() if now is None else now
        oldest = min(b for _, b in self.spec.buckets(now))
        rows = self.db.execute(
            "SELECT bucket_s, bucket, feature, value FROM velocity_bucket WHERE name = ? AND entity = ? AND bucket >= ?",
            (self.spec.name, str(entity), oldest),
        ).fetchall()
        per_bucket: dict[tuple[int, int], dict[str, float]] = {}
        for bs, b, name, value in rows:
            per_bucket.setdefault((bs, b), {})[name] = value
        return self.spec.sums(now, per_bucket)

    def expire(self, now: float | None = None) -> int:
        """Delete buckets older than the longest window and old event ids (Redis expires them itself)."""
        now = self.clock() if now is None else now
        oldest = min(b for _, b in self.spec.buckets(now))
        with self._lock:
            n = self.db.execute("DELETE FROM velocity_bucket WHERE name = ? AND bucket < ?", (self.spec.name, oldest)).rowcount
            self.db.execute("DELETE FROM velocity_seen WHERE name = ? AND at < ?", (self.spec.name, now - self.spec.dedup_s))
        return n


@dataclass
class VelocityWriter:
    """Adds events with every outcome counted (added, duplicate, failed); one retry with the same id."""

    store: Any
    counts: dict[str, int] = field(default_factory=lambda: {"added": 0, "duplicate": 0, "failed": 0})

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> str:
        for attempt in range(2):
            try:
                outcome = "added" if self.store.add(entity, event_id, event, event_time) else "duplicate"
                break
            except Exception:  # the store is unreachable: retried once (idempotent), then counted
                if attempt:
                    outcome = "failed"
        self.counts[outcome] += 1
        return outcome


# The fraud path's windowed velocity counters (additive ones; distinct_cards_24h stays batch-fed).
FRAUD_VELOCITY = VelocitySpec(
    name="user_txn_velocity",
    features=(
        WindowedFeature("txn_count_1h", 3600, None, bucket_s=60),
        WindowedFeature("amount_sum_1h", 3600, "amount", bucket_s=60),
        WindowedFeature("txn_count_24h", 86400, None, bucket_s=3600),
        WindowedFeature("amount_sum_24h", 86400, "amount", bucket_s=3600),
    ),
)


# --- the Feast catalogue, the fetch layer and the write path ---------------------------------------


def spec_from_view(view) -> VelocitySpec | None:
    """The windowed counters a Feast feature view declares (field tags `window_s`, `bucket_s`,
    `window_source`: the event field added, empty for a count); None when it declares none."""
    features = []
    for f in view.features:
        tags = f.tags or {}
        if "window_s" in tags:
            try:
                features.append(WindowedFeature(f.name, int(tags["window_s"]), tags.get("window_source") or None, int(tags.get("bucket_s", 60))))
            except ValueError as exc:
                raise FeatureError(f"view {view.name!r}, feature {f.name!r}: window tags {tags}: {exc}") from None
    return VelocitySpec(view.name, tuple(features)) if features else None


def entity_text(entity: Any) -> str:
    """An entity (a join-key value, or a tuple of them) as it appears in a counter key."""
    return "|".join(map(str, entity)) if isinstance(entity, tuple) else str(entity)


def redis_prefix(project: str) -> str:
    """The key prefix of a project's counters (beside Feast's own hashes in the same Redis)."""
    return f"{project}:velocity:"


def overlay(view, row, sums: Mapping[str, float], now: float):
    """`row` (a backends.Row of ViewSpec `view`, or None) with its windowed features replaced by `sums`.

    An entity without a stored row gets one holding only its windowed features, timed `now`; a
    stored row keeps its own event time, so the view's other (batch-fed) features age as before.
    """
    import numpy as np

    from scorestack.features.backends import Row

    if row is None:
        values = np.zeros(len(view.features), dtype=np.float64)
        found = np.zeros(len(view.features), dtype=bool)
        row = Row(values, found, now, tuple(None for _ in view.raw_features))
    else:
        row = Row(row.values.copy(), row.found.copy(), row.event_ts, row.raw)
    for i, name in enumerate(view.features):
        if name in sums:
            row.values[i] = sums[name]
            row.found[i] = True
    return row


def sync_counters(store: "Any", spec: VelocitySpec, *, clock: Clock = time.time):
    """The counters of a Feast store's online store: SqliteVelocity (in Feast's own SQLite file) or
    RedisVelocity (in Feast's Redis, under `<project>:velocity:`)."""
    config = store.config
    kind = str(getattr(config.online_store, "type", "sqlite"))
    if kind == "sqlite" or kind.endswith("SqliteOnlineStore"):
        online = store._get_provider().online_store
        return SqliteVelocity(str(online._get_db_path(config)), spec, clock=clock)
    if kind == "redis" or kind.endswith("RedisOnlineStore"):
        import redis
        from feast.infra.online_stores.redis import RedisOnlineStore

        nodes, params = RedisOnlineStore._parse_connection_string(config.online_store.connection_string)
        client = redis.Redis(host=nodes[0]["host"], port=int(nodes[0]["port"]), **params)
        return RedisVelocity(client, spec, prefix=redis_prefix(config.project), clock=clock)
    raise FeatureError(f"windowed counters: online store {kind!r} unsupported (sqlite, redis)")


class AsyncVelocityWriter:
    """The fraud path's write-back: `submit` returns at once; each event is added atomically in the
    background (one worker thread, so the event loop never waits on the store) and its outcome is
    counted in `scorestack_velocity_writes_total{view, outcome}`: added, duplicate (a retry of an
    event already added), failed (the store unreachable after one retry with the same event id),
    dropped (more than `max_pending` writes waiting). Nothing is lost silently.
    """

    def __init__(self, counters, *, max_pending: int = 1024, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter

        from scorestack.features.metrics import in_process_values

        self.counters = counters
        self.writer = VelocityWriter(counters)
        self.max_pending = max_pending
        self.registry = registry if registry is not None else CollectorRegistry()
        with in_process_values():
            self._writes = Counter(
                "scorestack_velocity_writes_total",
                "Events added to windowed velocity counters, by outcome (added, duplicate, failed, dropped).",
                ["view", "outcome"],
                registry=self.registry,
            )
        from concurrent.futures import ThreadPoolExecutor

        import threading

        self._executor = ThreadPoolExecutor(1, thread_name_prefix="scorestack-velocity")
        self._lock = threading.Lock()
        self._pending = 0
        self._futures: set = set()

    @classmethod
    def for_store(cls, store, view: str = "user_txn_velocity", **options: Any) -> "AsyncVelocityWriter":
        spec = spec_from_view(store.get_feature_view(view))
        if spec is None:
            raise FeatureError(f"view {view!r} declares no windowed features (field tags window_s, bucket_s)")
        return cls(sync_counters(store, spec), **options)

    def _count(self, outcome: str) -> None:
        from scorestack.features.metrics import in_process_values

        with in_process_values():
            child = self._writes.labels(self.counters.spec.name, outcome)
        child.inc()

    def count(self, outcome: str) -> int:
        value = self.registry.get_sample_value("scorestack_velocity_writes_total", {"view": self.counters.spec.name, "outcome": outcome})
        return int(value or 0)

    def _add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None) -> None:
        try:
            self._count(self.writer.add(entity_text(entity), event_id, event, event_time))
        finally:
            with self._lock:
                self._pending -= 1

    def submit(self, entity: Any, event: Mapping[str, Any], *, event_id: str | None = None, event_time: float | None = None) -> bool:
        """Queue one event (its time defaults to now, its id to a fresh one); False when dropped."""
        import uuid

        if self._pending >= self.max_pending:
            self._count("dropped")
            return False
        with self._lock:
            self._pending += 1
        t = self.counters.clock() if event_time is None else event_time
        future = self._executor.submit(self._add, entity, event_id or uuid.uuid4().hex, dict(event), t)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return True

    async def drain(self, timeout_s: float = 5.0) -> None:
        import asyncio

        if self._futures:
            await asyncio.wait([asyncio.wrap_future(f) for f in list(self._futures)], timeout=timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        await self.drain(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)


def read_windows(counters_by_view: Mapping[str, Any], views: Mapping[str, Any], wanted: Mapping[str, Sequence[Any]], out: dict) -> None:
    """Replace the windowed features of `out` (backends.Rows) by their sums, read with sync counters
    (the Feast readers' path: SQLite, or Redis when the direct reader is not used)."""
    for name, counters in counters_by_view.items():
        if name in out:
            now = counters.clock()
            view = views[name]
            out[name] = [overlay(view, row, counters.read(entity_text(e), now), now) for e, row in zip(wanted[name], out[name])]
