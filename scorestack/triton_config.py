"""Read, validate and write Triton model configurations against Triton's own schema.

The server reports a misspelled field only as "failed to poll from model repository"; parsing
with `model_config_pb2` names the file and the field instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from scorestack.errors import ConfigError

ModelConfig = model_config_pb2.ModelConfig


def parse_config(text: str, source: str = "<config.pbtxt>") -> model_config_pb2.ModelConfig:
    """Parse protobuf text into a ModelConfig, or raise ConfigError naming `source` and the field."""
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(
            f"{source}: invalid Triton model configuration: {str(exc).rstrip('.')}. "
            "Check the field's spelling and type against Triton's model_config.proto."
        ) from exc
    _check_semantics(config, source)
    return config


def load_config(path: str | os.PathLike[str]) -> model_config_pb2.ModelConfig:
    """Load and validate `path` (a config.pbtxt)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read model configuration: {exc}") from exc
    return parse_config(text, str(path))


def format_config(config: model_config_pb2.ModelConfig) -> str:
    return text_format.MessageToString(config)


def write_config(config: model_config_pb2.ModelConfig, path: str | os.PathLike[str]) -> Path:
    """Validate `config` by round-tripping it through the parser, then write it atomically."""
    path = Path(path)
    text = format_config(config)
    parse_config(text, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.", suffix=".pbtxt")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def _check_semantics(config: model_config_pb2.ModelConfig, source: str) -> None:
    """Checks the schema cannot express but the server would reject at load time."""
    if not config.name and not config.backend and not config.platform:
        raise ConfigError(f"{source}: field `backend`: missing; set e.g. backend: \"onnxruntime\"")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for i, tensor in enumerate(tensors):
            if not tensor.name:
                raise ConfigError(f"{source}: field `{kind}[{i}].name`: missing; every tensor needs a name")
            if tensor.name in seen:
                raise ConfigError(f"{source}: field `{kind}[{i}].name`: duplicate tensor name {tensor.name!r}")
            seen.add(tensor.name)
            if tensor.data_type == model_config_pb2.TYPE_INVALID:
                raise ConfigError(f"{source}: field `{kind}[{i}].data_type`: missing; set e.g. TYPE_FP32")
    if config.HasField("dynamic_batching") and config.max_batch_size <= 0:
        raise ConfigError(
            f"{source}: field `max_batch_size`: dynamic_batching needs max_batch_size > 0 (got {config.max_batch_size})"
        )
