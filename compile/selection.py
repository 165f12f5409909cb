"""Choosing what is served: the verified candidates timed on the batch-size grid, a per-batch-size
dispatch where different formats win different sizes (verified and timed in its turn), and the
selection of the served candidate."""

from __future__ import annotations

import os
from pathlib import Path

from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.serve.worker import RuntimeWorker, WorkerError

from . import dispatch, emit, measure, verify
from .candidates import Candidate, load_candidate, worker_key
from .model import Holdout, SourceModel
from .report import CandidateReport, DispatchReport, SelectedReport
from .spec import ModelSpec

def time_candidates(
    spec: ModelSpec,
    model: SourceModel,
    holdout: Holdout,
    reports: list[CandidateReport],
    candidates: dict[str, Candidate],
    worker: RuntimeWorker,
    sizes: tuple[int, ...],
    weights: dict[int, float],
) -> dict[int, dict[str, dict[int, float]]]:
    """Time every verified candidate at every thread count and batch size of the grid in the worker, interleaved.

    Returns threads -> format -> batch size -> µs per call."""
    keys = {}
    for fmt, cand in candidates.items():
        for t in spec.threads:
            if worker_key(fmt, t) not in worker.loaded:
                load_candidate(worker, spec, model, cand, t)
            keys[worker_key(fmt, t)] = (fmt, t)
    plan = measure.TimingPlan(batch_sizes=sizes)
    table = worker.measure(
        list(keys), holdout.X, list(plan.batch_sizes), rounds=plan.rounds, cell_budget_s=plan.cell_budget_s, max_calls=plan.max_calls, min_calls=plan.min_calls
    )
    for rep in reports:
        if rep.format not in candidates:
            continue
        per_t = {t: table[worker_key(rep.format, t)] for t in spec.threads}
        best_t = measure.choose_threads(per_t, weights, os.cpu_count() or 1, emit.MAX_INSTANCES)
        rep.threads = best_t
        rep.latency_us = {str(b): round(v, 2) for b, v in per_t[best_t].items()}
        rep.latency_us_by_threads = {str(t): {str(b): round(v, 2) for b, v in lat.items()} for t, lat in per_t.items()}
        rep.weighted_latency_us = round(measure.weighted_latency(per_t[best_t], weights), 2)
    return {t: {fmt: table[worker_key(fmt, t)] for fmt in candidates} for t in spec.threads}


def dispatch_candidate(
    spec: ModelSpec,
    model: SourceModel,
    holdout: Holdout,
    curves_by_threads: dict[int, dict[str, dict[int, float]]],
    candidates: dict[str, Candidate],
    weights: dict[int, float],
    workdir: Path,
    worker: RuntimeWorker,
) -> tuple[DispatchReport, Candidate | None, int]:
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
    cand = Candidate(art, workdir / "version", digests, "dispatch")
    key = worker_key("dispatch", threads)
    try:
        load_candidate(worker, spec, model, cand, threads)
    except WorkerError as exc:
        rep.status, rep.reason = "rejected", f"does not load in the server environment: {exc}"[:700]
        return rep, None, threads
    def execute(X, sizes):
        return worker.execute(key, X, sizes)

    v = verify.verify(execute, model.predict(holdout.X), holdout, spec.task, spec.verification.tolerance, spec.verification.sample_rows, spec.relative_tolerance)
    edges = verify.verify_bands(execute, model.predict, holdout, [(b.min_rows, b.max_rows) for b in plan.bands], spec.task, spec.verification.tolerance, spec.relative_tolerance)
    diffs = [d for d in (v.max_abs_diff, edges.max_abs_diff) if d is not None]
    rep.max_abs_diff = max(diffs) if diffs else None
    rep.edge_sizes = edges.sizes
    if not (v.verified and edges.verified):
        rep.status = "rejected"
        rep.reason = "verification failed: " + "; ".join(r for r in (v.reason, edges.reason) if r)
        worker.unload(key)
        return rep, None, threads
    # The dispatch timed side by side with its band formats, interleaved, so the report compares like with like.
    members = {b.format: worker_key(b.format, threads) for b in plan.bands}
    t = measure.TimingPlan(batch_sizes=tuple(rep.grid))
    table = worker.measure([key, *members.values()], holdout.X, rep.grid, rounds=t.rounds, cell_budget_s=t.cell_budget_s, max_calls=t.max_calls, min_calls=t.min_calls)
    measured = table[key]
    rep.measured_us = {label: {str(b): round(v_, 2) for b, v_ in sorted(table[k].items())} for label, k in {"dispatch": key, **members}.items()}
    rep.weighted_latency_us = round(measure.weighted_latency(measured, weights), 2)
    rep.status = "selected"
    return rep, cand, threads


def select_served(
    reports: list[CandidateReport],
    candidates: dict[str, Candidate],
    dispatch_report: DispatchReport | None,
    dispatched: Candidate | None,
    dispatch_threads: int,
) -> tuple[Candidate, SelectedReport]:
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
