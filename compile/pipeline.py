"""compile_model: load → optimize → convert → verify → measure → select → emit, for one spec.

The steps live beside it: the candidates (candidates.py), their timing, dispatch and selection
(selection.py), and the model's versions in the repository (versions.py); this module applies the
passes and runs the steps in order, in a staging folder, up to the serving check and the install.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from scorestack.errors import PlatformError, ScorestackError, VerificationError
from scorestack.paths import default_repository
from scorestack.serve import ensure_server_environment, native
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.serve.worker import RuntimeWorker, project_python_worker

from . import dispatch, emit, passes, tune, vision_passes
from .candidates import Candidate, build_candidates, n_outputs
from .loaders import load_holdout, load_source
from .model import Holdout, SourceModel
from .profile import profile_for
from .report import CompileReport, PassReport, ServeCheckReport, build_report, render_markdown
from .selection import dispatch_candidate, select_served, time_candidates
from .serve_check import check_served
from .spec import ModelSpec, load_spec
from .versions import COMPILER_VERSION, content_hash, install, previous_report, to_retire, versions

def _omp_threads() -> int:
    """OMP_NUM_THREADS as a cap on threads (unset or unreadable: no cap)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "") or 1 << 30))
    except ValueError:
        return 1 << 30


def _apply_passes(spec: ModelSpec, source: SourceModel, holdout: Holdout, threads: int) -> tuple[SourceModel, list[PassReport], dict[str, SourceModel]]:
    """The lossy passes. Returns the model the candidates come from, the pass reports, and the variants:
    tabular passes replace the model (one variant); an image model's pruned and distilled versions are
    variants beside the source, each converted to every format and selected by measurement."""
    reports: list[PassReport] = []
    model = source
    opt = spec.optimization
    if spec.is_vision:
        return source, *_vision_variants(spec, source, holdout, threads)
    if opt.pruning is not None and opt.pruning.enabled:
        model, res = passes.prune(model, holdout, opt.pruning)
        reports.append(res)
    if opt.distillation is not None and opt.distillation.enabled:
        train = None
        if opt.distillation.train_rows is not None:
            train = load_holdout(opt.distillation.train_rows, spec, spec.name, "optimization.distillation.train_rows")
        model, res = passes.distill(model, holdout, opt.distillation, train, threads=threads)
        reports.append(res)
    return model, reports, {"": model}


def _vision_variants(spec: ModelSpec, source: SourceModel, holdout: Holdout, threads: int) -> tuple[list[PassReport], dict[str, SourceModel]]:
    from .vision import load_images

    opt, budget = spec.optimization, spec.verification.accuracy_budget
    train = load_images(spec.train_images, spec, spec.name, "train_images") if spec.train_images is not None else None
    reports: list[PassReport] = []
    variants = {"": source}
    if opt.channel_pruning is not None and opt.channel_pruning.enabled:
        pruned, res = vision_passes.prune_channels(source, holdout, train, opt.channel_pruning, budget, threads)
        reports.append(res)
        if pruned is not None and res.accepted:
            variants["pruned"] = pruned
    if opt.student is not None and opt.student.enabled:
        student, res = vision_passes.distill_student(source, holdout, train, opt.student, budget, threads)
        reports.append(res)
        if student is not None and res.accepted:
            variants["distilled"] = student
    return reports, variants


def _lookup(X: np.ndarray, outputs: np.ndarray):  # -> Callable[[np.ndarray], np.ndarray]
    """A `predict` that returns a candidate's recorded outputs for rows of X (matched by content)."""
    index = {row.tobytes(): i for i, row in enumerate(X)}
    return lambda rows: outputs[[index[r.tobytes()] for r in rows]]


REFERENCE_ROWS = 64


def write_reference(version_dir: Path, spec: ModelSpec, model: SourceModel, holdout: Holdout) -> None:
    """The version folder's reference (rt.REFERENCE): up to REFERENCE_ROWS held-out rows, the source model's outputs
    on them and the spec's tolerances, for a process that runs the artifact outside the server environment (the
    embedded transport, scorestack.serve.embedded) to check it there before it answers."""
    X = holdout.X[: REFERENCE_ROWS]
    expected = np.asarray(model.predict(X), dtype=np.float64).reshape(len(X), -1)
    with open(version_dir / rt.REFERENCE, "wb") as fh:
        np.savez(fh, X=X, expected=expected, tolerance=np.float64(spec.verification.tolerance),
                 relative=np.float64(spec.relative_tolerance), task=np.str_(spec.task))


def _worker() -> tuple[RuntimeWorker, str]:
    """The verification worker in the server environment; this environment only where none can exist (reported)."""
    try:
        return RuntimeWorker(ensure_server_environment()), "the server environment"
    except PlatformError as exc:
        return project_python_worker(), f"the project environment (no local server environment here: {exc})"


def _serve_check(spec: ModelSpec, model: SourceModel, holdout: Holdout, chosen: Candidate, folder: Path) -> ServeCheckReport:
    """Load the staged model folder in the real local Triton and check it over gRPC (compile/serve_check.py)."""
    art = chosen.artifact
    if spec.is_vision and chosen.outputs is not None:
        # What Triton serves must be what was verified: the selected candidate's own outputs
        # in the server environment (an INT8 model is compared with itself, not with fp32).
        return check_served(folder.parent, spec.name, _lookup(holdout.X, chosen.outputs), holdout, spec.task, spec.verification.tolerance, rows=len(holdout), relative=spec.relative_tolerance)
    edge_sizes = sorted({n for b in art.bands for n in (b.min_rows, b.max_rows)})
    return check_served(folder.parent, spec.name, model.predict, holdout, spec.task, spec.verification.tolerance, request_sizes=edge_sizes, relative=spec.relative_tolerance)


def _measured_batching(spec: ModelSpec, art, settings, n_out: int, native_plan, folder: Path, version: int, holdout: Holdout, serve_check: bool):
    """serving.batching auto: the derived dynamic batching and no batching measured side by side in the local
    Triton (compile/tune.py); the settings and config to emit."""
    if not serve_check or settings.instance_kind != "KIND_CPU":
        why = "--no-serve-check: no local Triton to measure in" if not serve_check else "GPU instances: one per device, the batcher forms the GPU's batches"
        settings = settings.model_copy(update={"rules": [*settings.rules, f"serving.batching auto: not measured ({why}); the dynamic batching stays."]})
        return settings, emit.write_config(folder, emit.build_config(spec, art, settings, n_out, native_plan=native_plan))
    running = settings.instance_count // emit.POLICY_INSTANCE_FACTOR if settings.queue_policy else settings.instance_count
    without = emit.without_batching(settings, max(1, running), "serving.batching auto, measured below")
    configs = {label: emit.build_config(spec, art, s, n_out, native_plan=native_plan) for label, s in (("dynamic batching", settings), ("no batching", without))}
    try:
        measured = tune.measure_batching(folder / str(version), spec.name, configs, holdout.X, spec.serving.concurrency)
    except ScorestackError as exc:  # the serving check that follows says whether the model serves at all
        reason = str(exc).split("\n")[0][:300]
        settings = settings.model_copy(update={"rules": [*settings.rules, f"serving.batching auto: the measurement failed ({reason}); the dynamic batching stays."]})
    else:
        settings = tune.settle(settings, without, measured)
    return settings, emit.write_config(folder, emit.build_config(spec, art, settings, n_out, native_plan=native_plan))


class _Stopwatch:
    """Seconds per compile phase (the report's phases_s); a phase lapped twice adds up."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.t, 3)
        self.t = now


def compile_model(
    spec_path: str | Path,
    repository: str | Path | None = None,
    force: bool = False,
    serve_check: bool = True,
    batch_profile: str | Path | None = None,
) -> CompileReport:
    """Compile one spec into a new version of `<repository>/<name>/` (config.pbtxt, <version>/, report.json, report.md).

    Every candidate is loaded, verified and timed in the server environment through the model
    runtime; the selected one is then loaded in the real local Triton and queried over gRPC
    (`serve_check`) before it is added to the repository, so a model that does not serve never
    replaces one that does. An unchanged spec + source + held-out rows is not recompiled unless
    `force`; the previous report is returned with `skipped=True`. Raises SpecError for an invalid
    spec or unloadable source and VerificationError when no candidate reproduces the model or the
    serving check fails.

    Candidates are timed on every power of two up to the model's max_batch_size (the batch sizes the
    dynamic batcher may form); where different formats win different sizes, the emitted version
    holds them all with a table from batch size to format (compile/dispatch.py). `batch_profile`:
    Triton's statistics JSON of the served model; its executed batch sizes replace the spec's
    weights, and its batching behaviour re-derives the queue delay.
    """
    started = time.perf_counter()
    clock = _Stopwatch()
    spec_path = Path(spec_path).resolve()
    spec = load_spec(spec_path)
    repository = Path(repository) if repository is not None else default_repository()
    repository = repository.resolve()
    dest = repository / spec.name
    profile = profile_for(batch_profile, spec.name) if batch_profile is not None else None
    digest = content_hash(spec_path, spec, profile)
    if not force:
        prev = previous_report(dest, digest)
        if prev is not None:
            return prev.model_copy(update={"skipped": True})

    source = load_source(spec, spec_path.name)
    holdout = load_holdout(spec.holdout, spec, spec_path.name)
    # The CPUs this process may run on, not the machine's count: a compile confined with taskset or a
    # container's CPU set trains its passes with no more threads than it has cores.
    # OMP_NUM_THREADS, when set, caps it as it caps the libraries' own thread pools.
    threads_for_training = max(1, min(len(os.sched_getaffinity(0)), 4, _omp_threads()))
    clock.lap("load")
    model, pass_reports, variants = _apply_passes(spec, source, holdout, threads_for_training)
    clock.lap("passes")

    staging_root = repository.parent / f".{repository.name}.staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=staging_root))
    worker, where = _worker()
    try:
        with worker:
            clock.lap("worker")
            reports, candidates = build_candidates(spec, model, holdout, staging / "candidates", worker, variants)
            clock.lap("candidates")
            if not candidates:
                why = "; ".join(f"{r.format}: {r.reason}" for r in reports)
                raise VerificationError(f"model {spec.name}: no candidate reproduces the model ({why})")
            sizes = dispatch.grid(spec.serving.max_batch, tuple(spec.serving.batch_sizes))
            weights = profile.weights(sizes) if profile is not None else spec.serving.weights()
            curves = time_candidates(spec, model, holdout, reports, candidates, worker, sizes, weights)
            clock.lap("timing")
            dispatch_report, dispatched, dispatch_threads = None, None, 0
            # Image models: candidates are lossy variants checked against a budget, not a tolerance, so
            # bands mixing them could not be verified at the band edges; one format serves every size.
            if spec.serving.dispatch and len(candidates) > 1 and not spec.is_vision:
                dispatch_report, dispatched, dispatch_threads = dispatch_candidate(spec, model, holdout, curves, candidates, weights, staging / "dispatch", worker)
            verified_in = dict(worker.info, kind=where)
            clock.lap("dispatch")
        chosen, selected = select_served(reports, candidates, dispatch_report, dispatched, dispatch_threads)
        art = chosen.artifact
        cpus = os.cpu_count() or 1
        lat = {int(b): v for b, v in selected.latency_us.items()}
        settings = emit.derive_settings(spec, lat, selected.threads, cpus, gpu=art.backend == "tensorrt" or art.format == "onnx-tensorrt", profile=profile)
        existing = versions(dest)
        version = max(existing, default=0) + 1
        folder = staging / "repository" / spec.name
        shutil.copytree(chosen.version_dir, folder / str(version), symlinks=False)
        digests = chosen.digests
        native_plan, backend_rule = emit.native_backend(spec, art, settings)
        settings.rules.append(backend_rule)
        if native_plan is not None:
            shutil.copy2(native.library(), folder / str(version) / native.LIBRARY)
            selected.backend = native.BACKEND
        if not spec.is_vision:
            write_reference(folder / str(version), spec, model, holdout)
        if native_plan is not None or not spec.is_vision:
            digests = rt.write_manifest(str(folder / str(version)))
        cfg = emit.write_config(folder, emit.build_config(spec, art, settings, n_outputs(spec, model), native_plan=native_plan))
        clock.lap("emit")
        if spec.serving.batching == "auto":
            settings, cfg = _measured_batching(spec, art, settings, n_outputs(spec, model), native_plan, folder, version, holdout, serve_check)
            clock.lap("batching")
        report = build_report(
            spec, spec_path, source, model, holdout,
            content_hash=digest, compiler_version=COMPILER_VERSION, sizes=sizes, weights=weights, passes=pass_reports,
            candidates=reports, selected=selected, dispatch=dispatch_report, profile=profile, batch_profile=batch_profile,
            settings=settings, config=cfg, dest=dest, version=version, digests=digests, verified_in=verified_in,
        )  # fmt: skip
        clock.lap("emit")
        if serve_check:
            report.serve_check = _serve_check(spec, model, holdout, chosen, folder)
            clock.lap("serve_check")
            if report.serve_check.status != "passed":
                previous = f"version {existing[-1]} stays in place" if existing else "nothing was written"
                raise VerificationError(
                    f"model {spec.name}: the {selected.format} artifact verified in the server environment but failed the serving check "
                    f"in the local Triton: {report.serve_check.reason}; {previous}"
                )
        else:
            report.serve_check = ServeCheckReport(status="skipped", reason="--no-serve-check")
        report.retired = to_retire(dest, cfg, repository, version)
        clock.lap("emit")
        report.phases_s = clock.phases
        report.duration_s = round(time.perf_counter() - started, 2)
        (folder / "report.json").write_text(report.model_dump_json(indent=2))
        (folder / "report.md").write_text(render_markdown(report))
        install(folder, dest, version, spec.serving.keep_versions, report.retired)
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging_root.rmdir()
        except OSError:
            pass
