"""The entity-id rule over a whole column (`entity_ids`): the fast path accepts exactly what the
per-id rule accepts and names the first offender the same way."""

from __future__ import annotations

import numpy as np
import pytest

from scorestack.errors import InputValidationError
from scorestack.validation import MAX_KEY_CHARS, entity_id, entity_ids


@pytest.mark.parametrize(
    "values, key_type",
    [
        ([3, 5, 8], "Int64"),
        ([-(2**63), 2**63 - 1], "Int64"),
        ([np.int64(4), 7], "Int64"),  # numpy ints: the per-id path, same ids
        ([0, 2**31 - 1], "Int32"),
        (["u1", "merchant-9", ""], "String"),
        ([np.str_("a"), "b"], "String"),
    ],
)
def test_entity_ids_equal_the_per_id_rule(values, key_type):
    got = entity_ids(values, "candidate_ids", key_type)
    assert got == [entity_id(v, "x", key_type) for v in values]
    assert all(type(v) is (str if key_type == "String" else int) for v in got)


@pytest.mark.parametrize(
    "values, key_type, field, words",
    [
        ([1, 2, True], "Int64", "candidate_ids[2]", "integer id"),
        ([1, 2.0], "Int64", "candidate_ids[1]", "integer id"),
        ([1, 2**63], "Int64", "candidate_ids[1]", "does not fit in int64"),
        ([2**31, 1], "Int32", "candidate_ids[0]", "does not fit in int32"),
        (["a", 7], "String", "candidate_ids[1]", "string id"),
        (["a", "x" * (MAX_KEY_CHARS + 1)], "String", "candidate_ids[1]", "exceeds"),
    ],
)
def test_entity_ids_name_the_first_bad_id(values, key_type, field, words):
    with pytest.raises(InputValidationError) as err:
        entity_ids(values, "candidate_ids", key_type)
    assert err.value.field == field and words in str(err.value)
