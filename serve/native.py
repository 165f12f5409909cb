"""scorestack's native Triton backend (`backend: "scorestack"`): batch-library artifacts without the Python backend.

The backend is one C file (serve/runtime/native/scorestack_backend.c) built with the machine's C
compiler into `libtriton_scorestack.so`, once per machine and source version (cached under
$SCORESTACK_HOME/native/<digest>/). The compiler places a copy in every version folder it serves
this way: Triton looks for a model's backend library in its version folder first, so the model
folder carries its backend into any Triton (the local one, the official container).

It serves what the TL2cgen and tree-kernel formats build (compile/_tree_commons.py's batch ABI),
one format or a per-batch-size dispatch among them. The config parameter `scorestack_native` is its
plan: `<output tensor> <min_rows> <artifact> <column> ...`, the same bands and columns the Python
runtime reads from `scorestack_dispatch`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from scorestack.paths import home

BACKEND = "scorestack"  # config.pbtxt `backend`
LIBRARY = "libtriton_scorestack.so"  # Triton's name for that backend's library
PARAM_NATIVE = "scorestack_native"  # the plan the backend reads (see the module docstring)
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
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise NativeBackendUnavailable("no C compiler (gcc) on PATH: models are served through the Python backend instead")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / LIBRARY
        cmd = [compiler, "-O2", "-fPIC", "-shared", "-std=gnu99", "-pthread", "-o", str(built), str(src), "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBackendUnavailable(f"building {LIBRARY} failed: {done.stderr.strip()[:500]}")
        os.replace(built, out)  # atomic: concurrent compile jobs never see half a library
    return out


def plan(output: str, bands: list[tuple[int, str, int | None]]) -> str:
    """The `scorestack_native` parameter: the output tensor, then (min_rows, artifact, column or None) per band."""
    parts = [output]
    for min_rows, artifact, column in bands:
        if not artifact or any(c.isspace() or c == '"' for c in artifact):
            raise ValueError(f"artifact name {artifact!r} cannot be named in {PARAM_NATIVE} (no spaces or quotes)")
        parts += [str(int(min_rows)), artifact, str(-1 if column is None else int(column))]
    return " ".join(parts)
