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
from google.protobuf.timestamp_pb2 import Timestamp

# A Float32 feature serializes as one tag byte + 4 little-endian bytes; read those without protobuf.
_FLOAT_VALUE = ValueProto(float_val=1.0).SerializeToString()
_FLOAT_TAG = _FLOAT_VALUE[0]
_FLOAT_LEN = len(_FLOAT_VALUE)
assert _FLOAT_LEN == 5, "feast.types.Value float_val is expected to serialize to 5 bytes"
_ABSENT = bytes(_FLOAT_LEN)  # tag 0 is never a valid protobuf tag: marks "no value"


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


def _value_to_float(raw: bytes) -> float:
    value = ValueProto.FromString(raw)
    kind = value.WhichOneof("val")
    if kind in ("float_val", "double_val", "int32_val", "int64_val", "bool_val"):
        return float(getattr(value, kind))
    return math.nan  # null or a non-numeric type: treated as absent


def decode_values(cells: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """Decode serialized Values to (float32 values, found mask); None or null cells are not found."""
    n = len(cells)
    joined = b"".join(_ABSENT if c is None else c for c in cells)
    if len(joined) == n * _FLOAT_LEN:
        raw = np.frombuffer(joined, dtype=np.uint8).reshape(n, _FLOAT_LEN)
        if np.all((raw[:, 0] == _FLOAT_TAG) | (raw[:, 0] == 0)):
            values = np.ascontiguousarray(raw[:, 1:]).view("<f4").reshape(n).astype(np.float32)
            return values, raw[:, 0] == _FLOAT_TAG
    # Other value types (double, int64, null): the slow, general path.
    values = np.array([math.nan if c is None else _value_to_float(c) for c in cells], dtype=np.float32)
    found = np.array([c is not None for c in cells], dtype=bool) & ~np.isnan(values)
    return values, found
