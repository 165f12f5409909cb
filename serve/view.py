"""The local view: a production model repository re-expressed for the local Triton.

Each model keeps its name, tensors, max_batch_size, dynamic batching, instance groups, queue policy,
response cache and warm-up; only the backend changes, to scorestack's model runtime in Triton's
Python backend, which runs the same artifact (onnxruntime for .onnx).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from scorestack.errors import ConfigError
from scorestack.triton_config import load_config, write_config

# Production backend -> the runtime that executes its artifact locally, and its default file.
_NATIVE_BACKENDS = {"onnxruntime": ("onnxruntime", "model.onnx")}
_PLATFORMS = {"onnxruntime_onnx": ("onnxruntime", "model.onnx")}
_RUNTIME_PARAM = "scorestack_runtime"
_ARTIFACT_PARAM = "scorestack_artifact"


@dataclass(frozen=True)
class LocalView:
    root: Path
    models: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)


def runtime_source() -> Path:
    """The model runtime file (model.py) that every local model runs."""
    return Path(str(resources.files("scorestack.serve.runtime") / "model.py"))


def build_local_view(repository: Path, out: Path) -> LocalView:
    """Write the local view of `repository` into `out` and return what it holds.

    Models the local runtime cannot execute (e.g. TensorRT plans on a CPU machine) are left out
    and listed in `skipped` with the reason.
    """
    repository = Path(repository)
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} does not exist or is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    runtime = runtime_source()
    models: list[str] = []
    skipped: dict[str, str] = {}
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        config_path = model_dir / "config.pbtxt"
        if not config_path.exists():
            skipped[model_dir.name] = "no config.pbtxt"
            continue
        config = load_config(config_path)
        if config.name and config.name != model_dir.name:
            raise ConfigError(
                f"{config_path}: field `name`: {config.name!r} differs from its folder {model_dir.name!r}; "
                "Triton requires them to match"
            )
        config.name = model_dir.name
        target = out / model_dir.name
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        if config.platform == "ensemble":
            write_config(config, target / "config.pbtxt")
            for v in versions:
                (target / v.name).mkdir()
            models.append(model_dir.name)
            continue
        params = config.parameters
        if _RUNTIME_PARAM in params:
            runtime_name = params[_RUNTIME_PARAM].string_value
            artifact = params[_ARTIFACT_PARAM].string_value if _ARTIFACT_PARAM in params else ""
        elif config.backend in _NATIVE_BACKENDS or config.platform in _PLATFORMS:
            runtime_name, artifact = _NATIVE_BACKENDS.get(config.backend) or _PLATFORMS[config.platform]
            artifact = config.default_model_filename or artifact
        else:
            shutil.rmtree(target)
            skipped[model_dir.name] = f"backend {config.backend or config.platform!r} has no local runtime"
            continue
        if not versions:
            raise ConfigError(f"{model_dir}: no version folder (e.g. {model_dir}/1/) holding the artifact")
        config.backend = "python"
        config.platform = ""
        config.default_model_filename = ""
        config.ClearField("optimization")  # native accelerators do not apply to the Python backend
        params[_RUNTIME_PARAM].string_value = runtime_name
        params[_ARTIFACT_PARAM].string_value = artifact
        for version in versions:
            vdir = target / version.name
            vdir.mkdir()
            for item in version.iterdir():
                if item.name in ("model.py", "__pycache__"):
                    continue
                os.symlink(item.resolve(), vdir / item.name)
            if not (vdir / artifact).exists():
                raise ConfigError(f"{version}: artifact {artifact!r} named by config.pbtxt is missing")
            shutil.copyfile(runtime, vdir / "model.py")
        if (model_dir / "warmup").is_dir():  # model_warmup input_data_file samples
            os.symlink((model_dir / "warmup").resolve(), target / "warmup")
        write_config(config, target / "config.pbtxt")
        models.append(model_dir.name)
    return LocalView(root=out, models=tuple(models), skipped=skipped)
