"""Store readers behind the fetch layer: Feast async (Redis), Feast sync in a thread (SQLite), direct Redis.

Each reader answers one question in one store round trip: for these views and entity ids, the
stored rows (values, found mask, event time) or None where the entity has no row. Timeouts,
retries and fallbacks are the fetch layer's job, not the readers'.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
    import feast

    from scorestack.features.velocity import VelocitySpec


@dataclass(frozen=True)
class ViewSpec:
    """One feature view as the fetch layer reads it (built from the applied Feast registry).

    `features` are only those some served feature service projects (or one of its on-demand views
    reads): a view may hold Map, Json or String fields that no model input needs, and those are
    never read or converted.
    """

    name: str
    join_keys: tuple[str, ...]  # the view's entity columns; several for a compound key
    key_types: tuple[str, ...]  # Feast type of each join key: Int64, Int32 or String
    features: tuple[str, ...]
    types: tuple[str, ...]  # Feast type of each feature (all numeric)
    defaults: np.ndarray  # float32, one per feature
    ttl_s: float  # 0: never stale
    cache_ttl_s: float  # 0: never cached
    # Non-numeric features an on-demand view reads (Map, Json, String, ...): read as the Python
    # values Feast would hand the transformation, never converted to numbers.
    raw_features: tuple[str, ...] = ()
    # The view's windowed counters (Feast field tags window_s/bucket_s), read as bucket sums by a
    # fetcher built with windows=True (scorestack.features.velocity); None: none declared.
    windows: "VelocitySpec | None" = None

    def entities(self, columns: Mapping[str, Sequence]) -> list:
        """Per row, the entity of this view: the key's value, or a tuple of values for a compound key."""
        if len(self.join_keys) == 1:
            return list(columns[self.join_keys[0]])
        return list(zip(*(columns[k] for k in self.join_keys)))

    def probe_entity(self):
        """Some valid entity of this view's key types (for a warm-up read)."""
        values = tuple("" if t == "String" else 0 for t in self.key_types)
        return values[0] if len(values) == 1 else values


class Row(NamedTuple):
    """One entity's stored values for one view."""

    values: np.ndarray  # float64 [n_features] (int64 counts stay exact up to 2**53 for transformations)
    found: np.ndarray  # bool [n_features]
    event_ts: float  # epoch seconds; NaN when unknown
    raw: tuple = ()  # Python values of the view's raw_features (None where absent)


Entity = Hashable  # a join-key value, or a tuple of them for a compound key
Wanted = Mapping[str, Sequence[Entity]]  # view name -> unique entities
Rows = dict[str, list["Row | None"]]  # view name -> rows aligned with the entities asked


class Backend:
    """A store reader. `read` is one round trip; it may raise (the fetch layer turns that into defaults).

    `windows`: view -> the counters (scorestack.features.velocity) whose window sums replace the
    view's windowed features in every read; empty (the default) reads views as Feast stores them.
    """

    windows: dict = {}

    name = "backend"

    def __init__(self, views: Mapping[str, ViewSpec]) -> None:
        self.views = dict(views)
        self.round_trips = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def read(self, wanted: Wanted) -> Rows:
        raise NotImplementedError


# --- Feast SDK ------------------------------------------------------------------------------------


class _FeastCall(NamedTuple):
    refs: list[str]
    columns: dict[str, list]  # join key -> values, equal lengths (Feast's columnar entity rows)
    position: dict[str, dict]  # view -> entity -> index in the columns


def _feast_calls(views: Mapping[str, ViewSpec], wanted: Wanted) -> list[_FeastCall]:
    """Feature refs and columnar entity rows for as few Feast calls as cover every view asked.

    Views of the same join keys share their entity list. Views keyed by disjoint join keys (user,
    item) go into one call: their different numbers of entities are padded by repeating the last,
    which Feast de-duplicates per view. Views whose keys overlap without being equal (user, and
    user + merchant) cannot share rows and get a call of their own.
    """
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in wanted:
        groups.setdefault(views[name].join_keys, []).append(name)
    buckets: list[list[tuple[str, ...]]] = []
    for keys in groups:
        for bucket in buckets:
            if not any(set(keys) & set(other) for other in bucket):
                bucket.append(keys)
                break
        else:
            buckets.append([keys])
    calls = []
    for bucket in buckets:
        refs: list[str] = []
        position: dict[str, dict] = {}
        entity_lists = {}
        for keys in bucket:
            entities = list(dict.fromkeys(e for v in groups[keys] for e in wanted[v]))
            index = {e: i for i, e in enumerate(entities)}
            for v in groups[keys]:
                refs += [f"{v}:{f}" for f in views[v].features + views[v].raw_features]
                position[v] = index
            entity_lists[keys] = entities
        length = max(len(e) for e in entity_lists.values())
        columns: dict[str, list] = {}
        for keys, entities in entity_lists.items():
            entities = entities + [entities[-1]] * (length - len(entities))
            if len(keys) == 1:
                columns[keys[0]] = entities
            else:
                for j, key in enumerate(keys):
                    columns[key] = [e[j] for e in entities]
        calls.append(_FeastCall(refs, columns, position))
    return calls


_NUMERIC_KINDS = frozenset(("float_val", "double_val", "int32_val", "int64_val", "bool_val"))


def _parse_feast_response(views: Mapping[str, ViewSpec], wanted: Wanted, call: _FeastCall, response, out: Rows) -> None:
    """Rows of the views of one call, from Feast's response protobuf (only the features asked)."""
    from feast.protos.feast.serving.ServingService_pb2 import FieldStatus
    from feast.type_map import feast_value_type_to_python_type

    proto = response.proto
    index = {name: i for i, name in enumerate(proto.metadata.feature_names.val)}
    present = (FieldStatus.PRESENT, FieldStatus.OUTSIDE_MAX_AGE)
    for name, position in call.position.items():
        spec = views[name]
        results = [proto.results[index[f"{name}__{f}"]] for f in spec.features]
        raw_results = [proto.results[index[f"{name}__{f}"]] for f in spec.raw_features]
        rows: list[Row | None] = []
        for entity in wanted[name]:
            i = position[entity]
            values = np.zeros(len(results), dtype=np.float64)
            found = np.zeros(len(results), dtype=bool)
            event_ts = math.nan
            for j, result in enumerate(results):
                if result.statuses[i] in present:
                    value = result.values[i]
                    kind = value.WhichOneof("val")
                    if kind in _NUMERIC_KINDS:
                        values[j] = getattr(value, kind)
                        found[j] = True
                    ts = result.event_timestamps[i]
                    if ts.seconds or ts.nanos:
                        event_ts = ts.seconds + ts.nanos * 1e-9
            raw = tuple(
                feast_value_type_to_python_type(r.values[i]) if r.statuses[i] in present else None for r in raw_results
            )
            exists = found.any() or any(v is not None for v in raw)
            rows.append(Row(values, found, event_ts, raw) if exists else None)
        out[name] = rows


class FeastAsyncBackend(Backend):
    """Feast's `get_online_features_async` (Redis, DynamoDB, MongoDB online stores)."""

    name = "feast_async"

    def __init__(self, views: Mapping[str, ViewSpec], store: "feast.FeatureStore") -> None:
        super().__init__(views)
        self.store = store

    async def start(self) -> None:
        await self.store.initialize()

    async def close(self) -> None:
        await self.store.close()
        # Feast 0.67's Redis store caches its asyncio client on the store object and never closes
        # it; that client is bound to this event loop, so drop it here.
        online = getattr(self.store._get_provider(), "online_store", None)
        client = getattr(online, "_client_async", None)
        if client is not None:
            online._client_async = None
            try:
                await client.aclose()
            except Exception:  # closing a broken connection must not fail shutdown
                pass

    async def read(self, wanted: Wanted) -> Rows:
        self.round_trips += 1
        calls = _feast_calls(self.views, wanted)
        responses = await asyncio.gather(
            *(self.store.get_online_features_async(features=c.refs, entity_rows=c.columns, full_feature_names=True) for c in calls)
        )
        out: Rows = {}
        for call, response in zip(calls, responses):
            _parse_feast_response(self.views, wanted, call, response, out)
        if self.windows:
            from scorestack.features.velocity import read_windows

            # A second round trip (in a thread): the direct reader reads the windows in its own one.
            await asyncio.to_thread(read_windows, self.windows, self.views, wanted, out)
        return out


class FeastThreadBackend(Backend):
    """Feast's synchronous `get_online_features` in a worker thread (SQLite has no async reads)."""

    name = "feast_sync"

    def __init__(self, views: Mapping[str, ViewSpec], store: "feast.FeatureStore", max_workers: int = 4) -> None:
        super().__init__(views)
        self.store = store
        self._max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="scorestack-features")

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _read_sync(self, wanted: Wanted) -> Rows:
        out: Rows = {}
        for call in _feast_calls(self.views, wanted):
            response = self.store.get_online_features(features=call.refs, entity_rows=call.columns, full_feature_names=True)
            _parse_feast_response(self.views, wanted, call, response, out)
        if self.windows:
            from scorestack.features.velocity import read_windows

            read_windows(self.windows, self.views, wanted, out)
        return out

    async def read(self, wanted: Wanted) -> Rows:
        if self._executor is None:
            raise RuntimeError("feast_sync backend used before start()")
        self.round_trips += 1
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._read_sync, dict(wanted))


# --- Direct Redis ---------------------------------------------------------------------------------


class DirectRedisBackend(Backend):
    """Reads Feast's Redis hashes with one pipelined HMGET per entity (all its views at once)."""

    name = "direct"

    def __init__(
        self,
        views: Mapping[str, ViewSpec],
        *,
        connection_string: str,
        project: str,
        entity_key_serialization_version: int = 3,
    ) -> None:
        from scorestack.features import redis_layout

        super().__init__(views)
        self._connection_string = connection_string
        self._client = None
        self._resp = None  # the lean connection for reads (scorestack.features.resp), when it applies
        self.lean_reason: str | None = None
        self._encoders = {
            spec.join_keys: redis_layout.entity_key_encoder(spec.join_keys, spec.key_types, project, entity_key_serialization_version)
            for spec in self.views.values()
        }
        self._fields = {name: [redis_layout.field_key(name, f) for f in spec.features] for name, spec in self.views.items()}
        self._raw_fields = {name: [redis_layout.field_key(name, f) for f in spec.raw_features] for name, spec in self.views.items()}
        self._ts_fields = {name: redis_layout.ts_key(name) for name in self.views}
        self._packed: dict[tuple[str, ...], tuple[bytes, bytes]] = {}

    async def start(self) -> None:
        from feast.infra.online_stores.redis import RedisOnlineStore
        from redis import asyncio as redis_asyncio
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from scorestack.features.resp import RespConnection, lean_params

        nodes, params = RedisOnlineStore._parse_connection_string(self._connection_string)
        params.pop("retry", None)
        params.pop("retry_on_timeout", None)
        # No socket_timeout: the fetch layer's budget cancels a read (and the connection is dropped);
        # a per-reply timeout would cost an asyncio timeout context per HMGET reply.
        params.pop("socket_timeout", None)
        host, port = nodes[0]["host"], int(nodes[0]["port"])
        # Reads go through the lean connection (scorestack.features.resp) where it implements every
        # connection parameter; redis-py stays for the rest (verification's scans, other parameters).
        self.lean_reason = lean_params(params)
        if self.lean_reason is None:
            self._resp = RespConnection(host, port, **params)
        self._client = redis_asyncio.Redis(
            host=host,
            port=port,
            retry=Retry(NoBackoff(), 0),  # the fetch layer's budget and breaker decide, not redis-py
            **params,
        )

    @property
    def client(self):
        """The redis.asyncio client (after `start`)."""
        if self._client is None:
            raise RuntimeError("direct backend used before start()")
        return self._client

    async def close(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            await resp.close()
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.aclose()
            except Exception:  # closing a broken connection must not fail shutdown
                pass

    def _packed_fields(self, views: tuple[str, ...]) -> tuple[bytes, bytes]:
        """RESP framing of `HMGET <key> <fields...>` around the key, packed once per set of views
        (`scorestack.features.resp.bulk` frames each field).

        redis-py packs every argument of every command on each call; for 100 items x 25 fields that
        was over half the read's time.
        """
        packed = self._packed.get(views)
        if packed is None:
            from scorestack.features.resp import bulk

            # Numbers first (decoded in one vectorized pass), then raw values, then timestamps.
            fields = [f for v in views for f in self._fields[v]] + [f for v in views for f in self._raw_fields[v]]
            fields += [self._ts_fields[v] for v in views]
            head = b"*%d\r\n$5\r\nHMGET\r\n" % (len(fields) + 2)
            tail = b"\r\n" + b"".join(bulk(f) for f in fields)
            packed = self._packed[views] = (head, tail)
        return packed

    async def _pipeline(self, packed: bytes, n_replies: int) -> list:
        """Send pre-packed commands and read their replies (one round trip)."""
        if self._resp is not None:
            replies = await self._resp.request(packed, n_replies)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(packed, check_health=False)
            return [await connection.read_response() for _ in range(n_replies)]
        except BaseException:
            # Unread replies would answer the next caller's commands: drop the connection.
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)

    async def read(self, wanted: Wanted) -> Rows:
        from scorestack.features.redis_layout import decode_python, decode_timestamp, decode_values

        if self._client is None:
            raise RuntimeError("direct backend used before start()")
        self.round_trips += 1
        # Group the views by entity key: Feast keeps every view of one entity key in one hash, so
        # one HMGET per entity reads every view asked of it.
        groups: dict[tuple[str, ...], tuple[list[str], dict[Entity, None]]] = {}
        for name, ids in wanted.items():
            views, entity_ids = groups.setdefault(self.views[name].join_keys, ([], {}))
            views.append(name)
            entity_ids.update(dict.fromkeys(ids))
        plan = []
        commands: list[bytes] = []
        for join_key, (views, entity_ids) in groups.items():
            head, tail = self._packed_fields(tuple(views))
            encode = self._encoders[join_key]
            for entity in entity_ids:
                key = encode(entity)
                commands += (head, b"$%d\r\n" % len(key), key, tail)
            plan.append((views, list(entity_ids)))
        n_rows = sum(len(ids) for _, ids in plan)
        windowed = []
        if self.windows:
            # The windows: one MGET of each entity's bucket rings in the same pipeline, the same
            # round trip; the sums are made here (a Lua read script cost Redis ~88 us a call).
            from scorestack.features.velocity import entity_text

            now = time.time()
            for name, ids in wanted.items():
                counters = self.windows.get(name)
                if counters is not None:
                    for entity in ids:
                        commands.append(counters.read_command(entity_text(entity)))
                        windowed.append((name, entity, counters))
        packed = b"".join(commands)
        replies = await self._pipeline(packed, n_rows + len(windowed))

        out: Rows = {}
        offset = 0
        for views, entity_ids in plan:
            n = len(entity_ids)
            block = replies[offset : offset + n]
            offset += n
            n_values = sum(len(self.views[v].features) for v in views)
            n_raw = sum(len(self.views[v].raw_features) for v in views)
            values, found = decode_values([cell for reply in block for cell in reply[:n_values]])
            values = values.reshape(n, n_values)
            found = found.reshape(n, n_values)
            column = raw_column = 0
            for k, name in enumerate(views):
                spec = self.views[name]
                width, raw_width = len(spec.features), len(spec.raw_features)
                view_values = values[:, column : column + width]
                view_found = found[:, column : column + width]
                raw = [
                    tuple(decode_python(c) for c in reply[n_values + raw_column : n_values + raw_column + raw_width]) for reply in block
                ] if raw_width else [()] * n
                exists = view_found.any(axis=1)
                if raw_width:
                    exists |= np.array([any(v is not None for v in r) for r in raw], dtype=bool)
                exists = exists.tolist()
                ts_index = n_values + n_raw + k
                rows_by_id: dict[Entity, Row | None] = {
                    entity: Row(view_values[r], view_found[r], decode_timestamp(block[r][ts_index]), raw[r]) if exists[r] else None
                    for r, entity in enumerate(entity_ids)
                }
                out[name] = [rows_by_id[i] for i in wanted[name]]
                column += width
                raw_column += raw_width
        if windowed:
            from scorestack.features.velocity import overlay

            sums: dict[tuple[str, Entity], dict[str, float]] = {}
            for (name, entity, counters), reply in zip(windowed, replies[n_rows:]):
                sums[(name, entity)] = counters.sums_from(reply, now)
            for name in {name for name, *_ in windowed}:
                view = self.views[name]
                out[name] = [overlay(view, row, sums[(name, e)], now) for e, row in zip(wanted[name], out[name])]
        return out
