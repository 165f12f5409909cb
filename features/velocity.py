"""Exact, windowed velocity counters: atomic increments into time buckets, summed at read.

The read-modify-write of `push.CounterUpdate` (new value = value just fetched + this event) loses
an increment whenever two replicas score the same entity at once, and never forgets old events.
Here every event is one atomic write into the bucket of *its own* event time:

- Redis (production): a Lua script, up to ADD_BATCH events a call. Per event it first sets an
  idempotency marker for the event id (`SET NX EX`), and only if that marker is new adds the event
  to its bucket (`GETRANGE` the bucket's slot of each ring, `SETRANGE` it back with the event
  added). Redis runs a script atomically, so any number of writer processes add exactly once each,
  and a retry after a lost reply cannot double count (the marker is already there).
  Measured against an optimistic WATCH/MULTI transaction with retry and against the old
  read-modify-write (benchmarks/results/velocity_write_modes.md).
- SQLite (the embedded default, one process): `INSERT ... ON CONFLICT DO UPDATE SET v = v + ?`
  in one transaction, with the event id as a primary key for the same idempotency.

A window of `window_s` seconds at a resolution of `bucket_s` (stated per feature, in the Feast
definition's field tags) sums the last `window_s // bucket_s` buckets, the current one included,
so an event counts for between `window_s - bucket_s` and `window_s` seconds after its event time.
The fraud counters: 1 h at 5-minute buckets (12), 24 h at 1-hour buckets (24). A late or
out-of-order event lands in the bucket of its own time; one older than every window is reported
`expired` and not written. On Redis the buckets of one entity are a ring per resolution, each one
string key (see below), read as one MGET per entity, summed by the reader, sent in the fetch's own
pipeline.

Only additive features are supported (counts and sums); a distinct count (distinct cards) is not
additive across buckets and stays with the batch job.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Callable, Mapping, NamedTuple, Sequence

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


# The Redis layout: per entity and resolution one string key, `<prefix><view>:r<bucket_s>x<slots>:<entity>`,
# the resolution's ring of buckets as little-endian float64s, slot after slot, each slot (bucket
# start, then the sum of each feature kept at that resolution, in the spec's order), slot =
# (start / bucket_s) mod slots (the resolution's longest window over bucket_s). An add reads its
# slot with GETRANGE and writes it with SETRANGE: constant work whatever the ring's size, and the
# append-only file records one slot, not a ring. A slot never written (past the string's end, or
# zeros) is empty. An event whose bucket is newer than its slot's resets the slot; one older than
# its slot's bucket is more than a whole window old (out of every window it could count in) and is
# reported, not added. The slot count is in the key, so a changed window starts a new ring. A key's
# expiry is set its ring's window (plus a bucket) ahead whenever an event opens a new bucket in it:
# the newest bucket of a ring was opened no earlier than its own start, so the key outlives every
# window its data counts in. A read is one MGET of the entity's rings.
# Measured against the layout before it (one hash per entity, a field per feature and slot, ~100
# fields): the fetch's read of the windows 48 -> 8-14 us of the service's CPU (two values to unpack
# instead of ~200 fields to parse and match), and the writer's payload 344 -> 187 bytes an event.

# A batch of events in one script call (each event's outcome its own; the batch atomic as a whole).
# KEYS = per event: its marker, then its entity's ring keys (one per resolution). ARGV = the call's
# header, then per event its time (whole seconds: buckets are whole seconds, so floor(t) lands in
# the same bucket as t) and the value of each added event field. Header: dedup ttl, number of event
# fields, number of resolutions, then per resolution: slots, bucket_s, oldest bucket still in its
# longest window (by the writer's clock), the ring's ttl, n, then per feature of the ring what it
# adds (0: 1, a count; i: event field i). Returns per event 0 (a duplicate event id), 1 (added), 2
# (added, but too old for some window), 3 (too old for every window).
_ADD_SCRIPT = """
local ns, nr, a = tonumber(ARGV[2]), tonumber(ARGV[3]), 4
local rings, out = {}, {}
for r = 1, nr do
  local n = tonumber(ARGV[a + 4])
  local ring = {slots = tonumber(ARGV[a]), bs = tonumber(ARGV[a + 1]), oldest = tonumber(ARGV[a + 2]), ttl = ARGV[a + 3],
                n = n, record = 8 * (n + 1), fmt = '<' .. string.rep('d', n + 1), src = {}}
  for i = 1, n do ring.src[i] = tonumber(ARGV[a + 4 + i]) + 1 end
  rings[r] = ring
  a = a + 5 + n
end
for e = 1, #KEYS, nr + 1 do
  local t, d = tonumber(ARGV[a]), {1}
  for i = 1, ns do d[i + 1] = tonumber(ARGV[a + i]) end
  a = a + 1 + ns
  if not redis.call('SET', KEYS[e], 1, 'NX', 'EX', ARGV[1]) then
    out[#out + 1] = 0
  else
    local applied, skipped = 0, 0
    for k, ring in ipairs(rings) do
      local key = KEYS[e + k]
      local b = math.floor(t / ring.bs) * ring.bs
      local off = ((b / ring.bs) % ring.slots) * ring.record
      local bytes = redis.call('GETRANGE', key, off, off + ring.record - 1)
      local cur = 0
      if #bytes == ring.record then cur = struct.unpack('<d', bytes) end
      if b < ring.oldest or cur > b then
        skipped = skipped + 1
      else
        local slot = {b}
        if cur == b then
          local sums = {struct.unpack(ring.fmt, bytes)}
          for i = 1, ring.n do slot[i + 1] = sums[i + 1] + d[ring.src[i]] end
        else
          for i = 1, ring.n do slot[i + 1] = d[ring.src[i]] end
        end
        redis.call('SETRANGE', key, off, struct.pack(ring.fmt, unpack(slot)))
        if cur < b then redis.call('EXPIRE', key, ring.ttl) end
        applied = applied + 1
      end
    end
    if skipped == 0 then out[#out + 1] = 1 elseif applied > 0 then out[#out + 1] = 2 else out[#out + 1] = 3 end
  end
end
return out
"""

# Events per script call: a call holds Redis for its whole batch (~20 us an event with the
# append-only file on, measured on the 2-core host), so a read arriving behind it waits at most
# about this many events' work.
ADD_BATCH = 64
MAX_RING_FEATURES = 15  # the add script's struct formats go up to 16 float64s a slot
ADD_OUTCOMES = {0: "duplicate", 1: "added", 2: "added", 3: "expired"}


def outcomes_of(replies: Sequence[Sequence[int]]) -> list[str]:
    """Each event's outcome from the add script's replies (one list of codes per call)."""
    return [ADD_OUTCOMES[int(r)] for reply in replies for r in reply]


class _Ring(NamedTuple):
    """One resolution's ring, worked out once from the spec."""

    bucket_s: int
    slots: int
    prefix: str  # the ring's keys: prefix + entity
    size: int  # bytes of a whole ring (slots of 1 + n float64s)
    unpack: Callable[[bytes], tuple[float, ...]]
    stride: int  # float64s a slot: its bucket's start, then one per feature
    windows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (buckets a window spans, ((column in a slot, feature position), ...))
    call_args: tuple[int, ...]  # what an add call says of the ring after its oldest bucket: ttl, n, what each feature adds


class RedisVelocity:
    """Windowed counters in Redis (sync client; thread-safe through its connection pool).

    Writes are a Lua script, atomic on the server, ADD_BATCH events a call: an add is exact under
    any number of writer processes. A read is one MGET of the entity's rings, summed here.
    `<prefix><view>:seen:<event id>` marks a written event for `spec.dedup_s`.
    """

    def __init__(self, client, spec: VelocitySpec, *, prefix: str = "scorestack:velocity:", clock: Clock = time.time) -> None:
        self.client = client
        self.spec = spec
        self.prefix = f"{prefix}{spec.name}:"
        self.clock = clock
        self._add = client.register_script(_ADD_SCRIPT) if client is not None else None  # None: keys only
        self.add_sha = hashlib.sha1(_ADD_SCRIPT.encode()).hexdigest()
        # (host, port, connection parameters) where scorestack.features.resp implements the
        # connection (sync_counters sets it): AsyncVelocityWriter then writes from the event loop.
        self.lean: tuple[str, int, dict] | None = None
        self._fields = tuple(dict.fromkeys(f.source for f in spec.features if f.source is not None))  # the event fields added
        position = {f.name: i for i, f in enumerate(spec.features)}
        self._rings: list[_Ring] = []
        for bs, features in spec.resolutions.items():
            if len(features) > MAX_RING_FEATURES:
                raise FeatureError(f"{spec.name}: {len(features)} windowed features at {bs} s buckets; a ring holds up to "
                                   f"{MAX_RING_FEATURES}: give some of them another bucket_s")
            slots, stride = spec.longest_s(bs) // bs, 1 + len(features)
            windows: dict[int, list[tuple[int, int]]] = {}
            for j, f in enumerate(features):
                windows.setdefault(f.window_s // bs, []).append((1 + j, position[f.name]))
            adds = [0 if f.source is None else 1 + self._fields.index(f.source) for f in features]
            self._rings.append(_Ring(bs, slots, f"{self.prefix}r{bs}x{slots}:", 8 * slots * stride, struct.Struct(f"<{slots * stride}d").unpack,
                                     stride, tuple((n, tuple(cols)) for n, cols in windows.items()), (slots * bs + bs, len(features), *adds)))
        self._ring_prefixes = [ring.prefix.encode() for ring in self._rings]
        self._mget = b"*%d\r\n$4\r\nMGET\r\n" % (1 + len(self._rings))
        # (bucket_s, buckets, current bucket) -> "is a slot's start in that window" (a frozenset's membership test),
        # kept across reads within a bucket: the fraud counters' read 9.4 us with it, 16.7 us building the sets each
        # read (a recorded reply summed 20,000 times, best of 5).
        self._inside: dict[tuple[int, int, int], Callable[[float], bool]] = {}

    def keys(self, entity: Any) -> list[str]:
        """`entity`'s ring keys, one per resolution."""
        return [ring.prefix + str(entity) for ring in self._rings]

    def add_call(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]], now: float) -> tuple[list, list]:
        """The add script's keys and arguments for a batch of (entity, event id, event, event time) at `now`."""
        args: list[Any] = [self.spec.dedup_s, len(self._fields), len(self._rings)]
        for ring in self._rings:
            args += (ring.slots, ring.bucket_s, self.spec.bucket(now, ring.bucket_s) - (ring.slots - 1) * ring.bucket_s, *ring.call_args)
        keys: list[str] = []
        seen, fields = f"{self.prefix}seen:", self._fields
        for entity, event_id, event, event_time in items:
            keys.append(seen + event_id)
            keys += self.keys(entity)
            args.append(math.floor(now if event_time is None else event_time))
            args += [repr(float(event[f])) for f in fields]
        return keys, args

    def add(self, entity: Any, event_id: str, event: Mapping[str, Any], event_time: float | None = None) -> str:
        """Add one event to the bucket of its own time; its outcome: added, duplicate (this event id
        was already added) or expired (older than every window it counts in).

        Raises the client's error when Redis cannot be reached: the caller counts it as failed
        (and may retry with the same `event_id`: it is never added twice).
        """
        return self.add_many([(entity, event_id, event, event_time)])[0]

    def add_many(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]]) -> list[str]:
        """Several adds in one round trip, ADD_BATCH events per script call (each event added at most
        once, whatever else its batch holds)."""
        calls = self.add_calls(items)
        if len(calls) == 1:
            replies = [self._add(keys=calls[0][0], args=calls[0][1])]
        else:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                self._add(keys=keys, args=args, client=pipe)
            replies = pipe.execute()
        return outcomes_of(replies)

    def add_calls(self, items: Sequence[tuple[Any, str, Mapping[str, Any], float | None]]) -> list[tuple[list, list]]:
        """The add script's (keys, arguments) for `items`, ADD_BATCH events a call, all at this clock's now."""
        now = self.clock()
        return [self.add_call(items[i : i + ADD_BATCH], now) for i in range(0, len(items), ADD_BATCH)]

    def read_command(self, entity: Any) -> bytes:
        """The read of `entity`'s counters as one packed command (for a pipeline; `sums_from` its reply)."""
        e = str(entity).encode()
        return self._mget + b"".join([b"$%d\r\n%s%s\r\n" % (len(k) + len(e), k, e) for k in self._ring_prefixes])

    def sums_from(self, reply: Sequence[bytes | None], now: float) -> dict[str, float]:
        """Each feature's window sum at `now` from the read's reply (MGET's value per ring, None for a
        ring never written): the sums of the slots whose bucket lies in the feature's window."""
        features = self.spec.features
        totals = [0.0] * len(features)
        for ring, value in zip(self._rings, reply):
            if not value:
                continue
            if len(value) < ring.size:  # slots past the last one written: empty
                value = value + bytes(ring.size - len(value))
            values = ring.unpack(value)
            bucket_s, stride = ring.bucket_s, ring.stride
            starts = values[::stride]
            current = self.spec.bucket(now, bucket_s)
            for n, columns in ring.windows:
                # A slot counts when its bucket is one of the window's n: the test runs in C (a set's
                # membership over the slots' starts, then a compress of each feature's column).
                key = (bucket_s, n, current)
                inside = self._inside.get(key)
                if inside is None:
                    if len(self._inside) > 64:
                        self._inside.clear()
                    inside = self._inside[key] = frozenset(float(current - i * bucket_s) for i in range(n)).__contains__
                mask = list(map(inside, starts))
                for c, k in columns:
                    totals[k] = sum(compress(values[c::stride], mask))
        return {f.name: total for f, total in zip(features, totals)}

    def read(self, entity: Any, now: float | None = None) -> dict[str, float]:
        """Every feature's window sum for `entity`, in one round trip."""
        now = self.clock() if now is None else now
        return self.sums_from(self.client.mget(self.keys(entity)), now)


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
    `window_source`: the event field added, empty for a count; the view's tag `dedup_s`: how long
    an event id is remembered, default VelocitySpec's); None when it declares none."""
    features = []
    for f in view.features:
        tags = f.tags or {}
        if "window_s" in tags:
            try:
                features.append(WindowedFeature(f.name, int(tags["window_s"]), tags.get("window_source") or None, int(tags.get("bucket_s", 60))))
            except ValueError as exc:
                raise FeatureError(f"view {view.name!r}, feature {f.name!r}: window tags {tags}: {exc}") from None
    if not features:
        return None
    raw = (view.tags or {}).get("dedup_s")
    if raw is None:
        return VelocitySpec(view.name, tuple(features))
    try:
        dedup_s = int(raw)
    except ValueError:
        dedup_s = 0
    if dedup_s < 1:
        raise FeatureError(f"view {view.name!r}: tag dedup_s={raw!r}; give the whole seconds an event id is remembered (at least 1; default {VelocitySpec.dedup_s})")
    return VelocitySpec(view.name, tuple(features), dedup_s=dedup_s)


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

        from scorestack.features.resp import lean_params

        nodes, params = RedisOnlineStore._parse_connection_string(config.online_store.connection_string)
        params.pop("retry", None)
        params.setdefault("socket_timeout", 1.0)
        params.setdefault("socket_connect_timeout", 1.0)
        # The writer retries once itself (with the same event ids); redis-py's own retries would
        # only hold the writer thread during an outage.
        client = redis.Redis(host=nodes[0]["host"], port=int(nodes[0]["port"]), retry=Retry(NoBackoff(), 0), **params)
        counters = RedisVelocity(client, spec, prefix=redis_prefix(config.project), clock=clock)
        lean = {k: v for k, v in params.items() if k not in ("socket_timeout",)}
        if lean_params(lean) is None:
            counters.lean = (nodes[0]["host"], int(nodes[0]["port"]), lean)
        return counters
    raise FeatureError(f"windowed counters: online store {kind!r} unsupported (sqlite, redis)")


class AsyncVelocityWriter:
    """The fraud path's write-back, on the event loop: `submit` returns at once (a queue append); one
    task takes whatever has queued (after `linger_s`, so a burst makes one batch) and adds it in one
    round trip, ADD_BATCH events a script call (each event added at most once). On Redis the batch
    goes on a connection of its own (scorestack.features.resp: pre-packed commands, replies parsed
    by hiredis), so the loop never waits on the store and no thread contends with it for the
    interpreter lock (a writer thread did: under 16 callers it cost the service half its rate).
    SQLite, and a Redis connection the lean one does not implement (TLS), go through a thread.

    Every outcome is counted in `scorestack_velocity_writes_total{view, outcome}`: added, duplicate
    (an event id already added), expired (older than every window), failed (the store unreachable
    for `retry_s`), dropped (more than `max_pending` waiting). Nothing is lost silently.

    A batch the store did not take (unreachable, or no reply within `timeout_s`) is sent again at
    once with the same ids; an event still not taken is kept and resent, with its id and its own
    event time, every RETRY_BACKOFF_S (doubling to 1 s) for up to `retry_s` seconds (default 30; 0
    gives up at once): a Redis restart or failover shorter than that loses no count, and the ids make
    a resend that had landed after all count once ("duplicate" answered to a resend counts as added).
    Each resend is counted as `retried` (not an outcome: every event still ends in exactly one of the
    five above). A waiting event counts as pending, so a long outage fills `max_pending` and then
    drops, counted.
    """

    RETRY_BACKOFF_S = 0.05

    def __init__(self, counters, *, max_pending: int = 4096, max_batch: int = 256, linger_s: float = 0.010, retry_s: float = 30.0,
                 timeout_s: float = 1.0, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter

        from scorestack.features.metrics import in_process_values

        if not retry_s >= 0:
            raise ValueError(f"retry_s: {retry_s!r}; give the seconds a failed write is retried (0: none)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: {timeout_s!r}; give the seconds a write may wait for the store's reply")
        self.counters = counters
        self.writer = VelocityWriter(counters)  # the thread path's
        self.max_pending = max_pending
        self.max_batch = max_batch
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        # After the first event, wait this long for more: one script call per batch, not per event.
        # Redis's cost is mostly per call (about 90 us a call at one request at a time on the 2-core
        # host, ~20 us an event in a batch of 40), so at low rates a longer linger is the cheaper
        # write; an event then reaches the counters up to linger_s (and a round trip) after submit.
        self.linger_s = linger_s
        self.registry = registry if registry is not None else CollectorRegistry()
        with in_process_values():
            writes = Counter(
                "scorestack_velocity_writes_total",
                "Events added to windowed velocity counters, by outcome (added, duplicate, expired, failed, dropped; retried counts resends).",
                ["view", "outcome"],
                registry=self.registry,
            )
            self._writes = {o: writes.labels(counters.spec.name, o) for o in ("added", "duplicate", "expired", "failed", "dropped", "retried")}
        self._sources = tuple(dict.fromkeys(f.source for f in counters.spec.features if f.source is not None))
        self._queue: deque = deque()
        self._waiting: list[list] = []  # [due (monotonic), given up at (monotonic), attempts, item]: failed events to resend
        self._pending = 0
        self._closed = False
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        # Fresh event ids: this writer's random prefix and a counter (uuid4 per event read the OS's
        # random source each time).
        self._ids = f"{uuid.uuid4().hex[:16]}-"
        self._next_id = itertools.count()
        lean = getattr(counters, "lean", None)
        self._resp = None
        if lean is not None:
            from scorestack.features.resp import RespConnection

            host, port, params = lean
            self._resp = RespConnection(host, port, **params)

    @property
    def path(self) -> str:
        """How batches reach the store: "loop" (a connection of the event loop's own) or "thread"."""
        return "loop" if self._resp is not None else "thread"

    @classmethod
    def for_store(cls, store, view: str = "user_txn_velocity", **options: Any) -> "AsyncVelocityWriter":
        spec = spec_from_view(store.get_feature_view(view))
        if spec is None:
            raise FeatureError(f"view {view!r} declares no windowed features (field tags window_s, bucket_s)")
        return cls(sync_counters(store, spec), **options)

    def count(self, outcome: str) -> int:
        value = self.registry.get_sample_value("scorestack_velocity_writes_total", {"view": self.counters.spec.name, "outcome": outcome})
        return int(value or 0)

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, entity: Any, event: Mapping[str, Any], *, event_id: str | None = None, event_time: float | None = None) -> bool:
        """Queue one event (its time defaults to now, its id to a fresh one); False when dropped.
        Call it from the event loop the writer runs on (its task starts on the first event)."""
        if self._pending >= self.max_pending or self._closed:
            self._writes["dropped"].inc()
            return False
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="scorestack-velocity")
        self._pending += 1
        t = self.counters.clock() if event_time is None else event_time
        self._queue.append((entity_text(entity), event_id or f"{self._ids}{next(self._next_id):x}", {k: event[k] for k in self._sources}, t))
        if len(self._queue) == 1:
            self._wake.set()
        return True

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            if not self._queue and not self._closed:
                due_at = min((w[0] for w in self._waiting), default=None)
                if due_at is None or due_at > now:
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(None if due_at is None else due_at - now):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                    if self._queue and self.linger_s > 0 and not self._closed:
                        self._wake.clear()
                        try:  # linger for more events (close() cuts it short)
                            async with asyncio.timeout(self.linger_s):
                                await self._wake.wait()
                        except TimeoutError:
                            pass
            now = time.monotonic()
            due = [w for w in self._waiting if w[0] <= now][: self.max_batch]
            if due:
                taken = {id(w) for w in due}
                self._waiting = [w for w in self._waiting if id(w) not in taken]
            batch = due + [[0.0, 0.0, 0, self._queue.popleft()] for _ in range(min(len(self._queue), self.max_batch - len(due)))]
            if not batch:
                if self._closed:
                    self._settle(["failed"] * len(self._waiting))  # closed during an outage: given up, counted
                    self._waiting = []
                    return
                continue
            try:
                outcomes = await self._add(batch)
            except Exception:  # a bug or an unexpected reply: still counted, never raised into scoring
                logger.exception("velocity write of %d events failed", len(batch))
                outcomes = ["failed"] * len(batch)
            now = time.monotonic()
            final = []
            for w, outcome in zip(batch, outcomes):
                if outcome == "failed" and self.retry_s > 0 and not self._closed and (w[2] == 0 or now < w[1]):
                    w[1] = w[1] if w[2] else now + self.retry_s
                    w[0] = now + min(self.RETRY_BACKOFF_S * 2 ** w[2], 1.0)
                    w[2] += 1
                    self._waiting.append(w)
                else:  # a resend answered "duplicate": an earlier attempt had landed, its reply lost
                    final.append("added" if outcome == "duplicate" and w[2] else outcome)
            if len(final) < len(batch):
                self._writes["retried"].inc(len(batch) - len(final))
            self._settle(final)

    async def _add(self, batch: list[list]) -> list[str]:
        items = [w[3] for w in batch]
        if self._resp is None:
            return await asyncio.to_thread(self.writer.add_many, items)  # retries once itself
        try:
            return await self._send(items)
        except Exception:  # unreachable, or no reply in time: once more at once (the ids make it safe)
            try:
                return ["added" if o == "duplicate" else o for o in await self._send(items)]
            except Exception:
                return ["failed"] * len(items)

    async def _send(self, items: list) -> list[str]:
        """One round trip to Redis: the batch's script calls, pre-packed (loading the script first
        where Redis does not know it: a restarted server)."""
        import hiredis

        sha = self.counters.add_sha
        calls = [hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args)) for keys, args in self.counters.add_calls(items)]
        async with asyncio.timeout(self.timeout_s):
            replies = await self._resp.request(b"".join(calls), len(calls))
            if any(isinstance(r, Exception) and "NOSCRIPT" in str(r) for r in replies):
                load = hiredis.pack_command(("SCRIPT", "LOAD", _ADD_SCRIPT))
                replies = (await self._resp.request(load + b"".join(calls), len(calls) + 1))[1:]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return outcomes_of(replies)

    def _settle(self, outcomes: list[str]) -> None:
        for outcome in set(outcomes):
            self._writes[outcome].inc(outcomes.count(outcome))
        self._pending -= len(outcomes)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (at most `timeout_s`) until every event submitted so far has an outcome."""
        deadline = time.monotonic() + timeout_s
        while self._pending > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Drain (at most `timeout_s`), then stop: events still waiting to be resent are counted failed."""
        await self.drain(timeout_s)
        self._closed = True
        if self._task is not None:
            self._wake.set()
            try:
                async with asyncio.timeout(max(0.0, timeout_s) + 1.0):
                    await self._task
            except TimeoutError:
                self._task.cancel()
        if self._resp is not None:
            await self._resp.close()


def read_windows(counters_by_view: Mapping[str, Any], views: Mapping[str, Any], wanted: Mapping[str, Sequence[Any]], out: dict) -> None:
    """Replace the windowed features of `out` (backends.Rows) by their sums, read with sync counters
    (the Feast readers' path: SQLite, or Redis when the direct reader is not used)."""
    for name, counters in counters_by_view.items():
        if name in out:
            now = counters.clock()
            view = views[name]
            out[name] = [overlay(view, row, counters.read(entity_text(e), now), now) for e, row in zip(wanted[name], out[name])]
