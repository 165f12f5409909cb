"""compile_model: load → optimize → convert → verify → measure → select → emit, for one spec."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from scorestack.errors import PlatformError, VerificationError
from scorestack.paths import default_repository
from scorestack.triton_config import load_config
from scorestack.serve import ensure_server_environment, native
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.serve.worker import RuntimeWorker, WorkerError, project_python_worker

from . import dispatch, emit, measure, passes, registry, verify, vision_passes
from .loaders import load_holdout, load_source
from .model import Holdout, SourceModel
from .profile import BatchProfile, profile_for
from .report import CandidateReport, CompileReport, DispatchReport, PassReport, RetiredVersion, SelectedReport, ServeCheckReport, TritonSettings, build_report, render_markdown
from .serve_check import check_served
from .spec import ModelSpec, load_spec

COMPILER_VERSION = "scorestack-compile 8"  # 2: measured on a batch-size grid, per-batch-size dispatch; 3: no queue delay (a lone request runs at once); 4: the tree kernel, timed on distinct rows; 5: the native backend; 6: serving.queue_policy (on by default) recorded in the report; 7: recompiles what an intermediate 6 compiled without the policy; 8: with the queue policy, twice the instances that run at once


def content_hash(spec_path: Path, spec: ModelSpec, profile: BatchProfile | None = None) -> str:
    """Hash of everything a compile depends on: spec text, source model, held-out rows, batch profile, compiler version."""
    h = hashlib.sha256(COMPILER_VERSION.encode())
    if profile is not None:
        h.update(repr((sorted(profile.executions.items()), profile.requests, profile.rows)).encode())
    files = [spec_path, spec.source.path, spec.holdout, *(p for p in (spec.calibration, spec.train_images) if p is not None)]
    dist = spec.optimization.distillation
    if dist is not None and dist.train_rows is not None:
        files.append(dist.train_rows)
    for f in files:
        h.update(str(f.name).encode())
        try:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()


def _previous(dest: Path, digest: str) -> CompileReport | None:
    report = dest / "report.json"
    if not (report.exists() and (dest / "config.pbtxt").exists()):
        return None
    try:
        prev = CompileReport.model_validate_json(report.read_text())
    except ValueError:
        return None
    return prev if prev.content_hash == digest else None


def versions(model_dir: Path) -> list[int]:
    """Version folders of a model in the repository, oldest first."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


# The parts of a config that bind a version's files: which runtime reads which artifact, and the
# tensors. Versions compiled under a config that differs in these cannot be served under the new one.
_BINDING_PARAMS = (rt.PARAM_RUNTIME, rt.PARAM_ARTIFACT, rt.PARAM_DISPATCH, rt.PARAM_OUTPUT_COLUMN, rt.PARAM_METHOD)


def _binding(cfg) -> dict[str, object]:
    out: dict[str, object] = {
        "backend": cfg.backend or cfg.platform,
        "default_model_filename": cfg.default_model_filename,
        "batching": cfg.max_batch_size > 0,
        "tensors": [(t.name, t.data_type, list(t.dims)) for t in (*cfg.input, *cfg.output)],
    }
    out.update({k: cfg.parameters[k].string_value for k in _BINDING_PARAMS if k in cfg.parameters})
    return out


def retired_root(repository: Path) -> Path:
    """Where versions a new config cannot serve are kept, beside (not in) the repository Triton reads."""
    return repository.parent / f".{repository.name}.retired"


def _to_retire(dest: Path, new_cfg, repository: Path, version: int) -> list[RetiredVersion]:
    """The versions in `dest` that the new config cannot serve (Triton applies one config.pbtxt to
    every version it loads: an older version of another format would fail to load, and with it the model)."""
    old_config = dest / "config.pbtxt"
    existing = versions(dest)
    if not existing or not old_config.is_file():
        return []
    try:
        old = load_config(old_config)
    except Exception as exc:  # an unreadable config binds nothing we can check
        why = f"its config.pbtxt could not be read ({exc})"
    else:
        before, after = _binding(old), _binding(new_cfg)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if not differ:
            return []
        why = f"the new version {version}'s config.pbtxt differs in {', '.join(differ)}, and Triton serves every version with that one config"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return [RetiredVersion(version=v, reason=why, moved_to=str(retired_root(repository) / dest.name / f"{v}-{stamp}")) for v in existing]


def _install(staged: Path, dest: Path, version: int, keep: int, retire: list[RetiredVersion] = ()) -> None:
    """Add the staged version to `dest` with renames only (a reader never sees a half-written model),
    move the versions the new config cannot serve out of the repository (each with the config that
    served it, a model folder of its own that can be put back), then drop versions beyond the newest `keep`."""
    dest.mkdir(parents=True, exist_ok=True)
    for r in retire:  # first: the new version never meets an old one under either config
        target = Path(r.moved_to)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dest / "config.pbtxt", target / "config.pbtxt")
        os.rename(dest / str(r.version), target / str(r.version))
    os.rename(staged / str(version), dest / str(version))
    for name in ("config.pbtxt", "report.json", "report.md"):
        os.replace(staged / name, dest / name)
    for old in versions(dest)[:-keep]:
        shutil.rmtree(dest / str(old), ignore_errors=True)
    if retire:
        folder = retired_root(dest.parent) / dest.name
        old_ones = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime)
        for stale in old_ones[:-keep]:  # as many retired versions as served ones
            shutil.rmtree(stale, ignore_errors=True)


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
class _Candidate:
    artifact: registry.Artifact
    version_dir: Path  # a complete, servable version folder (artifact, runtime, SHA256SUMS)
    digests: dict[str, str]
    label: str = ""  # the candidate's name in the report and the worker: its format, "<variant>+<format>", or "dispatch"
    outputs: np.ndarray | None = None  # image models: its verified outputs on every held-out image


def _n_outputs(spec: ModelSpec, model: SourceModel) -> int:
    return int(model.n_classes or 1) if spec.task in ("multiclass", "image-classification") else 1


def _key(fmt: str, threads: int) -> str:
    return f"{fmt}@{threads}"


def _load(worker: RuntimeWorker, spec: ModelSpec, model: SourceModel, cand: _Candidate, threads: int) -> float:
    cfg = emit.build_config(spec, cand.artifact, _provisional_settings(spec, threads), _n_outputs(spec, model))
    return worker.load(_key(cand.label or cand.artifact.format, threads), spec.name, cand.version_dir, emit.config_dict(cfg))


def _calibration(spec: ModelSpec, holdout: Holdout) -> np.ndarray | None:
    """Image models: the spec's calibration images, else the first 256 held-out images (the report says which)."""
    if not spec.is_vision:
        return None
    if spec.calibration is not None:
        from .vision import load_images

        return load_images(spec.calibration, spec, spec.name, "calibration", need_labels=False).X
    return holdout.X[:256]


def _candidates(
    spec: ModelSpec, model: SourceModel, holdout: Holdout, workdir: Path, worker: RuntimeWorker, variants: dict[str, SourceModel] | None = None
) -> tuple[list[CandidateReport], dict[str, _Candidate]]:
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
    )
    source_accuracy = verify.accuracy(model.predict(holdout.X), holdout.y) if spec.is_vision and holdout.y is not None else None
    reports: list[CandidateReport] = []
    verified: dict[str, _Candidate] = {}
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
    verified: dict[str, _Candidate],
) -> CandidateReport | None:
    """Convert, package, load and verify one candidate; a verified one is added to `verified`."""
    fdir = workdir / label
    fdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        art = registry.converter_for(model.family, fmt)(model, fdir, ctx)
        cand = _Candidate(art, fdir / "version", emit.package_version(fdir / "version", art), label)
    except registry.Skip as exc:
        # A skipped format is reported once, for the source model, not again for each variant.
        return None if variant else CandidateReport(format=label, status="skipped", reason=str(exc))
    except Exception as exc:  # a converter's failure rejects that candidate, not the compile
        return CandidateReport(format=label, status="failed", variant=variant or None, reason=f"conversion failed: {type(exc).__name__}: {exc}"[:500], convert_s=time.perf_counter() - t0)
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
        rep.load_s = round(_load(worker, spec, model, cand, spec.threads[0]), 3)
    except WorkerError as exc:
        rep.reason = f"does not load in the server environment: {exc}"[:700]
        return rep
    key = _key(label, spec.threads[0])
    execute = lambda X, sizes: worker.execute(key, X, sizes)
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
        v = verify.verify(execute, reference, holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows)
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


def _time_candidates(
    spec: ModelSpec,
    model: SourceModel,
    holdout: Holdout,
    reports: list[CandidateReport],
    candidates: dict[str, _Candidate],
    worker: RuntimeWorker,
    sizes: tuple[int, ...],
    weights: dict[int, float],
) -> dict[int, dict[str, dict[int, float]]]:
    """Time every verified candidate at every thread count and batch size of the grid in the worker, interleaved.

    Returns threads -> format -> batch size -> µs per call."""
    keys = {}
    for fmt, cand in candidates.items():
        for t in spec.threads:
            if _key(fmt, t) not in worker.loaded:
                _load(worker, spec, model, cand, t)
            keys[_key(fmt, t)] = (fmt, t)
    plan = measure.TimingPlan(batch_sizes=sizes)
    table = worker.measure(
        list(keys), holdout.X, list(plan.batch_sizes), rounds=plan.rounds, cell_budget_s=plan.cell_budget_s, max_calls=plan.max_calls, min_calls=plan.min_calls
    )
    for rep in reports:
        if rep.format not in candidates:
            continue
        per_t = {t: table[_key(rep.format, t)] for t in spec.threads}
        best_t = measure.choose_threads(per_t, weights, os.cpu_count() or 1, emit.MAX_INSTANCES)
        rep.threads = best_t
        rep.latency_us = {str(b): round(v, 2) for b, v in per_t[best_t].items()}
        rep.latency_us_by_threads = {str(t): {str(b): round(v, 2) for b, v in lat.items()} for t, lat in per_t.items()}
        rep.weighted_latency_us = round(measure.weighted_latency(per_t[best_t], weights), 2)
    return {t: {fmt: table[_key(fmt, t)] for fmt in candidates} for t in spec.threads}


def _dispatch(
    spec: ModelSpec,
    model: SourceModel,
    holdout: Holdout,
    curves_by_threads: dict[int, dict[str, dict[int, float]]],
    candidates: dict[str, _Candidate],
    weights: dict[int, float],
    workdir: Path,
    worker: RuntimeWorker,
) -> tuple[DispatchReport, _Candidate | None, int]:
    """Plan bands from the measured curves; when several formats win, package, verify and time the dispatch.

    Returns the report, the dispatch candidate (None when one format serves every batch size or the
    dispatch was not verified) and its thread count."""
    # Threads for the dispatch: chosen on the fastest-format-per-size curve, with the instances they leave.
    pointwise = {t: {b: min(c[b] for c in curves.values()) for b in next(iter(curves.values()))} for t, curves in curves_by_threads.items()}
    threads = measure.choose_threads(pointwise, weights, os.cpu_count() or 1, emit.MAX_INSTANCES)
    curves = curves_by_threads[threads]
    plan = dispatch.plan_bands(curves, weights)
    rep = DispatchReport(
        threads=threads,
        grid=sorted(next(iter(curves.values()))),
        curves_us={fmt: {str(b): round(v, 2) for b, v in sorted(c.items())} for fmt, c in curves.items()},
        bands=[{"format": b.format, "min_rows": b.min_rows, "max_rows": b.max_rows} for b in plan.bands],
        decision=plan.reason,
        status="single",
    )
    if len(plan.bands) == 1:
        return rep, None, threads
    art, digests = dispatch.package_dispatch(workdir / "version", plan, {f: c.artifact for f, c in candidates.items()})
    cand = _Candidate(art, workdir / "version", digests, "dispatch")
    key = _key("dispatch", threads)
    try:
        _load(worker, spec, model, cand, threads)
    except WorkerError as exc:
        rep.status, rep.reason = "rejected", f"does not load in the server environment: {exc}"[:700]
        return rep, None, threads
    def execute(X, sizes):
        return worker.execute(key, X, sizes)

    v = verify.verify(execute, model.predict(holdout.X), holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows)
    edges = verify.verify_bands(execute, model.predict, holdout, [(b.min_rows, b.max_rows) for b in plan.bands], spec.task, spec.verification.tolerance)
    diffs = [d for d in (v.max_abs_diff, edges.max_abs_diff) if d is not None]
    rep.max_abs_diff = max(diffs) if diffs else None
    rep.edge_sizes = edges.sizes
    if not (v.verified and edges.verified):
        rep.status = "rejected"
        rep.reason = "verification failed: " + "; ".join(r for r in (v.reason, edges.reason) if r)
        worker.unload(key)
        return rep, None, threads
    # The dispatch timed side by side with its band formats, interleaved, so the report compares like with like.
    members = {b.format: _key(b.format, threads) for b in plan.bands}
    t = measure.TimingPlan(batch_sizes=tuple(rep.grid))
    table = worker.measure([key, *members.values()], holdout.X, rep.grid, rounds=t.rounds, cell_budget_s=t.cell_budget_s, max_calls=t.max_calls, min_calls=t.min_calls)
    measured = table[key]
    rep.measured_us = {label: {str(b): round(v_, 2) for b, v_ in sorted(table[k].items())} for label, k in {"dispatch": key, **members}.items()}
    rep.weighted_latency_us = round(measure.weighted_latency(measured, weights), 2)
    rep.status = "selected"
    return rep, cand, threads


def _lookup(X: np.ndarray, outputs: np.ndarray):  # -> Callable[[np.ndarray], np.ndarray]
    """A `predict` that returns a candidate's recorded outputs for rows of X (matched by content)."""
    index = {row.tobytes(): i for i, row in enumerate(X)}
    return lambda rows: outputs[[index[r.tobytes()] for r in rows]]


def _worker() -> tuple[RuntimeWorker, str]:
    """The verification worker in the server environment; this environment only where none can exist (reported)."""
    try:
        return RuntimeWorker(ensure_server_environment()), "the server environment"
    except PlatformError as exc:
        return project_python_worker(), f"the project environment (no local server environment here: {exc})"


def _select(
    reports: list[CandidateReport],
    candidates: dict[str, _Candidate],
    dispatch_report: DispatchReport | None,
    dispatched: _Candidate | None,
    dispatch_threads: int,
) -> tuple[_Candidate, SelectedReport]:
    """The served candidate: the verified dispatch when there is one, else the single format with the
    lowest weighted latency. Marks the chosen candidates' reports `selected`."""
    if dispatched is not None and dispatch_report is not None:
        selected = SelectedReport(
            format="dispatch",
            runtime=rt.DISPATCH,
            backend="python",
            artifact=dispatched.artifact.artifact_name,
            artifacts=list(dict.fromkeys(b.artifact for b in dispatched.artifact.bands)),
            threads=dispatch_threads,
            weighted_latency_us=dispatch_report.weighted_latency_us or 0.0,
            latency_us=dispatch_report.measured_us["dispatch"],
        )
        for r in reports:
            if r.format in {b.format for b in dispatched.artifact.bands}:
                r.status = "selected"
        return dispatched, selected
    best = min((r for r in reports if r.format in candidates), key=lambda r: r.weighted_latency_us or float("inf"))
    best.status = "selected"
    chosen = candidates[best.format]
    return chosen, SelectedReport(
        format=best.format,
        runtime=chosen.artifact.runtime,
        backend=chosen.artifact.backend,
        artifact=chosen.artifact.artifact_name,
        artifacts=[chosen.artifact.artifact_name],
        threads=best.threads or 1,
        weighted_latency_us=best.weighted_latency_us or 0.0,
        latency_us=best.latency_us,
        output_column=chosen.artifact.output_column,
        method=chosen.artifact.method,
    )


def _serve_check(spec: ModelSpec, model: SourceModel, holdout: Holdout, chosen: _Candidate, folder: Path) -> ServeCheckReport:
    """Load the staged model folder in the real local Triton and check it over gRPC (compile/serve_check.py)."""
    art = chosen.artifact
    if spec.is_vision and chosen.outputs is not None:
        # What Triton serves must be what was verified: the selected candidate's own outputs
        # in the server environment (an INT8 model is compared with itself, not with fp32).
        return check_served(folder.parent, spec.name, _lookup(holdout.X, chosen.outputs), holdout, spec.task, spec.verification.tolerance, rows=len(holdout))
    edge_sizes = sorted({n for b in art.bands for n in (b.min_rows, b.max_rows)})
    return check_served(folder.parent, spec.name, model.predict, holdout, spec.task, spec.verification.tolerance, request_sizes=edge_sizes)


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
    spec_path = Path(spec_path).resolve()
    spec = load_spec(spec_path)
    repository = Path(repository) if repository is not None else default_repository()
    repository = repository.resolve()
    dest = repository / spec.name
    profile = profile_for(batch_profile, spec.name) if batch_profile is not None else None
    digest = content_hash(spec_path, spec, profile)
    if not force:
        prev = _previous(dest, digest)
        if prev is not None:
            return prev.model_copy(update={"skipped": True})

    source = load_source(spec, spec_path.name)
    holdout = load_holdout(spec.holdout, spec, spec_path.name)
    # The CPUs this process may run on, not the machine's count: a compile confined with taskset or a
    # container's CPU set trains its passes with no more threads than it has cores.
    # OMP_NUM_THREADS, when set, caps it as it caps the libraries' own thread pools.
    threads_for_training = max(1, min(len(os.sched_getaffinity(0)), 4, _omp_threads()))
    model, pass_reports, variants = _apply_passes(spec, source, holdout, threads_for_training)

    staging_root = repository.parent / f".{repository.name}.staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=staging_root))
    worker, where = _worker()
    try:
        with worker:
            reports, candidates = _candidates(spec, model, holdout, staging / "candidates", worker, variants)
            if not candidates:
                why = "; ".join(f"{r.format}: {r.reason}" for r in reports)
                raise VerificationError(f"model {spec.name}: no candidate reproduces the model ({why})")
            sizes = dispatch.grid(spec.serving.max_batch, tuple(spec.serving.batch_sizes))
            weights = profile.weights(sizes) if profile is not None else spec.serving.weights()
            curves = _time_candidates(spec, model, holdout, reports, candidates, worker, sizes, weights)
            dispatch_report, dispatched, dispatch_threads = None, None, 0
            # Image models: candidates are lossy variants checked against a budget, not a tolerance, so
            # bands mixing them could not be verified at the band edges; one format serves every size.
            if spec.serving.dispatch and len(candidates) > 1 and not spec.is_vision:
                dispatch_report, dispatched, dispatch_threads = _dispatch(spec, model, holdout, curves, candidates, weights, staging / "dispatch", worker)
            verified_in = dict(worker.info, kind=where)
        chosen, selected = _select(reports, candidates, dispatch_report, dispatched, dispatch_threads)
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
            digests = rt.write_manifest(str(folder / str(version)))
            selected.backend = native.BACKEND
        cfg = emit.write_config(folder, emit.build_config(spec, art, settings, _n_outputs(spec, model), native_plan=native_plan))
        report = build_report(
            spec, spec_path, source, model, holdout,
            content_hash=digest, compiler_version=COMPILER_VERSION, sizes=sizes, weights=weights, passes=pass_reports,
            candidates=reports, selected=selected, dispatch=dispatch_report, profile=profile, batch_profile=batch_profile,
            settings=settings, config=cfg, dest=dest, version=version, digests=digests, verified_in=verified_in,
        )  # fmt: skip
        if serve_check:
            report.serve_check = _serve_check(spec, model, holdout, chosen, folder)
            if report.serve_check.status != "passed":
                previous = f"version {existing[-1]} stays in place" if existing else "nothing was written"
                raise VerificationError(
                    f"model {spec.name}: the {selected.format} artifact verified in the server environment but failed the serving check "
                    f"in the local Triton: {report.serve_check.reason}; {previous}"
                )
        else:
            report.serve_check = ServeCheckReport(status="skipped", reason="--no-serve-check")
        report.retired = _to_retire(dest, cfg, repository, version)
        report.duration_s = round(time.perf_counter() - started, 2)
        (folder / "report.json").write_text(report.model_dump_json(indent=2))
        (folder / "report.md").write_text(render_markdown(report))
        _install(folder, dest, version, spec.serving.keep_versions, report.retired)
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging_root.rmdir()
        except OSError:
            pass
