"""compile_model: load → optimize → convert → verify → measure → select → emit, for one spec."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from scorestack.errors import VerificationError
from scorestack.paths import default_repository

from . import emit, measure, passes, registry, verify
from .loaders import Holdout, SourceModel, load_holdout, load_source
from .report import CandidateReport, CompileReport, PassReport, SelectedReport, SourceReport, render_markdown
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


def _swap_in(staged: Path, dest: Path) -> None:
    """Replace `dest` by `staged` with renames only, so a reader never sees a half-written model."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        os.rename(staged, dest)
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, old)
    try:
        os.rename(staged, dest)
    except OSError:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


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


def _candidates(spec: ModelSpec, model: SourceModel, holdout: Holdout, workdir: Path) -> tuple[list[CandidateReport], dict[str, registry.Artifact]]:
    """Convert to every registered format and verify each against `model`."""
    reference = model.predict(holdout.X)
    ctx = registry.ConvertContext(
        task=spec.task,
        n_features=spec.n_features,
        target=spec.target,
        sample=holdout.X[: min(64, len(holdout))],
        compile_threads=max(1, min(os.cpu_count() or 1, 4)),
    )
    formats = registry.formats_for(model.family)
    reports: list[CandidateReport] = []
    artifacts: dict[str, registry.Artifact] = {}
    for fmt in formats:
        if spec.formats is not None and fmt not in spec.formats:
            reports.append(CandidateReport(format=fmt, status="skipped", reason="not listed in the spec's `formats`"))
            continue
        fdir = workdir / fmt
        fdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            art = registry.converter_for(model.family, fmt)(model, fdir, ctx)
        except registry.Skip as exc:
            reports.append(CandidateReport(format=fmt, status="skipped", reason=str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - a converter's failure rejects that candidate, not the compile
            reports.append(CandidateReport(format=fmt, status="failed", reason=f"conversion failed: {type(exc).__name__}: {exc}"[:500], convert_s=time.perf_counter() - t0))
            continue
        convert_s = time.perf_counter() - t0
        rep = CandidateReport(
            format=fmt,
            status="rejected",
            runtime=art.runtime,
            backend=art.backend,
            artifact=art.artifact_name,
            artifact_bytes=art.path.stat().st_size,
            convert_s=round(convert_s, 3),
            notes=art.notes,
        )
        try:
            runner = art.runner(spec.threads[0], spec.output_name)
        except registry.Skip as exc:
            rep.status, rep.reason = "skipped", f"cannot run here: {exc}"
            reports.append(rep)
            continue
        except Exception as exc:  # noqa: BLE001
            rep.reason = f"failed to load: {type(exc).__name__}: {exc}"[:500]
            reports.append(rep)
            continue
        v = verify.verify(runner, reference, holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows)
        rep.verified, rep.max_abs_diff = v.verified, v.max_abs_diff
        rep.label_agreement, rep.rank_agreement = v.label_agreement, v.rank_agreement
        rep.rows_batch1, rep.rows_large = v.rows_batch1, v.rows_large
        if v.verified:
            rep.status = "verified"
            artifacts[fmt] = art
        else:
            rep.reason = f"verification failed: {v.reason}"
        reports.append(rep)
    return reports, artifacts


def _time_candidates(spec: ModelSpec, holdout: Holdout, reports: list[CandidateReport], artifacts: dict[str, registry.Artifact]) -> None:
    runners = {}
    for fmt, art in artifacts.items():
        for t in spec.threads:
            runners[(fmt, t)] = art.runner(t, spec.output_name)
    plan = measure.TimingPlan(batch_sizes=tuple(sorted(set(spec.serving.batch_sizes))))
    table = measure.measure(runners, holdout.X, plan)
    weights = spec.serving.weights()
    for rep in reports:
        if rep.format not in artifacts:
            continue
        per_t = {t: table[(rep.format, t)] for t in spec.threads}
        best_t = min(per_t, key=lambda t: measure.weighted_latency(per_t[t], weights))
        rep.threads = best_t
        rep.latency_us = {str(b): round(v, 2) for b, v in per_t[best_t].items()}
        rep.latency_us_by_threads = {str(t): {str(b): round(v, 2) for b, v in lat.items()} for t, lat in per_t.items()}
        rep.weighted_latency_us = round(measure.weighted_latency(per_t[best_t], weights), 2)


def compile_model(spec_path: str | Path, repository: str | Path | None = None, force: bool = False) -> CompileReport:
    """Compile one spec into `<repository>/<name>/` (config.pbtxt, 1/<artifact>, report.json, report.md).

    An unchanged spec + source + held-out rows is not recompiled unless `force`; the previous report
    is returned with `skipped=True`. Raises SpecError for an invalid spec or unloadable source and
    VerificationError when no candidate reproduces the model.
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
    try:
        reports, artifacts = _candidates(spec, model, holdout, staging / "candidates")
        if not artifacts:
            why = "; ".join(f"{r.format}: {r.reason}" for r in reports)
            raise VerificationError(f"model {spec.name}: no candidate reproduces the model ({why})")
        _time_candidates(spec, holdout, reports, artifacts)
        weights = spec.serving.weights()
        best = min((r for r in reports if r.format in artifacts), key=lambda r: r.weighted_latency_us or float("inf"))
        best.status = "selected"
        art = artifacts[best.format]
        cpus = os.cpu_count() or 1
        lat = {int(b): v for b, v in best.latency_us.items()}
        settings = emit.derive_settings(spec, lat, best.threads or 1, cpus, gpu=art.backend == "tensorrt")
        n_outputs = model.n_classes if spec.task == "multiclass" else 1
        folder = staging / spec.name
        cfg = emit.write_model_folder(folder, spec, art, settings, int(n_outputs or 1))
        report = CompileReport(
            name=spec.name,
            spec=str(spec_path),
            content_hash=digest,
            compiler_version=COMPILER_VERSION,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            duration_s=round(time.perf_counter() - started, 2),
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
                "artifact": str(dest / "1" / art.artifact_name),
                "backend": cfg.backend,
                "input": {"name": cfg.input[0].name, "dims": list(cfg.input[0].dims)},
                "output": {"name": cfg.output[0].name, "dims": list(cfg.output[0].dims)},
            },
        )
        (folder / "report.json").write_text(report.model_dump_json(indent=2))
        (folder / "report.md").write_text(render_markdown(report))
        _swap_in(folder, dest)
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging_root.rmdir()
        except OSError:
            pass

