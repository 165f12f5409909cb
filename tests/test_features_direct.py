"""The direct Redis reader's layout functions against Feast's own serialization."""

from __future__ import annotations

import math

import numpy as np
from feast.infra.online_stores.helpers import _mmh3, _redis_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Null
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from scorestack import schema
from scorestack.features import redis_layout


@given(st.integers(-(2**63), 2**63 - 1), st.sampled_from(["user_id", "item_id"]), st.from_regex(r"[a-z_]{1,20}", fullmatch=True))
def test_entity_keys_are_feasts(value, join_key, project):
    expected = _redis_key(project, EntityKeyProto(join_keys=[join_key], entity_values=[ValueProto(int64_val=value)]), 3)
    assert redis_layout.Int64KeyEncoder(join_key, project)(value) == expected


_key_value = {
    "Int64": st.integers(-(2**63), 2**63 - 1),
    "Int32": st.integers(-(2**31), 2**31 - 1),
    "String": st.text(max_size=40),
}
_proto_value = {"Int64": lambda v: ValueProto(int64_val=v), "Int32": lambda v: ValueProto(int32_val=v), "String": lambda v: ValueProto(string_val=v)}


@st.composite
def _entity_keys(draw):
    names = draw(st.lists(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), min_size=1, max_size=3, unique=True))
    types = [draw(st.sampled_from(sorted(_key_value))) for _ in names]
    values = [draw(_key_value[t]) for t in types]
    return names, types, values


@given(_entity_keys(), st.from_regex(r"[a-z_]{1,20}", fullmatch=True))
def test_compound_and_string_entity_keys_are_feasts(key, project):
    """Any mix of Int64, Int32 and String join keys, one or several (Feast sorts them by name)."""
    names, types, values = key
    proto = EntityKeyProto(join_keys=names, entity_values=[_proto_value[t](v) for t, v in zip(types, values)])
    encode = redis_layout.entity_key_encoder(names, types, project)
    assert encode(values[0] if len(values) == 1 else tuple(values)) == _redis_key(project, proto, 3)


def test_field_keys_are_feasts():
    for view, (_, features) in schema.FEATURE_VIEWS.items():
        for feature in features:
            assert redis_layout.field_key(view, feature) == _mmh3(f"{view}:{feature}")
    assert redis_layout.ts_key("item_stats") == b"_ts:item_stats"


@given(st.lists(st.one_of(st.none(), st.floats(width=32, allow_nan=False)), min_size=1, max_size=50))
def test_float_values_decode_exactly(cells):
    raw = [None if c is None else ValueProto(float_val=c).SerializeToString() for c in cells]
    values, found = redis_layout.decode_values(raw)
    assert values.dtype == np.float64
    np.testing.assert_array_equal(found, [c is not None for c in cells])
    np.testing.assert_array_equal(values[found], np.float32([c for c in cells if c is not None]).astype(np.float64))


def test_other_value_types_take_the_general_path():
    raw = [
        ValueProto(double_val=2.5).SerializeToString(),
        ValueProto(int64_val=7).SerializeToString(),
        ValueProto(null_val=Null.NULL).SerializeToString(),
        b"",  # an unset Value
        None,
        ValueProto(float_val=0.0).SerializeToString(),
    ]
    values, found = redis_layout.decode_values(raw)
    np.testing.assert_array_equal(found, [True, True, False, False, False, True])
    assert values[0] == 2.5 and values[1] == 7.0 and values[5] == 0.0


def test_timestamps_decode():
    ts = Timestamp(seconds=1_800_000_000, nanos=500_000_000)
    assert redis_layout.decode_timestamp(ts.SerializeToString()) == 1_800_000_000.5
    assert math.isnan(redis_layout.decode_timestamp(None))
