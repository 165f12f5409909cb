"""The Feast feature repository (fraud, ranking), the async feature-fetch layer and write-back.

Heavy modules (Feast, redis) load on first use: `from scorestack.features import FeatureFetcher`.
"""

from __future__ import annotations

from scorestack._lazy import lazy_exports

_EXPORTS = {
    "FeatureFetcher": "scorestack.features.fetch",
    "FeatureResult": "scorestack.features.fetch",
    "FeatureStatus": "scorestack.features.fetch",
    "FetchTimings": "scorestack.features.fetch",
    "FeatureWriter": "scorestack.features.push",
    "CounterUpdate": "scorestack.features.push",
    "write_repo": "scorestack.features.store",
    "apply": "scorestack.features.store",
    "materialize": "scorestack.features.store",
    "feature_store": "scorestack.features.store",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
