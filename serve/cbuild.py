"""Small C libraries scorestack builds at first use with the system compiler: the native backend, the
admin-key handoff shim and the in-process Triton's callbacks. One way to build them: compile into a
temporary file beside the target and move it in place atomically, so concurrent builds never see half a
library; a missing compiler or a failed build raises the caller's error with the compiler's message."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence


def build_library(source: str, out: Path, *, error: type[Exception], what: str, flags: Sequence[str] = (), libs: Sequence[str] = ()) -> Path:
    """`out`, compiled from the C `source` unless it exists already (name it by the source's hash)."""
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None or shutil.which(cc) is None:
        raise error(f"{what} needs a C compiler (gcc), and none was found: install gcc (apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, built = Path(tmp) / "source.c", Path(tmp) / out.name
        src.write_text(source)
        done = subprocess.run([cc, "-O2", "-fPIC", "-shared", *flags, "-o", str(built), str(src), *libs], capture_output=True, text=True)
        if done.returncode != 0:
            raise error(f"building {what} with {cc} failed: {done.stderr.strip()[:800]}")
        os.replace(built, out)
    return out
