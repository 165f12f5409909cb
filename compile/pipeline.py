"""compile_model: load → optimize → convert → verify → measure → select → emit, for one spec."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from scorestack.errors import PlatformError, VerificationError
from scorestack.paths import default_repository
from scorestack.serve import ensure_server_environment
from scorestack.serve.worker import RuntimeWorker, WorkerError, project_python_worker

from . import emit, measure, passes, registry, verify
from .serve_check import check_served
from .loaders import Holdout, SourceModel, load_holdout, load_source
from .report import CandidateReport, CompileReport, PassReport, SelectedReport, ServeCheckReport, SourceReport, TritonSettings, render_markdown
from .spec import ModelSpec, load_spec

COMPILER_VERSION = "scorestack-compile 1"


def content_hash(spec_path: Path, spec: ModelSpec) -> str:
    """Hash of everything a compile depends on: spec text, source model, held-out rows, compiler version."""
    h = hashlib.sha256(COMPILER_VERSION.encode())
    files = [spec_path, spec.source.path, spec.holdout]
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


def _install(staged: Path, dest: Path, version: int, keep: int) -> None:
    """Add the staged version to `dest` with renames only (a reader never sees a half-written model),
    then drop versions beyond the newest `keep`."""
    dest.mkdir(parents=True, exist_ok=True)
    os.rename(staged / str(version), dest / str(version))
    for name in ("config.pbtxt", "report.json", "report.md"):
        os.replace(staged / name, dest / name)
    for old in versions(dest)[:-keep]:
        shutil.rmtree(dest / str(old), ignore_errors=True)


def _apply_passes(spec: ModelSpec, source: SourceModel, holdout: Holdout, threads: int) -> tuple[SourceModel, list[PassReport]]:
    reports: list[PassReport] = []
    model = source
    opt = spec.optimization
    if opt.pruning is not None and opt.pruning.enabled:
        model, res = passes.prune(model, holdout, opt.pruning)
        reports.append(res)
    if opt.distillation is not None and opt.distillation.enabled:
        train = None
        if opt.distillation.train_rows is not None:
            train = load_holdout(opt.distillation.train_rows, spec, spec.name, "optimization.distillation.train_rows")
        model, res = passes.distill(model, holdout, opt.distillation, train, threads=threads)
        reports.append(res)
    return model, reports


def _provisional_settings(spec: ModelSpec, threads: int) -> TritonSettings:
    """Settings for the configs candidates are verified and timed with (threads is what they differ in)."""
    return TritonSettings(
        max_batch_size=max(spec.serving.batch_sizes),
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


def _n_outputs(spec: ModelSpec, model: SourceModel) -> int:
    return int(model.n_classes or 1) if spec.task == "multiclass" else 1


def _key(fmt: str, threads: int) -> str:
    return f"{fmt}@{threads}"


def _load(worker: RuntimeWorker, spec: ModelSpec, model: SourceModel, cand: _Candidate, threads: int) -> float:
    cfg = emit.build_config(spec, cand.artifact, _provisional_settings(spec, threads), _n_outputs(spec, model))
    return worker.load(_key(cand.artifact.format, threads), spec.name, cand.version_dir, emit.config_dict(cfg))


def _candidates(
    spec: ModelSpec, model: SourceModel, holdout: Holdout, workdir: Path, worker: RuntimeWorker
) -> tuple[list[CandidateReport], dict[str, _Candidate]]:
    """Convert to every registered format, package each as a version folder, and verify it in the worker."""
    reference = model.predict(holdout.X)
    ctx = registry.ConvertContext(
        task=spec.task,
        n_features=spec.n_features,
        target=spec.target,
        sample=holdout.X[: min(64, len(holdout))],
        compile_threads=max(1, min(os.cpu_count() or 1, 4)),
    )
    reports: list[CandidateReport] = []
    verified: dict[str, _Candidate] = {}
    registered = registry.formats_for(model.family)
    for fmt in spec.formats or []:
        if fmt not in registered:
            reports.append(CandidateReport(format=fmt, status="skipped", reason=f"no {fmt} converter for {model.family} models ({model.description}) (this family can become: {', '.join(registered)})"))
    for fmt in registered:
        if spec.formats is not None and fmt not in spec.formats:
            reports.append(CandidateReport(format=fmt, status="skipped", reason="not listed in the spec's `formats`"))
            continue
        fdir = workdir / fmt
        fdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            art = registry.converter_for(model.family, fmt)(model, fdir, ctx)
            cand = _Candidate(art, fdir / "version", emit.package_version(fdir / "version", art))
        except registry.Skip as exc:
            reports.append(CandidateReport(format=fmt, status="skipped", reason=str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - a converter's failure rejects that candidate, not the compile
            reports.append(CandidateReport(format=fmt, status="failed", reason=f"conversion failed: {type(exc).__name__}: {exc}"[:500], convert_s=time.perf_counter() - t0))
            continue
        rep = CandidateReport(
            format=fmt,
            status="rejected",
            runtime=art.runtime,
            backend=art.backend,
            artifact=art.artifact_name,
            artifact_bytes=art.path.stat().st_size,
            convert_s=round(time.perf_counter() - t0, 3),
            notes=art.notes,
        )
        reports.append(rep)
        try:
            rep.load_s = round(_load(worker, spec, model, cand, spec.threads[0]), 3)
        except WorkerError as exc:
            rep.reason = f"does not load in the server environment: {exc}"[:700]
            continue
        key = _key(fmt, spec.threads[0])
        v = verify.verify(lambda X, sizes: worker.execute(key, X, sizes), reference, holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows)
        rep.verified, rep.max_abs_diff = v.verified, v.max_abs_diff
        rep.label_agreement, rep.rank_agreement = v.label_agreement, v.rank_agreement
        rep.rows_batch1, rep.rows_large = v.rows_batch1, v.rows_large
        if v.verified:
            rep.status = "verified"
            verified[fmt] = cand
        else:
            rep.reason = f"verification failed: {v.reason}"
            worker.unload(key)
    return reports, verified


def _time_candidates(
    spec: ModelSpec, model: SourceModel, holdout: Holdout, reports: list[CandidateReport], candidates: dict[str, _Candidate], worker: RuntimeWorker
) -> None:
    """Time every verified candidate at every thread count in the worker, interleaved; drop any that fails there."""
    keys = {}
    for fmt, cand in candidates.items():
        for t in spec.threads:
            if _key(fmt, t) not in worker.loaded:
                _load(worker, spec, model, cand, t)
            keys[_key(fmt, t)] = (fmt, t)
    plan = measure.TimingPlan(batch_sizes=tuple(sorted(set(spec.serving.batch_sizes))))
    table = worker.measure(
        list(keys), holdout.X, list(plan.batch_sizes), rounds=plan.rounds, cell_budget_s=plan.cell_budget_s, max_calls=plan.max_calls, min_calls=plan.min_calls
    )
    weights = spec.serving.weights()
    for rep in reports:
        if rep.format not in candidates:
            continue
        per_t = {t: table[_key(rep.format, t)] for t in spec.threads}
        best_t = min(per_t, key=lambda t: measure.weighted_latency(per_t[t], weights))
        rep.threads = best_t
        rep.latency_us = {str(b): round(v, 2) for b, v in per_t[best_t].items()}
        rep.latency_us_by_threads = {str(t): {str(b): round(v, 2) for b, v in lat.items()} for t, lat in per_t.items()}
        rep.weighted_latency_us = round(measure.weighted_latency(per_t[best_t], weights), 2)


def _worker() -> tuple[RuntimeWorker, str]:
    """The verification worker in the server environment; this environment only where none can exist (reported)."""
    try:
        return RuntimeWorker(ensure_server_environment()), "the server environment"
    except PlatformError as exc:
        return project_python_worker(), f"the project environment (no local server environment here: {exc})"


def compile_model(
    spec_path: str | Path,
    repository: str | Path | None = None,
    force: bool = False,
    serve_check: bool = True,
) -> CompileReport:
    """Compile one spec into a new version of `<repository>/<name>/` (config.pbtxt, <version>/, report.json, report.md).

    Every candidate is loaded, verified and timed in the server environment through the model
    runtime; the selected one is then loaded in the real local Triton and queried over gRPC
    (`serve_check`) before it is added to the repository, so a model that does not serve never
    replaces one that does. An unchanged spec + source + held-out rows is not recompiled unless
    `force`; the previous report is returned with `skipped=True`. Raises SpecError for an invalid
    spec or unloadable source and VerificationError when no candidate reproduces the model or the
    serving check fails.
    """
    started = time.perf_counter()
    spec_path = Path(spec_path).resolve()
    spec = load_spec(spec_path)
    repository = Path(repository) if repository is not None else default_repository()
    repository = repository.resolve()
    dest = repository / spec.name
    digest = content_hash(spec_path, spec)
    if not force:
        prev = _previous(dest, digest)
        if prev is not None:
            return prev.model_copy(update={"skipped": True})

    source = load_source(spec, spec_path.name)
    holdout = load_holdout(spec.holdout, spec, spec_path.name)
    threads_for_training = max(1, min(os.cpu_count() or 1, 4))
    model, pass_reports = _apply_passes(spec, source, holdout, threads_for_training)

    staging_root = repository.parent / f".{repository.name}.staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=staging_root))
    worker, where = _worker()
    try:
        with worker:
            reports, candidates = _candidates(spec, model, holdout, staging / "candidates", worker)
            if not candidates:
                why = "; ".join(f"{r.format}: {r.reason}" for r in reports)
                raise VerificationError(f"model {spec.name}: no candidate reproduces the model ({why})")
            _time_candidates(spec, model, holdout, reports, candidates, worker)
            verified_in = dict(worker.info, kind=where)
        weights = spec.serving.weights()
        best = min((r for r in reports if r.format in candidates), key=lambda r: r.weighted_latency_us or float("inf"))
        best.status = "selected"
        chosen = candidates[best.format]
        art = chosen.artifact
        cpus = os.cpu_count() or 1
        lat = {int(b): v for b, v in best.latency_us.items()}
        settings = emit.derive_settings(spec, lat, best.threads or 1, cpus, gpu=art.backend == "tensorrt")
        existing = versions(dest)
        version = max(existing, default=0) + 1
        folder = staging / "repository" / spec.name
        shutil.copytree(chosen.version_dir, folder / str(version), symlinks=False)
        cfg = emit.write_config(folder, emit.build_config(spec, art, settings, _n_outputs(spec, model)))
        report = CompileReport(
            name=spec.name,
            spec=str(spec_path),
            content_hash=digest,
            compiler_version=COMPILER_VERSION,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            duration_s=0.0,
            machine={"cpus": cpus, "platform": platform.platform(), "python": platform.python_version()},
            source=SourceReport(
                path=str(spec.source.path),
                format=spec.source.format,
                description=source.description,
                family=source.family,
                task=spec.task,
                n_features=spec.n_features,
                n_trees=source.n_trees,
                final_model=model.description + (f" ({', '.join(model.history)})" if model.history else ""),
            ),
            holdout_rows=len(holdout),
            tolerance=spec.verification.tolerance,
            batch_sizes=sorted(set(spec.serving.batch_sizes)),
            batch_weights={str(b): round(w, 4) for b, w in weights.items()},
            latency_budget_ms=spec.serving.latency_budget_ms,
            passes=pass_reports,
            candidates=reports,
            selected=SelectedReport(
                format=best.format,
                runtime=art.runtime,
                backend=art.backend,
                artifact=art.artifact_name,
                threads=best.threads or 1,
                weighted_latency_us=best.weighted_latency_us or 0.0,
                latency_us=best.latency_us,
                output_column=art.output_column,
                method=art.method,
            ),
            triton=settings,
            output={
                "folder": str(dest),
                "config": str(dest / "config.pbtxt"),
                "artifact": str(dest / str(version) / art.artifact_name),
                "backend": cfg.backend,
                "input": {"name": cfg.input[0].name, "dims": list(cfg.input[0].dims)},
                "output": {"name": cfg.output[0].name, "dims": list(cfg.output[0].dims)},
            },
            version=version,
            artifact_sha256={f"{version}/{name}": d for name, d in chosen.digests.items()},
            verified_in=verified_in,
        )
        if serve_check:
            report.serve_check = check_served(folder.parent, spec.name, model.predict, holdout, spec.task, spec.verification.tolerance)
            if report.serve_check.status != "passed":
                previous = f"version {existing[-1]} stays in place" if existing else "nothing was written"
                raise VerificationError(
                    f"model {spec.name}: the {best.format} artifact verified in the server environment but failed the serving check "
                    f"in the local Triton: {report.serve_check.reason}; {previous}"
                )
        else:
            report.serve_check = ServeCheckReport(status="skipped", reason="--no-serve-check")
        report.duration_s = round(time.perf_counter() - started, 2)
        (folder / "report.json").write_text(report.model_dump_json(indent=2))
        (folder / "report.md").write_text(render_markdown(report))
        _install(folder, dest, version, spec.serving.keep_versions)
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging_root.rmdir()
        except OSError:
            pass
