"""The local Triton: server environment, model runtime, local view, start/stop/health."""

from scorestack.serve.embedded import EmbeddedModels
from scorestack.serve.environment import ServerEnvironment, check_platform, ensure_server_environment
from scorestack.serve.inprocess import InProcessTriton
from scorestack.serve.server import LocalTriton
from scorestack.serve.view import build_local_view, runtime_files, runtime_source

__all__ = [
    "EmbeddedModels",
    "InProcessTriton",
    "LocalTriton",
    "ServerEnvironment",
    "build_local_view",
    "check_platform",
    "ensure_server_environment",
    "runtime_files",
    "runtime_source",
]
