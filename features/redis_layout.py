"""Feast's Redis online-store layout, for reading its hashes directly.

One hash per entity key: Feast's entity-key serialization (v3) followed by the project name. Field
`murmur3("<view>:<feature>")` (4 bytes, little endian) holds a serialized `feast.types.Value`;
field `_ts:<view>` a serialized `google.protobuf.Timestamp`. Feast has no public fast-read API, so
tests check every function here against Feast's own reads (tests/test_features_direct.py).
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import mmh3
import numpy as np
from feast.infra.key_encoding_utils import serialize_entity_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from feast.protos.feast.types.Value_pb2 import ValueType
from google.protobuf.timestamp_pb2 import Timestamp

# A Float32 feature serializes as one tag byte + 4 little-endian bytes; read those without protobuf.
_FLOAT_VALUE = ValueProto(float_val=1.0).SerializeToString()
_FLOAT_TAG = _FLOAT_VALUE[0]
_FLOAT_LEN = len(_FLOAT_VALUE)
assert _FLOAT_LEN == 5, "feast.types.Value float_val is expected to serialize to 5 bytes"
_ABSENT = bytes(_FLOAT_LEN)  # tag 0 is never a valid protobuf tag: marks "no value"
_TAG_BYTE = bytes([_FLOAT_TAG])
_FLOAT_CELL = np.dtype([("tag", "u1"), ("value", "<f4")])  # one serialized float Value: its tag, then the float


class Int64KeyEncoder:
    """Encodes an int64 join-key value to its Redis key, as Feast's `_redis_key` would.

    The serialized prefix comes from Feast's own `serialize_entity_key`; only the 8-byte value is
    packed here, which is ~10x cheaper than building an EntityKey protobuf per entity.
    """

    def __init__(self, join_key: str, project: str, entity_key_serialization_version: int = 3) -> None:
        if entity_key_serialization_version != 3:
            raise ValueError(f"entity_key_serialization_version {entity_key_serialization_version} unsupported (need 3)")
        probe = serialize_entity_key(
            EntityKeyProto(join_keys=[join_key], entity_values=[ValueProto(int64_val=0)]),
            entity_key_serialization_version=3,
        )
        self._prefix = probe[:-8]
        self._suffix = project.encode("utf-8")
        self._pack = struct.Struct("<q").pack

    def __call__(self, value: int) -> bytes:
        return self._prefix + self._pack(value) + self._suffix


class EntityKeyEncoder:
    """Encodes any entity key (Int64, Int32 or String join keys, one or several) as Feast's `_redis_key`.

    Feast v3: the number of keys, then per key (sorted by name) its type, length and name, then per
    value its type, length and bytes, then the project. The key-name header is packed once.
    """

    _PACKERS = {
        "Int64": (ValueType.INT64, struct.Struct("<q").pack),
        "Int32": (ValueType.INT32, struct.Struct("<i").pack),
    }

    def __init__(self, join_keys: Sequence[str], key_types: Sequence[str], project: str, entity_key_serialization_version: int = 3) -> None:
        if entity_key_serialization_version != 3:
            raise ValueError(f"entity_key_serialization_version {entity_key_serialization_version} unsupported (need 3)")
        if len(join_keys) != len(key_types) or not join_keys:
            raise ValueError(f"join keys {join_keys} and types {key_types} do not match")
        for key_type in key_types:
            if key_type not in ("Int64", "Int32", "String"):
                raise ValueError(f"join key type {key_type} unsupported (Int64, Int32, String)")
        self._order = sorted(range(len(join_keys)), key=lambda i: join_keys[i])
        self._types = tuple(key_types)
        pack_u32 = struct.Struct("<I").pack
        header = [pack_u32(len(join_keys))]
        for i in self._order:
            name = join_keys[i].encode("utf-8")
            header += [pack_u32(ValueType.STRING), pack_u32(len(name)), name]
        self._header = b"".join(header)
        self._suffix = project.encode("utf-8")
        self._u32 = pack_u32
        self._single = len(join_keys) == 1

    def _value(self, key_type: str, value) -> bytes:
        if key_type == "String":
            raw = value.encode("utf-8")
            return self._u32(ValueType.STRING) + self._u32(len(raw)) + raw
        type_code, pack = self._PACKERS[key_type]
        raw = pack(value)
        return self._u32(type_code) + self._u32(len(raw)) + raw

    def __call__(self, entity) -> bytes:
        values = (entity,) if self._single else entity
        return self._header + b"".join(self._value(self._types[i], values[i]) for i in self._order) + self._suffix


def entity_key_encoder(join_keys: Sequence[str], key_types: Sequence[str], project: str, entity_key_serialization_version: int = 3):
    """The fastest encoder for these join keys: Int64KeyEncoder for one Int64 key, else EntityKeyEncoder."""
    if len(join_keys) == 1 and key_types[0] == "Int64":
        return Int64KeyEncoder(join_keys[0], project, entity_key_serialization_version)
    return EntityKeyEncoder(join_keys, key_types, project, entity_key_serialization_version)


def field_key(view: str, feature: str) -> bytes:
    """The hash field of one feature: murmur3_32 of "<view>:<feature>", little endian (Feast's `_mmh3`)."""
    return mmh3.hash(f"{view}:{feature}", signed=False).to_bytes(4, "little")


def ts_key(view: str) -> bytes:
    """The hash field holding the view's event timestamp."""
    return f"_ts:{view}".encode("utf-8")


def decode_timestamp(raw: bytes | None) -> float:
    """Epoch seconds of a serialized Timestamp; NaN when absent."""
    if not raw:
        return math.nan
    ts = Timestamp.FromString(raw)
    return ts.seconds + ts.nanos * 1e-9


def decode_python(raw: bytes | None):
    """A serialized Value as the Python value Feast's `to_dict` gives (None when absent or null)."""
    from feast.type_map import feast_value_type_to_python_type

    if raw is None:
        return None
    return feast_value_type_to_python_type(ValueProto.FromString(raw))


def _value_to_float(raw: bytes) -> float:
    value = ValueProto.FromString(raw)
    kind = value.WhichOneof("val")
    if kind in ("float_val", "double_val", "int32_val", "int64_val", "bool_val"):
        return float(getattr(value, kind))
    return math.nan  # null or a non-numeric type: treated as absent


def decode_values(cells: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """Decode serialized Values to (float64 values, found mask); None, null or non-numeric cells are not found."""
    n = len(cells)
    joined = b"".join([_ABSENT if c is None else c for c in cells])
    if len(joined) == n * _FLOAT_LEN:
        # Every cell a float or absent: its first byte is the float tag or 0. Checked on the bytes
        # (18 cells, timeit: the numpy comparison and reduction 13 µs, the bytes 0.7 µs).
        tags = joined[::_FLOAT_LEN]
        if not tags.replace(_TAG_BYTE, b"").replace(b"\x00", b""):
            values = np.frombuffer(joined, dtype=_FLOAT_CELL)["value"].astype(np.float64)
            return values, np.frombuffer(tags, dtype=np.uint8) == _FLOAT_TAG
    # Other value types (double, int64, null): the slow, general path.
    values = np.array([math.nan if c is None else _value_to_float(c) for c in cells], dtype=np.float64)
    found = np.array([c is not None for c in cells], dtype=bool) & ~np.isnan(values)
    return values, found
