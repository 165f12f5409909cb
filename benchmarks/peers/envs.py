"""Virtual environments of the peers that cannot share .venv (MLServer, BentoML: their own FastAPI, numpy pins).

Each environment is built once under ~/.cache/scorestack/peers/<name>-<hash of its pins> with
`python -m venv` + pip, and its installed versions are read back for the report.

    .venv/bin/python benchmarks/peers/envs.py     # build (or find) every peer environment
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# mlserver-xgboost depends on `xgboost`, whose Linux wheel pulls nvidia-nccl-cu12 (~470 MB); the
# same library ships CPU-only as `xgboost-cpu`, so the runtime is installed without its deps (and
# scikit-learn, which it needs to load a classifier, is pinned explicitly).
MLSERVER_PINS = ("mlserver==1.7.1", "xgboost-cpu==3.2.0", "scikit-learn==1.9.1")
MLSERVER_NO_DEPS = ("mlserver-xgboost==1.7.1",)
MLSERVER_REPORTED = ("mlserver", "mlserver-xgboost", "xgboost-cpu", "scikit-learn", "numpy", "fastapi", "uvicorn", "grpcio", "protobuf", "uvloop")


# BentoML with the onnxruntime the project's own peers use, and uvloop + httptools for its uvicorn (without
# them uvicorn falls back to asyncio and the pure-Python h11 parser).
BENTOML_PINS = ("bentoml==1.4.40", "onnxruntime==1.31.1", "uvloop>=0.19", "httptools>=0.6")
BENTOML_REPORTED = ("bentoml", "onnxruntime", "numpy", "starlette", "uvicorn", "uvloop", "httptools")


@dataclass(frozen=True)
class PeerEnv:
    name: str
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def versions(self, packages: tuple[str, ...]) -> dict[str, str | None]:
        code = (
            "import json,sys\nfrom importlib import metadata\nout={}\n"
            "for p in sys.argv[1:]:\n"
            "    try: out[p]=metadata.version(p)\n"
            "    except metadata.PackageNotFoundError: out[p]=None\n"
            "print(json.dumps(out))"
        )
        res = subprocess.run([str(self.python), "-c", code, *packages], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(res.stdout)


def cache_root() -> Path:
    return Path(os.environ.get("SCORESTACK_CACHE", Path.home() / ".cache" / "scorestack")) / "peers"


def _hash(*parts: tuple[str, ...]) -> str:
    text = "\n".join(x for p in parts for x in p) + f"\npython{sys.version_info[0]}.{sys.version_info[1]}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_env(name: str, pins: tuple[str, ...], no_deps: tuple[str, ...] = (), log=print) -> PeerEnv:
    """The environment `name` with `pins` (+ `no_deps` installed without dependencies), built once."""
    root = cache_root() / f"{name}-{_hash(pins, no_deps)}"
    env = PeerEnv(name, root)
    done = root / ".complete"
    if done.exists():
        return env
    log(f"building the {name} environment in {root} (once; pip from PyPI)")
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True, timeout=300)
    pip = [str(env.python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, *pins], check=True, timeout=1800)
    if no_deps:
        subprocess.run([*pip, "--no-deps", *no_deps], check=True, timeout=600)
    done.write_text(json.dumps({"pins": pins, "no_deps": no_deps}))
    return env


def mlserver_env(log=print) -> PeerEnv:
    return ensure_env("mlserver", MLSERVER_PINS, MLSERVER_NO_DEPS, log=log)


def bentoml_env(log=print) -> PeerEnv:
    return ensure_env("bentoml", BENTOML_PINS, log=log)


if __name__ == "__main__":
    for build, reported in ((mlserver_env, MLSERVER_REPORTED), (bentoml_env, BENTOML_REPORTED)):
        e = build()
        print(e.root, e.versions(reported))
