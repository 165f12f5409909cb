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
        self._add = client.register_script(_ADD_SCRIPT)

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

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> bool:
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

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
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
