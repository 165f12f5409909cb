"""scorestack's native Triton backend (`backend: "scorestack"`): batch-library artifacts without the Python backend.

The backend is one C file (serve/runtime/native/scorestack_backend.c) built with the machine's C
compiler into `libtriton_scorestack.so`, once per machine and source version (cached under
$SCORESTACK_HOME/native/<digest>/). The compiler places a copy in every version folder it serves
this way: Triton looks for a model's backend library in its version folder first, so the model
folder carries its backend into any Triton (the local one, the official container).

It serves what the TL2cgen and tree-kernel formats build (compile/_tree_commons.py's batch ABI),
one format or a per-batch-size dispatch among them, from the same config parameters the Python
runtime reads (serve/runtime/scorestack_runtime.py defines them, the dispatch plan's format and the
SHA256SUMS rule included): a model moves between the two backends by its `backend` alone.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

from scorestack.paths import home
from scorestack.serve.cbuild import build_library

BACKEND = "scorestack"  # config.pbtxt `backend`
LIBRARY = "libtriton_scorestack.so"  # Triton's name for that backend's library
RUNTIMES = frozenset({"tl2cgen"})  # runner names whose artifacts speak the batch ABI


class NativeBackendUnavailable(RuntimeError):
    """The backend cannot be built here (no C compiler, or it failed); the reason says which."""


def source() -> Path:
    return Path(str(resources.files("scorestack.serve.runtime") / "native" / "scorestack_backend.c"))


def library() -> Path:
    """The built backend library for this source, building it on first use."""
    src = source()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    out = home() / "native" / digest / LIBRARY
    if out.exists():
        return out
    return build_library(src.read_text(), out, error=NativeBackendUnavailable, what=f"{LIBRARY} (models are served through the Python backend without it)",
                         flags=("-std=gnu99", "-pthread"), libs=("-ldl",))

