"""Which optional install ("extra") provides which modules, and the one error that names the missing one.

`pip install scorestack` holds what serving and scoring need (the clients, the feature reader, the
managed server environment, the command line). The rest is in extras, declared in pyproject.toml:

| extra | for | modules it provides |
|---|---|---|
| `compile` | `scorestack compile`, training the demo's models | onnx, onnxruntime, skl2onnx, onnxmltools, scikit-learn, XGBoost, LightGBM, TL2cgen, joblib |
| `vision` | image models: compiling them, the demo's CNN | compile's, and torch |
| `hummingbird` | the compiler's hummingbird candidate (skipped without it) | compile's, hummingbird-ml and torch |
| `bench` | `benchmarks/` | compile's, psutil, FastAPI, uvicorn |

A command that needs an extra checks for it before it starts (`require`): a missing one is a
`MissingExtra` naming the extra and the `pip install` line, never an ImportError from deep inside.
The check looks modules up without importing them, so it costs next to nothing.
"""

from __future__ import annotations

import importlib.util

from scorestack.errors import ScorestackError

# Top-level import names, not distribution names (scikit-learn imports as sklearn, xgboost-cpu as xgboost).
_COMPILE = ("onnx", "onnxruntime", "skl2onnx", "onnxmltools", "onnxconverter_common", "sklearn", "xgboost", "lightgbm", "tl2cgen", "joblib")
EXTRAS: dict[str, tuple[str, ...]] = {
    "compile": _COMPILE,
    "vision": (*_COMPILE, "torch", "onnxscript"),  # pyproject: vision = scorestack[compile] + torch
    "hummingbird": (*_COMPILE, "hummingbird", "torch", "onnxscript"),
    "bench": (*_COMPILE, "psutil", "fastapi", "uvicorn"),
}


class MissingExtra(ScorestackError, ImportError):
    """What was asked needs an extra that is not installed; the message names it and the install line.

    Also an ImportError, so code that guards an optional import with `except ImportError` keeps working.
    """

    def __init__(self, what: str, extras: list[str], modules: list[str]) -> None:
        self.extras = extras
        self.modules = modules
        self.install = f"pip install 'scorestack[{','.join(extras)}]'"
        noun = f"the {extras[0]} extra" if len(extras) == 1 else f"the {' and '.join(extras)} extras"
        super().__init__(f"{what} needs {noun}: {self.install} (not installed: {', '.join(modules)})")


def installed(module: str) -> bool:
    """Whether top-level `module` can be imported here (found on the path, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a half-imported module without a spec
        return False


def missing(extra: str) -> list[str]:
    """The modules of `extra` that are not installed (empty: the extra is there)."""
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; one of {', '.join(EXTRAS)}")
    return [m for m in EXTRAS[extra] if not installed(m)]


def require(what: str, *extras: str) -> None:
    """Raise MissingExtra, naming every extra of `extras` that is incomplete, if any is; `what` is who needs
    them (`"scorestack compile"`, `"compiling an image model"`)."""
    lacking = {extra: missing(extra) for extra in extras}
    lacking = {extra: mods for extra, mods in lacking.items() if mods}
    if lacking:
        modules = list(dict.fromkeys(m for mods in lacking.values() for m in mods))
        raise MissingExtra(what, list(lacking), modules)


def extra_of(module: str | None) -> str | None:
    """The smallest extra that provides top-level `module` (an ImportError's `name`), or None for one no extra provides."""
    if not module:
        return None
    top = module.split(".")[0]
    for extra in ("compile", "vision", "hummingbird", "bench"):  # each extra's own modules after those it includes
        if top in EXTRAS[extra]:
            return extra
    return None
