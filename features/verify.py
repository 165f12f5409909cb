"""Start-time check of the direct Redis reader against Feast's own reads, per feature service.

`auto` prefers the direct reader on Redis because it measured fastest; it keeps it for a service
only if, on entities sampled from the store itself, it reads exactly what Feast reads (values,
presence, event times, raw values). A service whose check fails falls back to Feast's async reads.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from scorestack.features.backends import Backend, Entity, Row, ViewSpec

if TYPE_CHECKING:
    from scorestack.features.backends import DirectRedisBackend

logger = logging.getLogger(__name__)


async def sample_entities(
    direct: "DirectRedisBackend", views: Mapping[str, ViewSpec], project: str, per_view: int = 5, max_keys: int = 2000
) -> dict[str, list[Entity]]:
    """Up to `per_view` stored entities per view, found by scanning the project's Redis keys."""
    from feast.infra.key_encoding_utils import deserialize_entity_key
    from feast.type_map import feast_value_type_to_python_type

    by_keys: dict[tuple[str, ...], list[str]] = {}
    for spec in views.values():
        by_keys.setdefault(tuple(sorted(spec.join_keys)), []).append(spec.name)
    found: dict[str, list[Entity]] = {name: [] for name in views}
    suffix = project.encode("utf-8")
    seen = 0
    async for key in direct.client.scan_iter(match=b"*" + suffix, count=500):
        seen += 1
        if seen > max_keys or all(len(v) >= per_view for v in found.values()):
            break
        try:
            entity_key = deserialize_entity_key(key[: -len(suffix)], 3)
        except Exception:  # another project's key that happens to end alike
            continue
        values = dict(zip(entity_key.join_keys, (feast_value_type_to_python_type(v) for v in entity_key.entity_values)))
        for name in by_keys.get(tuple(sorted(values)), ()):
            spec = views[name]
            entity = values[spec.join_keys[0]] if len(spec.join_keys) == 1 else tuple(values[k] for k in spec.join_keys)
            if len(found[name]) < per_view:
                found[name].append(entity)
    return found


def _same(a: Row | None, b: Row | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not np.array_equal(a.found, b.found) or not np.array_equal(a.values[a.found], b.values[b.found]):
        return False
    if not (math.isnan(a.event_ts) and math.isnan(b.event_ts)) and abs(a.event_ts - b.event_ts) > 1e-6:
        return False
    return a.raw == b.raw


async def compare(direct: Backend, reference: Backend, wanted: Mapping[str, Sequence[Entity]]) -> str | None:
    """None when the direct reader reads what Feast reads for `wanted`; else the first difference."""
    mine = await direct.read(wanted)
    theirs = await reference.read(wanted)
    for view, entities in wanted.items():
        for entity, a, b in zip(entities, mine[view], theirs[view]):
            if not _same(a, b):
                return f"view {view!r}, entity {entity!r}: direct read {a}, Feast read {b}"
    return None
