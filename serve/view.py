"""The local view: a production model repository re-expressed for the local Triton.

Each model keeps its name, tensors, max_batch_size, dynamic batching, instance groups, queue policy,
response cache and warm-up, and serves the versions its version policy selects (named in a
`specific` policy, see `_carry_dropped_versions`); only the backend changes, to scorestack's model
runtime in Triton's Python backend, which runs the same artifact (onnxruntime for .onnx). Models on
scorestack's native backend (serve/native.py) keep it: the local Triton loads its library from the
version folder as production does. Version folders hold symlinks to the repository's artifacts, so
the runtime checks the real bytes against SHA256SUMS, and copies of the code that runs them (the
runtime's two files, the native backend's library; see `_link_version`).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from scorestack.errors import ConfigError
from scorestack.serve import native
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.triton_config import load_config, write_config

# Production backend -> the runtime that executes its artifact locally, and its default file.
_NATIVE_BACKENDS = {"onnxruntime": ("onnxruntime", "model.onnx")}
_PLATFORMS = {"onnxruntime_onnx": ("onnxruntime", "model.onnx"), "tensorrt_plan": ("tensorrt", "model.plan")}
# Copied into the view, not linked: the code that runs the model (see _link_version).
_COPIED = frozenset(rt.RUNTIME_FILES) | {native.LIBRARY}


@dataclass(frozen=True)
class LocalView:
    root: Path
    models: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)


def runtime_files() -> list[Path]:
    """The model runtime's files (model.py and scorestack_runtime.py) that every version folder holds."""
    base = resources.files("scorestack.serve.runtime")
    return [Path(str(base / name)) for name in rt.RUNTIME_FILES]


def runtime_source() -> Path:
    """The Triton entry point of the model runtime (model.py)."""
    return runtime_files()[0]


@functools.cache
def _renameat2():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the C library,
    the kernel or the filesystem cannot, so the caller falls back to renames."""
    import ctypes
    import errno

    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), f"{a} <-> {b}")


def render_model(model_dir: Path, out_root: Path) -> str | None:
    """Write the local view of one model folder into `out_root/<name>`; return why it cannot be served locally, or None.

    Raises ConfigError (naming the file and field) for a config Triton would refuse.
    """
    name = model_dir.name
    target = out_root / name
    config_path = model_dir / "config.pbtxt"
    if not config_path.exists():
        return "no config.pbtxt"
    config = load_config(config_path)
    if config.name and config.name != name:
        raise ConfigError(f"{config_path}: field `name`: {config.name!r} differs from its folder {name!r}; Triton requires them to match")
    config.name = name
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    staged = out_root / f".{name}.rendering"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    try:
        if config.platform == "ensemble":
            for v in versions:
                (staged / v.name).mkdir()
        else:
            if not versions:
                raise ConfigError(f"{model_dir}: no version folder (e.g. {model_dir}/1/) holding the artifact")
            params = config.parameters
            if config.backend == native.BACKEND:
                # scorestack's native backend runs here as in production: its library is in each
                # version folder, where Triton looks first.
                artifact = native.LIBRARY
            else:
                if rt.PARAM_RUNTIME in params:
                    runtime_name = params[rt.PARAM_RUNTIME].string_value
                    artifact = params[rt.PARAM_ARTIFACT].string_value if rt.PARAM_ARTIFACT in params else ""
                elif config.backend in _NATIVE_BACKENDS or config.platform in _PLATFORMS:
                    runtime_name, artifact = _NATIVE_BACKENDS.get(config.backend) or _PLATFORMS[config.platform]
                    artifact = config.default_model_filename or artifact
                else:
                    return f"backend {config.backend or config.platform!r} has no local runtime"
                config.backend = "python"
                config.platform = ""
                config.default_model_filename = ""
                config.ClearField("optimization")  # native accelerators do not apply to the Python backend
                params[rt.PARAM_RUNTIME].string_value = runtime_name
                params[rt.PARAM_ARTIFACT].string_value = artifact
            for version in versions:
                _link_version(version, staged / version.name, artifact)
            # The versions the production policy selects, named: the folders carried below are
            # then never loaded, whatever the policy was.
            selected = _selected_versions(config, versions)
            config.version_policy.Clear()
            config.version_policy.specific.versions.extend(selected)
            if target.exists():
                _carry_dropped_versions(target, staged)
        if (model_dir / "warmup").is_dir():  # model_warmup input_data_file samples
            os.symlink((model_dir / "warmup").resolve(), staged / "warmup")
        write_config(config, staged / "config.pbtxt")
        # Swap the rendered folder in: Triton never reads a half-written model, and never finds the
        # folder missing. Two renames left a moment without one; a load Triton started then (a
        # client's hot-swap request racing the watcher) found model.py gone, its stub failed, and
        # the load hung (seen in CI). The previous render is kept until the next one: a load in
        # progress may still be reading it.
        previous = out_root.parent / f"{out_root.name}.previous" / name  # beside the view: Triton never lists it
        if target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            previous.parent.mkdir(exist_ok=True)
            if _exchange(staged, target):
                os.rename(staged, previous)
            else:  # a filesystem without RENAME_EXCHANGE: two renames, the brief gap as before
                os.rename(target, previous)
                os.rename(staged, target)
        else:
            os.rename(staged, target)
        return None
    finally:
        shutil.rmtree(staged, ignore_errors=True)


# How long a version folder the repository dropped stays in the view (see _carry_dropped_versions).
DROPPED_VERSION_KEEP_S = 600.0
_DROPPED_MARK = ".scorestack_dropped_at"


def _selected_versions(config, versions: list[Path]) -> list[int]:
    """The versions Triton's policy selects among the repository's folders (Triton's default: the newest one)."""
    numbers = sorted(int(v.name) for v in versions)
    choice = config.version_policy.WhichOneof("policy_choice")
    if choice == "all":
        return numbers
    if choice == "specific":
        return sorted(int(v) for v in config.version_policy.specific.versions)
    newest = int(config.version_policy.latest.num_versions or 1) if choice == "latest" else 1
    return numbers[-newest:]


def _carry_dropped_versions(current: Path, staged: Path) -> None:
    """Copy into the new render, for DROPPED_VERSION_KEEP_S, the version folders of the current one
    that the repository no longer has.

    A load Triton started from the current render (a client's hot-swap request, racing the
    watcher) has already chosen its version folders; it starts that version's Python stub a second
    later. If the new render has dropped the folder by then, the stub finds no model.py and Triton's
    load never returns (seen in CI: a compile with keep_versions 1 deleted version N as it
    installed N+1). Kept, the folder holds the runtime (copied) and links to the deleted artifact:
    that load fails at once, naming the missing file, the serving version stays, and the watcher's
    load of the new render follows. The view's `specific` version policy keeps Triton from ever
    selecting a carried folder on its own.
    """
    now = time.time()
    for folder in current.iterdir():
        if not (folder.is_dir() and folder.name.isdigit()) or (staged / folder.name).exists():
            continue
        mark = folder / _DROPPED_MARK
        try:
            dropped_at = float(mark.read_text()) if mark.exists() else now
        except (OSError, ValueError):
            dropped_at = now
        if now - dropped_at <= DROPPED_VERSION_KEEP_S:
            shutil.copytree(folder, staged / folder.name, symlinks=True)
            (staged / folder.name / _DROPPED_MARK).write_text(repr(dropped_at))


def _link_version(version: Path, vdir: Path, artifact: str) -> None:
    """Symlink every file of a repository version, except the runtime's own files, which are copied;
    add the runtime where the repository has none (a hand-written repository).

    The runtime is copied because the view can outlive the version it renders: a compile with
    `keep_versions` deletes the oldest version from the repository, and a load Triton starts before
    the watcher re-renders (a client's hot-swap request) reloads the old render. With model.py a
    dangling link, Triton's Python backend stub fails to pre-initialize and the load never returns
    (seen in CI: a hot-swap waited 120 s). With the runtime copied, that load fails fast on the
    missing artifact, the serving version stays, and the watcher's render loads the new one.
    """
    vdir.mkdir()
    for item in version.iterdir():
        if item.name == "__pycache__":
            continue
        if item.name in _COPIED:
            shutil.copyfile(item, vdir / item.name)
        else:
            os.symlink(item.resolve(), vdir / item.name)
    (vdir / rt.ORIGIN).write_text(str(version.resolve()))  # the runtime names the repository's files in its errors
    if not (vdir / artifact).exists():
        raise ConfigError(f"{version}: artifact {artifact!r} named by config.pbtxt is missing")
    for src in runtime_files():
        if not (vdir / src.name).exists():
            shutil.copyfile(src, vdir / src.name)


def build_local_view(repository: Path, out: Path, *, strict: bool = False) -> LocalView:
    """Write the local view of `repository` into `out` and return what it holds.

    Models the local runtime cannot execute (e.g. TensorRT plans on a CPU machine) and, unless
    `strict`, models whose config is invalid are left out and listed in `skipped` with the reason;
    with `strict` an invalid config raises ConfigError.
    """
    repository = Path(repository)
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} does not exist or is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    models: list[str] = []
    skipped: dict[str, str] = {}
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            reason = render_model(model_dir, out)
        except ConfigError as exc:
            if strict:
                raise
            reason = str(exc)
        if reason is None:
            models.append(model_dir.name)
        else:
            skipped[model_dir.name] = reason
    return LocalView(root=out, models=tuple(models), skipped=skipped)
