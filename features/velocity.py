"""Exact, windowed velocity counters: atomic increments into time buckets, summed at read.

The read-modify-write of `push.CounterUpdate` (new value = value just fetched + this event) loses
an increment whenever two replicas score the same entity at once, and never forgets old events.
Here every event is one atomic write into the bucket of *its own* event time:

- Redis (production): one Lua script per event. It first sets an idempotency marker for the
  event id (`SET NX EX`), and only if that marker is new adds the event to its bucket
  (`HINCRBYFLOAT`). Redis runs a script atomically, so any number of writer processes add exactly
  once each, and a retry after a lost reply cannot double count (the marker is already there).
  Measured against an optimistic WATCH/MULTI transaction with retry and against the old
  read-modify-write (benchmarks/results/velocity_write_modes.md).
- SQLite (the embedded default, one process): `INSERT ... ON CONFLICT DO UPDATE SET v = v + ?`
  in one transaction, with the event id as a primary key for the same idempotency.

A window of `window_s` seconds at a resolution of `bucket_s` (stated per feature, in the Feast
definition's field tags) sums the last `window_s // bucket_s` buckets, the current one included,
so an event counts for between `window_s - bucket_s` and `window_s` seconds after its event time.
The fraud counters: 1 h at 5-minute buckets (12), 24 h at 1-hour buckets (24). A late or
out-of-order event lands in the bucket of its own time; one older than every window is reported
`expired` and not written. On Redis the buckets of one entity are a ring in one hash (see below),
summed server-side by a read script: one command per entity, sent in the fetch's own pipeline.

Only additive features are supported (counts and sums); a distinct count (distinct cards) is not
additive across buckets and stays with the batch job.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from scorestack.errors import FeatureError

Clock = Callable[[], float]
logger = logging.getLogger(__name__)


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


# The Redis layout: one hash per entity, `<prefix><view>:<entity>`, a ring of buckets per resolution:
# field `<feature>:<slot>` holds the feature's sum in the slot's bucket and `t<bucket_s>:<slot>` that
# bucket's start, slot = (start / bucket_s) mod (slots of the resolution's longest window). An event
# whose bucket is newer than its slot's resets the slot; one older than its slot's bucket is more
# than a whole window old (out of every window it could count in) and is reported, not added.
# The hash expires one longest window after its last write; nothing else needs cleaning.

# KEYS[1] = event marker, KEYS[2] = the entity's hash.
# ARGV = dedup ttl, hash ttl, then per resolution: bucket start, time field, oldest bucket still in
# the resolution's longest window (by the writer's clock), n, then n (field, delta).
# Returns 0 (a duplicate event id), 1 (added), 2 (added, but too old for some window), 3 (too old for all).
_ADD_SCRIPT = """
if not redis.call('SET', KEYS[1], 1, 'NX', 'EX', ARGV[1]) then return 0 end
local a, applied, skipped = 3, 0, 0
while a <= #ARGV do
  local b, tf, oldest, n = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  local cur = tonumber(redis.call('HGET', KEYS[2], tf) or '-1')
  if b < oldest then
    skipped = skipped + 1
  elseif cur == b then
    for i = 0, n - 1 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[a + 2 * i], ARGV[a + 2 * i + 1]) end
    applied = applied + 1
  elseif cur < b then
    redis.call('HSET', KEYS[2], tf, ARGV[a - 4])
    for i = 0, n - 1 do redis.call('HSET', KEYS[2], ARGV[a + 2 * i], ARGV[a + 2 * i + 1]) end
    applied = applied + 1
  else
    skipped = skipped + 1
  end
  a = a + 2 * n
end
if applied > 0 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
if skipped == 0 then return 1 elseif applied > 0 then return 2 else return 3 end
"""

# KEYS[1] = the entity's hash. ARGV = per resolution: bucket_s, current bucket start, slots, n, then
# n (feature, buckets in its window). Returns each feature's window sum, in order (as text, exact).
READ_SCRIPT = """
local out, a = {}, 1
while a <= #ARGV do
  local bs, cur, slots, n = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  local tfs = {}
  for s = 0, slots - 1 do tfs[s + 1] = 't' .. bs .. ':' .. s end
  local ts = redis.call('HMGET', KEYS[1], unpack(tfs))
  for i = 1, n do
    local name, oldest = ARGV[a], cur - (tonumber(ARGV[a + 1]) - 1) * tonumber(bs)
    a = a + 2
    local fields = {}
    for s = 0, slots - 1 do
      local t = tonumber(ts[s + 1])
      if t and t >= oldest and t <= cur then fields[#fields + 1] = name .. ':' .. s end
    end
    local sum = 0
    if #fields > 0 then
      for _, v in ipairs(redis.call('HMGET', KEYS[1], unpack(fields))) do sum = sum + (tonumber(v) or 0) end
    end
    out[#out + 1] = string.format('%.17g', sum)
  end
end
return out
"""

ADD_OUTCOMES = {0: "duplicate", 1: "added", 2: "added", 3: "expired"}


class RedisVelocity:
    """Windowed counters in Redis (sync client; thread-safe through its connection pool).

    Writes and reads are Lua scripts, each atomic on the server: an add is exact under any number
    of writer processes, and a read sums the window's buckets server-side (one small reply).
    `<prefix><view>:seen:<event id>` marks a written event for `spec.dedup_s`.
    """

    def __init__(self, client, spec: VelocitySpec, *, prefix: str = "scorestack:velocity:", clock: Clock = time.time) -> None:
        import hashlib

        self.client = client
        self.spec = spec
        self.prefix = f"{prefix}{spec.name}:"
        self.clock = clock
        self.read_sha = hashlib.sha1(READ_SCRIPT.encode()).hexdigest()
        self._add = client.register_script(_ADD_SCRIPT) if client is not None else None  # None: keys only
        self._read = client.register_script(READ_SCRIPT) if client is not None else None
        self._slots = {bs: self.spec.longest_s(bs) // bs for bs in spec.resolutions}

    def key(self, entity: Any) -> str:
        return f"{self.prefix}{entity}"

    def add_call(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> tuple[list, list]:
        """The add script's keys and arguments for one event."""
        now = self.clock()
        t = now if event_time is None else event_time
        deltas = self.spec.deltas(event)
        args: list[Any] = [self.spec.dedup_s, max(f.window_s + f.bucket_s for f in self.spec.features)]
        for bucket_s, features in self.spec.resolutions.items():
            b = self.spec.bucket(t, bucket_s)
            slot = (b // bucket_s) % self._slots[bucket_s]
            oldest = self.spec.bucket(now, bucket_s) - (self._slots[bucket_s] - 1) * bucket_s
            args += [b, f"t{bucket_s}:{slot}", oldest, len(features)]
            for f in features:
                args += [f"{f.name}:{slot}", repr(deltas[f.name])]
        return [f"{self.prefix}seen:{event_id}", self.key(entity)], args

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> str:
        """Add one event to the bucket of its own time; its outcome: added, duplicate (this event id
        was already added) or expired (older than every window it counts in).

        Raises the client's error when Redis cannot be reached: the caller counts it as failed
        (and may retry with the same `event_id`: it is never added twice).
        """
        keys, args = self.add_call(entity, event_id, event, event_time)
        return ADD_OUTCOMES[int(self._add(keys=keys, args=args))]

    def add_many(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]]) -> list[str]:
        """Several adds in one pipelined round trip (each still atomic on its own)."""
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            keys, args = self.add_call(*item)
            self._add(keys=keys, args=args, client=pipe)
        return [ADD_OUTCOMES[int(r)] for r in pipe.execute()]

    def read_args(self, now: float) -> list[Any]:
        """The read script's arguments at `now` (the same for every entity)."""
        args: list[Any] = []
        for bucket_s, features in self.spec.resolutions.items():
            args += [bucket_s, self.spec.bucket(now, bucket_s), self._slots[bucket_s], len(features)]
            for f in features:
                args += [f.name, f.window_s // bucket_s]
        return args

    def read_names(self) -> list[str]:
        """The features in the order the read script answers them."""
        return [f.name for features in self.spec.resolutions.values() for f in features]

    def sums_from(self, reply: Sequence[bytes]) -> dict[str, float]:
        return {name: float(v) for name, v in zip(self.read_names(), reply)}

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        """Every feature's window sum for `entity`, in one round trip."""
        now = self.clock() if now is None else now
        return self.sums_from(self._read(keys=[self.key(entity)], args=self.read_args(now)))


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

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> str:
        """Add one event to the bucket of its own time: "added", or "duplicate" for a known event id."""
        with self._lock:
            return self._add(entity, event_id, event, event_time)

    def add_many(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]]) -> list[str]:
        return [self.add(*item) for item in items]

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        with self._lock:
            return self._read(entity, now)

    def _add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> bool:
        now = self.clock()
        t = now if event_time is None else event_time
        # Buckets older than the resolution's longest window (by this clock) are not written.
        oldest = {bs: self.spec.bucket(now, bs) - (self.spec.longest_s(bs) // bs - 1) * bs for bs in self.spec.resolutions}
        rows = [(f, self.spec.bucket(t, f.bucket_s)) for f in self.spec.features]
        rows = [(f, b) for f, b in rows if b >= oldest[f.bucket_s]]
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            seen = db.execute("INSERT OR IGNORE INTO velocity_seen VALUES (?, ?, ?)", (self.spec.name, event_id, now)).rowcount
            if seen and rows:
                deltas = self.spec.deltas(event)
                db.executemany(
                    "INSERT INTO velocity_bucket VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (name, entity, bucket_s, bucket, feature) DO UPDATE SET value = value + excluded.value",
                    [(self.spec.name, str(entity), f.bucket_s, b, f.name, deltas[f.name]) for f, b in rows],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return "duplicate" if not seen else "added" if rows else "expired"

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
    """Adds events with every outcome counted: added, duplicate, expired (older than every window),
    failed (the store unreachable twice). A failed attempt is retried once with the same event id:
    the marker makes that safe, and a "duplicate" answered to the retry means the first attempt
    landed after all (its reply was lost), so it counts as added."""

    store: Any
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("added", "duplicate", "expired", "failed"), 0))

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> str:
        return self.add_many([(entity, event_id, event, event_time)])[0]

    def add_many(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]]) -> list[str]:
        try:
            outcomes = self.store.add_many(items)
        except Exception:  # the store is unreachable: retried once (idempotent), then counted failed
            try:
                outcomes = ["added" if o == "duplicate" else o for o in self.store.add_many(items)]
            except Exception:
                outcomes = ["failed"] * len(items)
        for outcome in outcomes:
            self.counts[outcome] += 1
        return outcomes


# The fraud path's windowed velocity counters (additive ones; distinct_cards_24h stays batch-fed).
FRAUD_VELOCITY = VelocitySpec(
    name="user_txn_velocity",
    features=(
        WindowedFeature("txn_count_1h", 3600, None, bucket_s=300),
        WindowedFeature("amount_sum_1h", 3600, "amount", bucket_s=300),
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

        from redis.backoff import NoBackoff
        from redis.retry import Retry

        nodes, params = RedisOnlineStore._parse_connection_string(config.online_store.connection_string)
        params.pop("retry", None)
        params.setdefault("socket_timeout", 1.0)
        params.setdefault("socket_connect_timeout", 1.0)
        # The writer retries once itself (with the same event ids); redis-py's own retries would
        # only hold the writer thread during an outage.
        client = redis.Redis(host=nodes[0]["host"], port=int(nodes[0]["port"]), retry=Retry(NoBackoff(), 0), **params)
        return RedisVelocity(client, spec, prefix=redis_prefix(config.project), clock=clock)
    raise FeatureError(f"windowed counters: online store {kind!r} unsupported (sqlite, redis)")


class AsyncVelocityWriter:
    """The fraud path's write-back: `submit` returns at once (a queue put); one background thread
    takes whatever has queued and adds it in one pipelined round trip (each add atomic on its own),
    so the event loop never waits on the store and a burst costs one round trip, not one per event.
    Every outcome is counted in `scorestack_velocity_writes_total{view, outcome}`: added, duplicate
    (an event id already added), expired (older than every window), failed (the store unreachable
    for `retry_s`), dropped (more than `max_pending` waiting). Nothing is lost silently.

    An event the store did not take (unreachable, after VelocityWriter's immediate retry) is kept and
    sent again, with its id and its own event time, every RETRY_BACKOFF_S (doubling to 1 s) for up to
    `retry_s` seconds (default 30; 0 gives up at once): a Redis restart or failover shorter than that
    loses no count, and the ids make a resend that had landed after all count once. Each resend is
    counted as `retried` (not an outcome: every event still ends in exactly one of the five above).
    A waiting event counts as pending, so a long outage fills `max_pending` and then drops, counted.
    """

    RETRY_BACKOFF_S = 0.05

    def __init__(self, counters, *, max_pending: int = 4096, max_batch: int = 256, linger_s: float = 0.002, retry_s: float = 30.0,
                 registry=None) -> None:
        import queue
        import threading

        from prometheus_client import CollectorRegistry, Counter

        from scorestack.features.metrics import in_process_values

        if not retry_s >= 0:
            raise ValueError(f"retry_s: {retry_s!r}; give the seconds a failed write is retried (0: none)")
        self.counters = counters
        self.writer = VelocityWriter(counters)
        self.max_pending = max_pending
        self.max_batch = max_batch
        self.retry_s = retry_s
        # After the first event, wait this long for more: one wake-up and one round trip per batch
        # instead of per event (each wake-up takes the interpreter lock from the event loop).
        self.linger_s = linger_s
        self.registry = registry if registry is not None else CollectorRegistry()
        with in_process_values():
            self._writes = Counter(
                "scorestack_velocity_writes_total",
                "Events added to windowed velocity counters, by outcome (added, duplicate, expired, failed, dropped; retried counts resends).",
                ["view", "outcome"],
                registry=self.registry,
            )
        self._sources = tuple(dict.fromkeys(f.source for f in counters.spec.features if f.source is not None))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="scorestack-velocity", daemon=True)
        self._thread.start()

    @classmethod
    def for_store(cls, store, view: str = "user_txn_velocity", **options: Any) -> "AsyncVelocityWriter":
        spec = spec_from_view(store.get_feature_view(view))
        if spec is None:
            raise FeatureError(f"view {view!r} declares no windowed features (field tags window_s, bucket_s)")
        return cls(sync_counters(store, spec), **options)

    def _count(self, outcome: str, n: int = 1) -> None:
        from scorestack.features.metrics import in_process_values

        with in_process_values():
            child = self._writes.labels(self.counters.spec.name, outcome)
        child.inc(n)

    def count(self, outcome: str) -> int:
        value = self.registry.get_sample_value("scorestack_velocity_writes_total", {"view": self.counters.spec.name, "outcome": outcome})
        return int(value or 0)

    @property
    def pending(self) -> int:
        return self._pending

    def _next(self, waiting: list) -> Any:
        """The next queued item, or None when a waiting resend is due first (or the writer closes: _CLOSE)."""
        import queue

        timeout = None if not waiting else max(0.0, min(w[0] for w in waiting) - time.monotonic())
        try:
            return self._queue.get(timeout=timeout) if timeout != 0.0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        import queue

        waiting: list[list] = []  # [due (monotonic), given up at (monotonic), attempts, item]: failed events to resend
        while True:
            item = self._next(waiting)
            if item is _CLOSE:
                self._settle(["failed"] * len(waiting))  # closed during an outage: given up, counted
                return
            batch = [] if item is None else [[0.0, 0.0, 0, item]]
            if batch and self.linger_s > 0:
                time.sleep(self.linger_s)
            while batch and len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _CLOSE:
                    self._queue.put(_CLOSE)
                    break
                batch.append([0.0, 0.0, 0, item])
            now = time.monotonic()
            due = [w for w in waiting if w[0] <= now][: self.max_batch]
            taken = {id(w) for w in due}
            waiting = [w for w in waiting if id(w) not in taken]
            batch = due + batch
            if not batch:
                continue
            try:
                outcomes = self.writer.add_many([w[3] for w in batch])
            except Exception:  # a bug or an unexpected reply: still counted, never raised into scoring
                logger.exception("velocity write of %d events failed", len(batch))
                outcomes = ["failed"] * len(batch)
            final = []
            for w, outcome in zip(batch, outcomes):
                if outcome == "failed" and self.retry_s > 0 and not self._closed and (w[2] == 0 or now < w[1]):
                    w[1] = w[1] if w[2] else now + self.retry_s
                    w[0] = now + min(self.RETRY_BACKOFF_S * 2 ** w[2], 1.0)
                    w[2] += 1
                    waiting.append(w)
                else:  # a resend answered "duplicate": an earlier attempt had landed, its reply lost
                    final.append("added" if outcome == "duplicate" and w[2] else outcome)
            if len(final) < len(batch):
                self._count("retried", len(batch) - len(final))
            self._settle(final)

    def _settle(self, outcomes: list[str]) -> None:
        for outcome in set(outcomes):
            self._count(outcome, outcomes.count(outcome))
        with self._lock:
            self._pending -= len(outcomes)

    def submit(self, entity: Any, event: Mapping[str, Any], *, event_id: str | None = None, event_time: float | None = None) -> bool:
        """Queue one event (its time defaults to now, its id to a fresh one); False when dropped."""
        import uuid

        if self._pending >= self.max_pending or self._closed:
            self._count("dropped")
            return False
        with self._lock:
            self._pending += 1
        t = self.counters.clock() if event_time is None else event_time
        self._queue.put((entity_text(entity), event_id or uuid.uuid4().hex, {k: event[k] for k in self._sources}, t))
        return True

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (at most `timeout_s`) until every event submitted so far has an outcome."""
        import asyncio

        deadline = time.monotonic() + timeout_s
        while self._pending > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Drain (at most `timeout_s`), then stop: events still waiting to be resent are counted failed."""
        import asyncio

        deadline = time.monotonic() + timeout_s
        await self.drain(timeout_s)
        self._closed = True
        self._queue.put(_CLOSE)
        while self._thread.is_alive() and time.monotonic() < deadline + 1.0:
            await asyncio.sleep(0.002)


_CLOSE = object()  # AsyncVelocityWriter's queue: stop after what is queued


def read_windows(counters_by_view: Mapping[str, Any], views: Mapping[str, Any], wanted: Mapping[str, Sequence[Any]], out: dict) -> None:
    """Replace the windowed features of `out` (backends.Rows) by their sums, read with sync counters
    (the Feast readers' path: SQLite, or Redis when the direct reader is not used)."""
    for name, counters in counters_by_view.items():
        if name in out:
            now = counters.clock()
            view = views[name]
            out[name] = [overlay(view, row, counters.read(entity_text(e), now), now) for e, row in zip(wanted[name], out[name])]
