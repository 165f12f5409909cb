"""Where scorestack keeps its state: the managed server environment, the project workspace (the demo's included) and the model repository."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Machine-wide state (the managed Triton server environment): $SCORESTACK_HOME or ~/.cache/scorestack."""
    return Path(os.environ.get("SCORESTACK_HOME", Path.home() / ".cache" / "scorestack")).expanduser()


def workspace() -> Path:
    """Per-project state (demo data, trained models, feature repository): $SCORESTACK_WORKSPACE or ./.scorestack."""
    return Path(os.environ.get("SCORESTACK_WORKSPACE", Path.cwd() / ".scorestack")).expanduser()


def default_repository() -> Path:
    """The Triton model repository that `scorestack compile` writes: ./model_repository."""
    return Path(os.environ.get("SCORESTACK_REPOSITORY", Path.cwd() / "model_repository")).expanduser()
