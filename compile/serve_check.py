"""The serving check: the emitted model folder, loaded in the real local Triton and queried over gRPC.

Runs after emit and before the new version joins the repository: a model that verifies but does not
serve (an artifact the Python backend cannot import, a config Triton refuses) never replaces one that does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from scorestack.errors import ScorestackError

from .model import Holdout
from .report import ServeCheckReport
from .verify import label_agreement, miss_text, needed_relative, needed_tolerance, sample_indices

REJECTION_RETRIES = 5
BATCH1_ROWS = 16  # rows sent one per request; the rest go in requests of max_batch_size rows


def check_served(
    repository: Path,
    name: str,
    predict: Callable[[np.ndarray], np.ndarray],
    holdout: Holdout,
    task: str,
    tolerance: float,
    rows: int = 512,
    ready_timeout_s: float = 120.0,
    request_sizes: list[int] | None = None,
    relative: float = 0.0,
) -> ServeCheckReport:
    """Start a local Triton on `repository` with only `name`, send held-out rows over gRPC, compare with `predict`.

    `request_sizes`: also send one request of each of these sizes (a dispatch's band edges), so
    every format the model holds answers through Triton."""
    from scorestack.serve import LocalTriton

    X = holdout.X[sample_indices(len(holdout), rows)]
    sent = np.concatenate([X] + [holdout.X[np.arange(n) % len(holdout.X)] for n in request_sizes or []])
    want = predict(sent).reshape(len(sent), -1)
    try:
        # Stopped only after every request of the check is answered: no drain to wait for.
        with LocalTriton(repository, models=[name], ready_timeout_s=ready_timeout_s, exit_timeout_s=0) as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                cfg = client.get_model_config(name, client_timeout=30).config
                chunks = _chunks(X, int(cfg.max_batch_size) or 1)
                for n in request_sizes or []:
                    chunks.append(holdout.X[np.arange(n) % len(holdout.X)])
                got = np.concatenate([_infer(client, name, cfg, chunk) for chunk in chunks])
            finally:
                client.close()
    except ScorestackError as exc:
        return ServeCheckReport(status="failed", reason=str(exc).split("\n--- log tail")[0][:1500])
    except Exception as exc:  # a gRPC error is the reason the check failed
        return ServeCheckReport(status="failed", reason=f"inference over gRPC failed: {type(exc).__name__}: {exc}"[:1500])
    got = got.reshape(len(sent), -1).astype(np.float64)
    if got.shape != want.shape:
        return ServeCheckReport(status="failed", rows=len(sent), reason=f"served output shape {got.shape}, expected {want.shape}")
    diff = float(np.abs(got - want).max())
    need = needed_tolerance(want, got, relative)
    if not np.isfinite(got).all() or need > tolerance:
        return ServeCheckReport(status="failed", rows=len(sent), max_abs_diff=diff, reason=f"served outputs differ from the source model: {miss_text(diff, need, tolerance, relative, needed_relative(want, got, tolerance))}")
    labels = label_agreement(task, want, got, tolerance) if task == "image-classification" else None
    if labels is not None and labels < 1.0:
        return ServeCheckReport(status="failed", rows=len(sent), max_abs_diff=diff, label_agreement=labels, reason=f"served top classes differ from the verified ones on {1 - labels:.2%} of the images")
    return ServeCheckReport(status="passed", rows=len(sent), max_abs_diff=diff, label_agreement=labels)


def _chunks(X: np.ndarray, max_batch: int) -> list[np.ndarray]:
    head = [X[i : i + 1] for i in range(min(BATCH1_ROWS, len(X)))]
    rest = X[len(head) :]
    return head + [rest[i : i + max_batch] for i in range(0, len(rest), max_batch)]


def _infer(client: grpcclient.InferenceServerClient, name: str, cfg, x: np.ndarray) -> np.ndarray:
    # The config's data type (FP32 features, UINT8 images): the wire format clients use.
    datatype = mc.DataType.Name(cfg.input[0].data_type).removeprefix("TYPE_")
    tensor = grpcclient.InferInput(cfg.input[0].name, list(x.shape), datatype)
    tensor.set_data_from_numpy(np.ascontiguousarray(x, dtype=triton_to_np_dtype(datatype)))
    for attempt in range(REJECTION_RETRIES + 1):
        try:
            return client.infer(name, [tensor], client_timeout=60).as_numpy(cfg.output[0].name)
        except InferenceServerException as exc:
            # The queue policy shedding load on a busy machine says nothing about the model: try again.
            if "Request timeout expired" not in str(exc) or attempt == REJECTION_RETRIES:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")
