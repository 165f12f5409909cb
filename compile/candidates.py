"""The candidates: every variant of the model converted to every registered format, packaged as a
servable version folder, loaded in the verification worker (the server environment's model
runtime) and verified against the source on held-out rows."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from scorestack.serve.worker import RuntimeWorker, WorkerError

from . import emit, registry, verify, vision_passes
from .model import Holdout, SourceModel
from .report import CandidateReport, TritonSettings
from .spec import ModelSpec

def _provisional_settings(spec: ModelSpec, threads: int) -> TritonSettings:
    """Settings for the configs candidates are verified and timed with (threads is what they differ in)."""
    return TritonSettings(
        max_batch_size=spec.serving.max_batch,
        max_queue_delay_us=0,
        default_timeout_us=0,
        max_queue_size=0,
        instance_count=1,
        instance_kind="KIND_CPU",
        threads=threads,
        rules=[],
    )


@dataclass(frozen=True)
class Candidate:
    """One converted, packaged candidate."""

    artifact: registry.Artifact
    version_dir: Path  # a complete, servable version folder (artifact, runtime, SHA256SUMS)
    digests: dict[str, str]
    label: str = ""  # the candidate's name in the report and the worker: its format, "<variant>+<format>", or "dispatch"
    outputs: np.ndarray | None = None  # image models: its verified outputs on every held-out image


def n_outputs(spec: ModelSpec, model: SourceModel) -> int:
    """Columns of the model's output tensor."""
    return int(model.n_classes or 1) if spec.task in ("multiclass", "image-classification") else 1


def worker_key(fmt: str, threads: int) -> str:
    """The name a candidate is loaded under in the worker, per thread count."""
    return f"{fmt}@{threads}"


def load_candidate(worker: RuntimeWorker, spec: ModelSpec, model: SourceModel, cand: Candidate, threads: int) -> float:
    """Load `cand` in the worker with `threads` threads per instance; returns the seconds the load took."""
    cfg = emit.build_config(spec, cand.artifact, _provisional_settings(spec, threads), n_outputs(spec, model))
    return worker.load(worker_key(cand.label or cand.artifact.format, threads), spec.name, cand.version_dir, emit.config_dict(cfg))


def _calibration(spec: ModelSpec, holdout: Holdout) -> np.ndarray | None:
    """Image models: the spec's calibration images, else the first 256 held-out images (the report says which)."""
    if not spec.is_vision:
        return None
    if spec.calibration is not None:
        from .vision import load_images

        return load_images(spec.calibration, spec, spec.name, "calibration", need_labels=False).X
    return holdout.X[:256]


def build_candidates(
    spec: ModelSpec, model: SourceModel, holdout: Holdout, workdir: Path, worker: RuntimeWorker, variants: dict[str, SourceModel] | None = None
) -> tuple[list[CandidateReport], dict[str, Candidate]]:
    """Convert every variant to every registered format, package each as a version folder, and verify it in the worker."""
    variants = variants or {"": model}
    ctx = registry.ConvertContext(
        task=spec.task,
        n_features=spec.n_features,
        target=spec.target,
        sample=holdout.X[: min(64, len(holdout))],
        compile_threads=max(1, min(os.cpu_count() or 1, 4)),
        calibration=_calibration(spec, holdout),
        max_batch_size=spec.serving.max_batch,
        build_budget_s=spec.build_budget_s,
    )
    source_accuracy = verify.accuracy(model.predict(holdout.X), holdout.y) if spec.is_vision and holdout.y is not None else None
    reports: list[CandidateReport] = []
    verified: dict[str, Candidate] = {}
    registered = registry.formats_for(model.family)
    for fmt in spec.formats or []:
        if fmt not in registered:
            reports.append(CandidateReport(format=fmt, status="skipped", reason=f"no {fmt} converter for {model.family} models ({model.description}) (this family can become: {', '.join(registered)})"))
    for variant, vmodel in variants.items():
        reference = vmodel.predict(holdout.X)
        for fmt in registry.formats_for(vmodel.family):
            label = f"{variant}+{fmt}" if variant else fmt
            if spec.formats is not None and fmt not in spec.formats:
                if not variant:
                    reports.append(CandidateReport(format=fmt, status="skipped", reason="not listed in the spec's `formats`"))
                continue
            rep = _candidate(spec, vmodel, variant, label, fmt, holdout, reference, source_accuracy, workdir, worker, ctx, verified)
            if rep is not None:
                reports.append(rep)
    return reports, verified


def _candidate(
    spec: ModelSpec,
    model: SourceModel,
    variant: str,
    label: str,
    fmt: str,
    holdout: Holdout,
    reference: np.ndarray,
    source_accuracy: float | None,
    workdir: Path,
    worker: RuntimeWorker,
    ctx: registry.ConvertContext,
    verified: dict[str, Candidate],
) -> CandidateReport | None:
    """Convert, package, load and verify one candidate; a verified one is added to `verified`."""
    fdir = workdir / label
    fdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        art = registry.converter_for(model.family, fmt)(model, fdir, ctx)
        cand = Candidate(art, fdir / "version", emit.package_version(fdir / "version", art), label)
    except registry.Skip as exc:
        # A skipped format is reported once, for the source model, not again for each variant.
        return None if variant else CandidateReport(format=label, status="skipped", reason=str(exc), convert_s=round(time.perf_counter() - t0, 3))
    except Exception as exc:  # a converter's failure rejects that candidate, not the compile
        return CandidateReport(format=label, status="failed", variant=variant or None, reason=f"conversion failed: {type(exc).__name__}: {exc}"[:500], convert_s=round(time.perf_counter() - t0, 3))
    rep = CandidateReport(
        format=label,
        status="rejected",
        runtime=art.runtime,
        backend=art.backend,
        artifact=art.artifact_name,
        artifact_bytes=art.path.stat().st_size,
        convert_s=round(time.perf_counter() - t0, 3),
        notes=art.notes,
    )
    try:
        rep.load_s = round(load_candidate(worker, spec, model, cand, spec.threads[0]), 3)
    except WorkerError as exc:
        rep.reason = f"does not load in the server environment: {exc}"[:700]
        return rep
    key = worker_key(label, spec.threads[0])
    execute = lambda X, sizes: worker.execute(key, X, sizes)
    t_verify = time.perf_counter()
    if spec.is_vision and source_accuracy is not None:
        v = verify.verify_images(
            execute, reference, holdout, exact=art.exact, tolerance=spec.verification.tolerance, source_accuracy=source_accuracy,
            accuracy_budget=spec.verification.accuracy_budget, sample_rows=spec.verification.sample_rows,
        )
        rep.variant = variant or None
        rep.accuracy, rep.argmax_agreement = v.accuracy, v.argmax_agreement
        rep.accuracy_drop = None if v.accuracy is None else round(source_accuracy - v.accuracy, 6)
        rep.parameters = vision_passes.parameters(model.model) if model.family == "torch-vision" else None
        cand = replace(cand, outputs=v.outputs)
    else:
        v = verify.verify(execute, reference, holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows, spec.relative_tolerance)
    rep.verify_s = round(time.perf_counter() - t_verify, 3)
    rep.verified, rep.max_abs_diff = v.verified, v.max_abs_diff
    rep.label_agreement, rep.rank_agreement = v.label_agreement, v.rank_agreement
    rep.rows_batch1, rep.rows_large = v.rows_batch1, v.rows_large
    if v.verified:
        rep.status = "verified"
        verified[label] = cand
    else:
        rep.reason = f"verification failed: {v.reason}"
        worker.unload(key)
    return rep
