"""The demo's feature repository contents: its users and items written as the repository's source
tables, with event times moved to now (the demo tables carry 2026-11-01, which Feast reads as stale)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from scorestack.demo import data as demo_data
from scorestack.errors import FeatureError
from scorestack.features import store


def init_repo(
    repo_dir: str | Path | None = None,
    online: store.Online = "sqlite",
    redis_url: str | None = None,
    n_users: int = 5000,
    n_items: int = 2000,
    *,
    project: str = store.PROJECT,
) -> Path:
    """A working feature repository (scorestack.features.store.write_repo) holding the demo's users and items.

    Event timestamps are stamped to the last ten minutes. Returns the repository directory; run
    `store.apply` then `store.materialize` (or `feast apply` and `feast materialize` inside it).
    """
    if n_users < 1 or n_items < 1:
        raise FeatureError(f"n_users/n_items: must be positive, got {n_users}/{n_items}")
    repo = store.write_repo(repo_dir, online=online, redis_url=redis_url, project=project)
    now = datetime.now(timezone.utc)
    _stamp(demo_data.make_users(n_users), now, 1).to_parquet(store.source_path(repo, "user"), index=False)
    _stamp(demo_data.make_items(n_items), now, 2).to_parquet(store.source_path(repo, "item"), index=False)
    return repo


def restamp(repo_dir: str | Path | None = None) -> None:
    """Move the demo tables' event times to the last ten minutes (before re-materializing a day-old demo)."""
    repo = Path(repo_dir) if repo_dir is not None else store.default_repo_dir()
    now = datetime.now(timezone.utc)
    for seed, entity in enumerate(("user", "item"), start=1):
        path = store.source_path(repo, entity)
        if not path.is_file():
            raise FeatureError(f"repo_dir: no {path.name} in {path.parent}; write the demo repository with `scorestack features apply --repo-dir {repo}`")
        _stamp(pd.read_parquet(path), now, seed).to_parquet(path, index=False)


def _stamp(df: pd.DataFrame, now: datetime, seed: int) -> pd.DataFrame:
    """Event times within the 10 minutes before `now` (whole seconds), so no view is stale at demo time."""
    rng = np.random.default_rng(seed)
    out = df.copy()
    out["event_timestamp"] = pd.Timestamp(now.replace(microsecond=0)) - pd.to_timedelta(rng.integers(1, 600, len(df)), unit="s")
    return out
