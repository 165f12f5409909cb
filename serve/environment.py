"""The managed server environment: a virtual environment holding the real `tritonserver`.

PyPI's `nvidia-pytriton` wheel ships Triton 2.51 (server, Python backend, response cache, one
backend stub per Python version). The Python backend stub silently returns empty tensors with
numpy 2, so the server side gets its own environment with numpy<2, created on first use.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from scorestack import paths
from scorestack.errors import PlatformError, ServerError


def read_requirements(path: Path) -> tuple[str, ...]:
    """The pins of a requirements file, in order (comments and blank lines dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


# What the model runtime needs inside Triton: one file, also installed into the Triton container
# image (deploy/triton/Dockerfile). Locally the wheel that carries tritonserver comes first.
RUNTIME_REQUIREMENTS_FILE = Path(str(resources.files("scorestack.serve.runtime") / "requirements.txt"))
TRITON_WHEEL = "nvidia-pytriton==0.7.0"  # ships Triton 2.51.0 (the release of the 24.10 container)
SERVER_REQUIREMENTS: tuple[str, ...] = (TRITON_WHEEL, *read_requirements(RUNTIME_REQUIREMENTS_FILE))

MIN_GLIBC = (2, 35)
DOCKER_HINT = (
    "Run the docker-compose stack instead (`docker compose up` in the repository root), which uses "
    "the official Triton container."
)
_READY_MARKER = ".scorestack-ready"


@dataclass(frozen=True)
class ServerEnvironment:
    """A ready server environment and the paths the launcher needs."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def site_packages(self) -> Path:
        return self.root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"

    @property
    def triton_root(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def tritonserver(self) -> Path:
        return self.triton_root / "bin" / "tritonserver"

    @property
    def libs_dir(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def cache_dir(self) -> Path:
        return self.triton_root / "caches"

    @property
    def python_backend_files(self) -> list[Path]:
        backend = self.triton_root / "backends" / "python"
        return [backend / "libtriton_python.so", backend / "triton_python_backend_utils.py"]

    @property
    def stub(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.triton_root / "python_backend_stubs" / version / "triton_python_backend_stub"

    def backend_directory(self, root: Path) -> Path:
        """A Triton backend directory under `root`: the wheel's backends/python has no stub, so its files are
        paired with the stub for this Python (symlinks). Used by the launched server and the in-process one."""
        backend = root / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for src in (*self.python_backend_files, self.stub):
            dst = backend / src.name
            if not dst.exists():
                os.symlink(src, dst)
        return root

    def launch_env(self) -> dict[str, str]:
        """Environment for `tritonserver` and its Python backend stub (see docs/platform-notes.md)."""
        env = dict(os.environ)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        ld = [p for p in (libdir, str(self.libs_dir), env.get("LD_LIBRARY_PATH", "")) if p]
        env["LD_LIBRARY_PATH"] = ":".join(ld)
        # The embedded interpreter finds the environment's site-packages through PATH.
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        env.pop("VIRTUAL_ENV", None)
        # One thread per model instance by default; the compiler sets intra-op threads explicitly.
        env.setdefault("OMP_NUM_THREADS", "1")
        return env


def check_platform() -> None:
    """Raise PlatformError unless this is x86_64 Linux with glibc >= 2.35 and a supported Python."""
    system, machine = platform.system(), platform.machine()
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        raise PlatformError(
            f"the local Triton needs x86_64 Linux (this is {system} {machine}): the nvidia-pytriton "
            f"wheel ships a Linux x86_64 tritonserver. {DOCKER_HINT}"
        )
    libc, version = platform.libc_ver()
    if libc != "glibc":
        raise PlatformError(f"the local Triton needs glibc >= 2.35 (found {libc or 'unknown libc'}). {DOCKER_HINT}")
    parts = tuple(int(p) for p in version.split(".")[:2])
    if parts < MIN_GLIBC:
        raise PlatformError(f"the local Triton needs glibc >= 2.35 (found {version}). {DOCKER_HINT}")
    if not (3, 8) <= sys.version_info[:2] <= (3, 13):
        raise PlatformError(
            f"no Triton Python backend stub for Python {sys.version_info.major}.{sys.version_info.minor} "
            f"(the wheel ships 3.8-3.13). {DOCKER_HINT}"
        )


def requirements_hash(requirements: tuple[str, ...] = SERVER_REQUIREMENTS) -> str:
    key = "\n".join((sys.version, *requirements))
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def default_location() -> Path:
    return paths.home() / f"server-env-{requirements_hash()}"


def ensure_server_environment(root: Path | None = None, *, quiet: bool = True) -> ServerEnvironment:
    """Return the server environment, creating it on first use (idempotent, safe across processes)."""
    check_platform()
    root = Path(root) if root is not None else Path(os.environ.get("SCORESTACK_SERVER_ENV", default_location()))
    env = ServerEnvironment(root)
    marker = root / _READY_MARKER
    want = requirements_hash()
    if marker.exists() and marker.read_text().strip() == want and env.tritonserver.exists():
        return env
    root.parent.mkdir(parents=True, exist_ok=True)
    lock_path = root.parent / f".{root.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits for the first one's build
        if marker.exists() and marker.read_text().strip() == want and env.tritonserver.exists():
            return env
        if root.exists():
            shutil.rmtree(root)
        _run([sys.executable, "-m", "venv", str(root)], "create the server virtual environment", quiet)
        _run(
            [str(env.python), "-m", "pip", "install", "--disable-pip-version-check", *(["-q"] if quiet else []), *SERVER_REQUIREMENTS],
            "install the server environment's packages",
            quiet,
        )
        missing = [p for p in (env.tritonserver, env.stub, *env.python_backend_files) if not p.exists()]
        if missing:
            raise ServerError(f"server environment at {root} lacks {', '.join(map(str, missing))}")
        marker.write_text(want + "\n")
    return env


def _run(cmd: list[str], what: str, quiet: bool) -> None:
    result = subprocess.run(cmd, capture_output=quiet, text=True, timeout=1800)
    if result.returncode != 0:
        tail = ((result.stdout or "") + (result.stderr or ""))[-3000:]
        raise ServerError(f"failed to {what} (exit {result.returncode}): {' '.join(cmd)}\n{tail}")
