"""The demo room: synthetic fraud and ranking data, the demo models' training, the demo feature
repository's contents, demo traffic and the end-to-end run. It uses the stages' public APIs; no
stage imports it.

Modules: `data` (users, items, transactions, ranking queries), `train` (the demo models and their
specs), `features` (the demo tables in a working feature repository), `traffic` (fraud, ranking
and vision requests through the request paths, with the per-phase breakdown), `run` (`scorestack
demo`: train, compile, materialize, serve, score, diagnose, shut down).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scorestack._lazy import lazy_exports

if TYPE_CHECKING:  # (re-exported: `name as name`); imports stay lazy: `scorestack --help` must not load XGBoost, Feast or torch
    from .features import init_repo as init_repo
    from .run import run_demo as run_demo
    from .traffic import run_diagnosis as run_diagnosis
    from .train import train_demo_models as train_demo_models, train_vision_models as train_vision_models

_EXPORTS = {
    name: f"{__name__}.{module}"
    for name, module in {
        "init_repo": "features",
        "run_demo": "run",
        "run_diagnosis": "traffic",
        "train_demo_models": "train",
        "train_vision_models": "train",
    }.items()
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
