"""A model's folder in the repository: its versions, whether a compile is already there, and installing a new version.

`content_hash` fingerprints everything a compile depends on, so an unchanged spec is not compiled
again (`previous_report`). A new version is installed with renames only (`install`); versions that
the new config.pbtxt cannot serve are moved out beside the repository (`to_retire`, `retired_root`),
since Triton serves every version of a model with its one config.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.triton_config import load_config

from .profile import BatchProfile
from .report import CompileReport, RetiredVersion
from .spec import ModelSpec

COMPILER_VERSION = "scorestack-compile 14"  # 2: measured on a batch-size grid, per-batch-size dispatch; 3: no queue delay (a lone request runs at once); 4: the tree kernel, timed on distinct rows; 5: the native backend; 6: serving.queue_policy (on by default) recorded in the report; 7: recompiles what an intermediate 6 compiled without the policy; 8: with the queue policy, twice the instances that run at once; 9: each version folder holds its reference rows (rt.REFERENCE); 10: TL2cgen built in up to 32 files within build_budget_s, the tree kernel's node layout (deep trees, classes, leaf vectors); 11: LightGBM native (its C API in the server environment), linear trees and zero_as_missing served by it, the node layout walks a lone row through 8 trees at once; 12: an early-stopped XGBoost model serves what the API that saved it predicts (source.iterations); 13: the node layout's lone row reads a doubled row (NaN's default way without a test a step), hummingbird's axis-less Squeezes get their traced axes (a GradientBoostingRegressor at one row); 14: the runtime stages small batches in its runners' own buffers (timings change, so selections may), the linear kernel (format `linear`) for scikit-learn linear models


def content_hash(spec_path: Path, spec: ModelSpec, profile: BatchProfile | None = None) -> str:
    """Hash of everything a compile depends on: spec text, source model, held-out rows, batch profile, compiler version."""
    h = hashlib.sha256(COMPILER_VERSION.encode())
    if profile is not None:
        h.update(repr((sorted(profile.executions.items()), profile.requests, profile.rows)).encode())
    files = [spec_path, spec.source.path, spec.holdout, *(p for p in (spec.calibration, spec.train_images) if p is not None)]
    dist = spec.optimization.distillation
    if dist is not None and dist.train_rows is not None:
        files.append(dist.train_rows)
    for f in files:
        h.update(str(f.name).encode())
        try:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()


def previous_report(dest: Path, digest: str) -> CompileReport | None:
    report = dest / "report.json"
    if not (report.exists() and (dest / "config.pbtxt").exists()):
        return None
    try:
        prev = CompileReport.model_validate_json(report.read_text())
    except ValueError:
        return None
    return prev if prev.content_hash == digest else None


def versions(model_dir: Path) -> list[int]:
    """Version folders of a model in the repository, oldest first."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


# The parts of a config that bind a version's files: which runtime reads which artifact, and the
# tensors. Versions compiled under a config that differs in these cannot be served under the new one.
_BINDING_PARAMS = (rt.PARAM_RUNTIME, rt.PARAM_ARTIFACT, rt.PARAM_DISPATCH, rt.PARAM_OUTPUT_COLUMN, rt.PARAM_METHOD)


def _binding(cfg) -> dict[str, object]:
    out: dict[str, object] = {
        "backend": cfg.backend or cfg.platform,
        "default_model_filename": cfg.default_model_filename,
        "batching": cfg.max_batch_size > 0,
        "tensors": [(t.name, t.data_type, list(t.dims)) for t in (*cfg.input, *cfg.output)],
    }
    out.update({k: cfg.parameters[k].string_value for k in _BINDING_PARAMS if k in cfg.parameters})
    return out


def retired_root(repository: Path) -> Path:
    """Where versions a new config cannot serve are kept, beside (not in) the repository Triton reads."""
    return repository.parent / f".{repository.name}.retired"


def to_retire(dest: Path, new_cfg, repository: Path, version: int) -> list[RetiredVersion]:
    """The versions in `dest` that the new config cannot serve (Triton applies one config.pbtxt to
    every version it loads: an older version of another format would fail to load, and with it the model)."""
    old_config = dest / "config.pbtxt"
    existing = versions(dest)
    if not existing or not old_config.is_file():
        return []
    try:
        old = load_config(old_config)
    except Exception as exc:  # an unreadable config binds nothing we can check
        why = f"its config.pbtxt could not be read ({exc})"
    else:
        before, after = _binding(old), _binding(new_cfg)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if not differ:
            return []
        why = f"the new version {version}'s config.pbtxt differs in {', '.join(differ)}, and Triton serves every version with that one config"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return [RetiredVersion(version=v, reason=why, moved_to=str(retired_root(repository) / dest.name / f"{v}-{stamp}")) for v in existing]


def install(staged: Path, dest: Path, version: int, keep: int, retire: list[RetiredVersion] = ()) -> None:
    """Add the staged version to `dest` with renames only (a reader never sees a half-written model),
    move the versions the new config cannot serve out of the repository (each with the config that
    served it, a model folder of its own that can be put back), then drop versions beyond the newest `keep`."""
    dest.mkdir(parents=True, exist_ok=True)
    for r in retire:  # first: the new version never meets an old one under either config
        target = Path(r.moved_to)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dest / "config.pbtxt", target / "config.pbtxt")
        os.rename(dest / str(r.version), target / str(r.version))
    os.rename(staged / str(version), dest / str(version))
    for name in ("config.pbtxt", "report.json", "report.md"):
        os.replace(staged / name, dest / name)
    for old in versions(dest)[:-keep]:
        shutil.rmtree(dest / str(old), ignore_errors=True)
    if retire:
        folder = retired_root(dest.parent) / dest.name
        old_ones = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime)
        for stale in old_ones[:-keep]:  # as many retired versions as served ones
            shutil.rmtree(stale, ignore_errors=True)
