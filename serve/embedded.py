"""The model in the service's own thread: the compiled artifact run by scorestack's model runtime, no server at all.

For a model that computes in 10-20 µs, every hop is the latency: gRPC costs ~0.5 ms, the lean HTTP
transport ~0.25 ms, Triton in the service's process (serve/inprocess.py) ~0.06-0.09 ms, most of it
the wake-up of the event loop when Triton's thread answers. `EmbeddedModels` runs the version folder's
own artifact with the version folder's own `scorestack_runtime.py` (the code Triton's Python backend
runs, the same file the compiler verified) directly on the caller's thread: a request is a function
call, and the event loop never waits for anyone.

    with EmbeddedModels(repository, models=["fraud_xgb"]) as models:
        async with TritonClient(in_process=models) as triton:
            await triton.infer("fraud_xgb", {"features": x})

What it checks first. This process is not the server environment the compiler verified the artifact
in: its numpy, onnxruntime, XGBoost or scikit-learn may differ. So before it answers anything, every
model is run on the reference rows the compiler wrote into its version folder (`scorestack_reference.npz`:
held-out rows, the source model's outputs on them, the spec's tolerances), one row at a time and as one
batch, and a model that does not reproduce them within the spec's tolerance is refused by name with
the difference. A version folder without a reference (compiled before it existed) is refused too:
recompile it. The version folder's SHA256SUMS is checked as Triton's runtime checks it.

What it leaves out, on purpose: Triton's dynamic batcher, queue policy and instances (each call runs at
once, alone, on the caller's thread, so under load calls run one after another on the event loop; a
request is never queued, so the queue timeout never applies), statistics and metrics (diagnose reports
the client's phases only), and model reload (a new version is picked up by a new EmbeddedModels).
The deadline bounds the wait before a call, not the call: a call that has started runs to its end
(10-20 µs for the demo's models; a batch of 1,000 rows of a deep forest takes milliseconds). When it
fits: small, fast models (the tree kernel, TL2cgen, small ONNX graphs) called with few rows; for big
batches, many callers or models shared by several services, Triton (in-process or a server) does
what this cannot. docs/client.md compares the transports.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import platform
from pathlib import Path
from typing import Collection, Sequence

import numpy as np
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from scorestack.errors import ServerError
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.triton_config import load_config

_IDS = itertools.count(1)


class _Model:
    """One version of one model, loaded by its own runtime file and checked against its reference."""

    def __init__(self, name: str, model_dir: Path) -> None:
        self.name = name
        config = load_config(model_dir / "config.pbtxt")
        self.config = json_format.MessageToDict(config, preserving_proto_field_name=True)
        self.config.setdefault("name", name)
        self.version = self._version(model_dir, config)
        version_dir = model_dir / str(self.version)
        self.runtime_module = _load_runtime(version_dir)
        try:
            self.runtime = self.runtime_module.ModelRuntime(name, str(version_dir), self.config)
        except self.runtime_module.IntegrityError as exc:
            raise ServerError(f"model {name!r} version {self.version}: refused: {exc}") from None
        except self.runtime_module.RuntimeLoadError as exc:
            raise ServerError(
                f"model {name!r} version {self.version}: cannot run in this process: {exc}. Install what its format needs here "
                "(pip install 'scorestack[compile]' brings onnxruntime, XGBoost and scikit-learn), or serve it through Triton"
            ) from None
        self.batched = self.runtime.batched
        self.max_batch = int(config.max_batch_size) or 1
        self.input_names = [n for n, _ in self.runtime.inputs]
        self.output_names = [n for n, _, _ in self.runtime.outputs]
        self.max_abs_diff = self._check_reference(version_dir)

    @staticmethod
    def _version(model_dir: Path, config) -> int:
        present = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
        policy = config.version_policy
        if policy.WhichOneof("policy_choice") == "specific":
            present = [v for v in present if v in set(policy.specific.versions)]
        if not present:
            raise ServerError(f"model {model_dir.name!r}: no version folder to load in {model_dir} (compile the model first)")
        return present[-1]  # Triton's default policy: the latest version

    def _check_reference(self, version_dir: Path) -> float:
        """Run the reference rows one at a time and as one batch; refuse the model unless both reproduce the source."""
        path = version_dir / rt.REFERENCE
        if not path.exists():
            raise ServerError(
                f"model {self.name!r} version {self.version}: {path} is missing, so this process cannot check that the artifact "
                "runs here as it was verified: recompile the model (scorestack compile writes it into every version folder)"
            )
        with np.load(path, allow_pickle=False) as ref:
            X, expected = ref["X"], ref["expected"].astype(np.float64)
            tolerance, relative = float(ref["tolerance"]), float(ref["relative"])
        X = X.astype(self.runtime.inputs[0][1], copy=False)
        rows = [self._first_output(X[i : i + 1]) for i in range(len(X))]
        batches = [self._first_output(X[i : i + self.max_batch]) for i in range(0, len(X), self.max_batch)]
        worst = 0.0
        for label, got in (("one row per call", np.concatenate(rows)), ("as batches", np.concatenate(batches))):
            got = got.reshape(len(X), -1).astype(np.float64)
            if got.shape != expected.shape or not np.isfinite(got).all():
                raise ServerError(f"model {self.name!r} version {self.version}: its reference rows {label} gave outputs of shape "
                                  f"{got.shape} (finite: {bool(np.isfinite(got).all())}), the source model {expected.shape}: serve it through Triton")
            excess = np.abs(got - expected) - (tolerance + relative * np.abs(expected))
            diff = float(np.abs(got - expected).max())
            if (excess > 0).any():
                raise ServerError(
                    f"model {self.name!r} version {self.version}: in this process (Python {platform.python_version()}, numpy {np.__version__}) "
                    f"the artifact does not reproduce the source model on its {len(X)} reference rows {label}: max |Δ| {diff:.3g} > "
                    f"tolerance {tolerance:g} + {relative:g}·|source|. It was verified in the server environment: serve it through "
                    "Triton (InProcessTriton or a server), or run this process with the server environment's library versions"
                )
            worst = max(worst, diff)
        return worst

    def _first_output(self, x: np.ndarray) -> np.ndarray:
        return self.runtime.run([(self.input_names[0], x)], len(x) if self.batched else 1)[0]

    def metadata(self) -> dict:
        def tensor(name: str, dtype, dims: Sequence[int]) -> dict:
            return {"name": name, "datatype": np_to_triton_dtype(np.dtype(dtype)), "shape": ([-1] if self.batched else []) + [int(d) for d in dims]}

        inputs = [tensor(i["name"], rt._dtype(i["data_type"]), i["dims"]) for i in self.config["input"]]
        outputs = [tensor(n, d, dims) for n, d, dims in self.runtime.outputs]
        return {"name": self.name, "versions": [str(self.version)], "platform": "scorestack-embedded", "inputs": inputs, "outputs": outputs}

    def infer(self, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        by_name = {name: array for name, _, array in inputs}
        try:
            arrays = [by_name[n] for n in self.input_names]
        except KeyError as exc:
            raise InferenceServerException(f"model {self.name!r}: input {exc.args[0]!r} missing", status="INVALID_ARG") from None
        n_rows = arrays[0].shape[0] if self.batched else 1
        try:
            result = self.runtime.run(self.runtime.coerce(arrays), n_rows)
        except Exception as exc:  # the runtime's own errors, reported as Triton reports a failed execution
            raise InferenceServerException(f"model {self.name}: {type(exc).__name__}: {exc}", status="INTERNAL") from None
        values = dict(zip(self.output_names, result))
        missing = [n for n in outputs if n not in values]
        if missing:
            raise InferenceServerException(f"model {self.name!r}: unknown output {missing[0]!r}; outputs are {self.output_names}", status="INVALID_ARG")
        return {n: values[n] for n in outputs}


def _load_runtime(version_dir: Path):
    """The version folder's own scorestack_runtime.py, loaded by path (as Triton's Python backend loads it)."""
    path = version_dir / "scorestack_runtime.py"
    if not path.exists():
        raise ServerError(f"{version_dir}: scorestack_runtime.py is missing; recompile the model")
    spec = importlib.util.spec_from_file_location(f"scorestack_runtime_embedded_{next(_IDS)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class EmbeddedModels:
    """Models of a local model repository run on the caller's thread; give it to TritonClient(in_process=...).

    `models`: the model folders to load (default: every folder with a config.pbtxt). Each is loaded
    at `start()` (or entering the `with`), its integrity checked and its reference rows reproduced;
    a model that fails is refused with ServerError naming it and the reason."""

    def __init__(self, repository: str | os.PathLike[str], *, models: Collection[str] | None = None) -> None:
        self.repository = Path(repository)
        self.names = list(models) if models is not None else None
        self._models: dict[str, _Model] = {}

    def __enter__(self) -> "EmbeddedModels":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "EmbeddedModels":
        if not self.repository.is_dir():
            raise ServerError(f"model repository {self.repository} is not a folder: compile models into it first (scorestack compile)")
        names = self.names if self.names is not None else sorted(p.name for p in self.repository.iterdir() if (p / "config.pbtxt").exists())
        for name in names:
            folder = self.repository / name
            if not (folder / "config.pbtxt").exists():
                raise ServerError(f"model {name!r}: {folder}/config.pbtxt not found; models in {self.repository}: "
                                  f"{sorted(p.name for p in self.repository.iterdir() if (p / 'config.pbtxt').exists())}")
            self._models[name] = _Model(name, folder)
        return self

    def stop(self) -> None:
        self._models.clear()

    @property
    def running(self) -> bool:
        return bool(self._models)

    def is_ready(self) -> bool:
        return self.running

    def reference_check(self) -> dict[str, float]:
        """Per loaded model: the largest |Δ| between this process's outputs and the source model's on the reference rows."""
        return {name: m.max_abs_diff for name, m in self._models.items()}

    def _model(self, model: str) -> _Model:
        try:
            return self._models[model]
        except KeyError:
            raise InferenceServerException(f"Request for unknown model: '{model}' is not loaded here (loaded: {sorted(self._models)})", status="NOT_FOUND") from None

    def model_metadata(self, model: str) -> dict:
        return self._model(model).metadata()

    def model_config(self, model: str) -> dict:
        return self._model(model).config

    def infer(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one request now, on this thread: {output name: array}."""
        return self._model(model).infer(inputs, outputs)

    async def infer_within(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str],
                           timeout_s: float) -> dict[str, np.ndarray]:
        """The call signature TritonClient gives every transport besides gRPC. The call runs at once and is not
        interrupted: `timeout_s` (what is left of the deadline, checked by the client before the call) does not bound it."""
        return self._model(model).infer(inputs, outputs)
