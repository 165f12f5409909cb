"""The compile report: what was tried, what was verified, what was measured and chosen (report.json, report.md)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from .model import Holdout, SourceModel
    from .profile import BatchProfile
    from .spec import ModelSpec


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CandidateReport(_Model):
    format: str
    status: str  # selected | verified | rejected | skipped | failed
    verified: bool = False
    reason: str | None = None
    runtime: str | None = None
    backend: str | None = None
    artifact: str | None = None
    artifact_bytes: int | None = None
    convert_s: float | None = None
    load_s: float | None = None  # loading in the server environment, through the model runtime
    verify_s: float | None = None  # verification on the held-out rows
    max_abs_diff: float | None = None
    label_agreement: float | None = None
    rank_agreement: float | None = None
    rows_batch1: int | None = None
    rows_large: int | None = None
    threads: int | None = None  # the thread count with the lowest weighted latency
    latency_us: dict[str, float] = Field(default_factory=dict)  # batch size -> median µs per call, at `threads`
    latency_us_by_threads: dict[str, dict[str, float]] = Field(default_factory=dict)
    weighted_latency_us: float | None = None
    notes: list[str] = Field(default_factory=list)
    # Image models: the model variant converted ("" the source, "pruned", "distilled"), its accuracy on the
    # labelled held-out images, the drop from the source's, and top-class agreement with the fp32 model it came from.
    variant: str | None = None
    accuracy: float | None = None
    accuracy_drop: float | None = None
    argmax_agreement: float | None = None
    parameters: int | None = None


class PassReport(_Model):
    name: str
    accepted: bool
    reason: str
    metric: str = ""
    source_quality: float | None = None
    result_quality: float | None = None
    quality_drop: float | None = None
    quality_budget: float | None = None
    trees_before: int | None = None
    trees_after: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class TritonSettings(_Model):
    max_batch_size: int
    max_queue_delay_us: int
    default_timeout_us: int
    max_queue_size: int
    instance_count: int
    queue_policy: bool = True  # default_timeout_us and max_queue_size are in config.pbtxt (else derived, not set)
    instance_kind: str
    threads: int
    rules: list[str]
    dynamic_batching: bool = True  # false: no dynamic_batching block (serving.batching none, or chosen by "auto")
    measured: list[dict[str, Any]] = Field(default_factory=list)  # serving.batching auto: each alternative as measured in the local Triton


class SelectedReport(_Model):
    format: str  # a candidate's format, or "dispatch" (several, by batch size: see CompileReport.dispatch)
    runtime: str
    backend: str
    artifact: str  # the file in the version folder (dispatch: the files, comma-separated)
    artifacts: list[str] = Field(default_factory=list)  # every artifact file in the version folder
    threads: int
    weighted_latency_us: float
    latency_us: dict[str, float]
    output_column: int | None = None
    method: str | None = None


class DispatchReport(_Model):
    """Per-batch-size dispatch: the measured curves, the bands chosen from them, and the dispatch's own check."""

    status: str  # single (one format wins everywhere) | selected | rejected
    threads: int
    grid: list[int]  # batch sizes measured: powers of two up to max_batch_size and the spec's sizes
    curves_us: dict[str, dict[str, float]]  # format -> batch size -> median µs per call, at `threads`
    bands: list[dict[str, Any]]  # [{format, min_rows, max_rows}], ascending
    decision: str
    edge_sizes: list[int] = Field(default_factory=list)  # request sizes verified at every band edge
    max_abs_diff: float | None = None
    # The dispatch artifact and its band formats timed again side by side: label -> batch size -> µs.
    measured_us: dict[str, dict[str, float]] = Field(default_factory=dict)
    weighted_latency_us: float | None = None
    reason: str | None = None


class ProfileReport(_Model):
    """The served model's executed batch sizes the compile was fitted to (--batch-profile)."""

    file: str
    executions: dict[str, int]  # batch size -> executions
    requests: int
    rows: int
    requests_per_execution: float


class ServeCheckReport(_Model):
    """The emitted model loaded in the real local Triton and queried over gRPC before it replaced anything."""

    status: str  # passed | failed | skipped
    rows: int = 0
    max_abs_diff: float | None = None
    reason: str | None = None
    label_agreement: float | None = None  # image models: top class served == top class verified, share of images


class SourceReport(_Model):
    path: str
    format: str
    description: str
    family: str
    task: str
    n_features: int
    n_trees: int | None = None
    final_model: str  # the model the candidates were converted from (after passes)
    accuracy: float | None = None  # image models: the source's accuracy on the labelled held-out images
    input_shape: list[int] | None = None  # image models: one image on the wire (uint8, in the spec's layout)


class RetiredVersion(_Model):
    version: int
    reason: str
    moved_to: str


class CompileReport(_Model):
    name: str
    spec: str
    content_hash: str
    compiler_version: str
    skipped: bool = False  # true when an unchanged spec + source was not recompiled
    created_at: str
    duration_s: float
    # Seconds per phase (load, passes, worker, candidates, timing, dispatch, emit, batching, serve_check):
    # they add up to duration_s; "candidates" holds each candidate's convert + load + verify (its row).
    phases_s: dict[str, float] = Field(default_factory=dict)
    machine: dict[str, Any]
    source: SourceReport
    holdout_rows: int
    tolerance: float
    relative_tolerance: float = 0.0  # a value matches where |Δ| <= tolerance + relative_tolerance * |source|
    batch_sizes: list[int]
    batch_weights: dict[str, float]
    latency_budget_ms: float
    passes: list[PassReport]
    candidates: list[CandidateReport]
    selected: SelectedReport
    triton: TritonSettings
    output: dict[str, Any]
    version: int = 1  # the version folder this compile wrote
    artifact_sha256: dict[str, str] = Field(default_factory=dict)  # "<version>/<file>" -> sha256 (also in SHA256SUMS)
    verified_in: dict[str, Any] = Field(default_factory=dict)  # the environment candidates were loaded, verified and timed in
    serve_check: ServeCheckReport | None = None
    dispatch: DispatchReport | None = None
    batch_profile: ProfileReport | None = None
    # Older versions the new config.pbtxt cannot serve (another format, artifacts or tensors): moved out
    # of the repository with their config, so Triton never loads them under this one.
    retired: list[RetiredVersion] = Field(default_factory=list)


def build_report(
    spec: "ModelSpec",
    spec_path: Path,
    source: "SourceModel",
    model: "SourceModel",
    holdout: "Holdout",
    *,
    content_hash: str,
    compiler_version: str,
    sizes: Sequence[int],
    weights: Mapping[int, float],
    passes: list[PassReport],
    candidates: list[CandidateReport],
    selected: SelectedReport,
    dispatch: DispatchReport | None,
    profile: "BatchProfile | None",
    batch_profile: str | Path | None,
    settings: TritonSettings,
    config: Any,
    dest: Path,
    version: int,
    digests: Mapping[str, str],
    verified_in: dict[str, Any],
) -> CompileReport:
    """The report of one compile, before its serving check and duration are known.

    `source` is the model as loaded, `model` the one candidates came from (after the passes);
    `config` is the emitted Triton ModelConfig, `dest` the model's folder in the repository and
    `digests` the selected version's files and their sha256.
    """
    from .verify import accuracy

    return CompileReport(
        name=spec.name,
        spec=str(spec_path),
        content_hash=content_hash,
        compiler_version=compiler_version,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        duration_s=0.0,
        machine={"cpus": os.cpu_count() or 1, "platform": platform.platform(), "python": platform.python_version()},
        source=SourceReport(
            path=str(spec.source.path),
            format=spec.source.format,
            description=source.description,
            family=source.family,
            task=spec.task,
            n_features=spec.n_features,
            n_trees=source.n_trees,
            final_model=model.description + (f" ({', '.join(model.history)})" if model.history else ""),
            accuracy=accuracy(model.predict(holdout.X), holdout.y) if spec.is_vision and holdout.y is not None else None,
            input_shape=list(spec.inputs.image.shape) if spec.inputs.image is not None else None,
        ),
        holdout_rows=len(holdout),
        tolerance=spec.verification.tolerance,
        relative_tolerance=spec.relative_tolerance,
        batch_sizes=list(sizes),
        batch_weights={str(b): round(w, 4) for b, w in weights.items()},
        latency_budget_ms=spec.serving.latency_budget_ms,
        passes=passes,
        candidates=candidates,
        selected=selected,
        dispatch=dispatch,
        batch_profile=None if profile is None else ProfileReport(
            file=str(Path(batch_profile).resolve()) if batch_profile is not None else "",
            executions={str(b): n for b, n in profile.executions.items()},
            requests=profile.requests,
            rows=profile.rows,
            requests_per_execution=round(profile.requests_per_execution, 3),
        ),
        triton=settings,
        output={
            "folder": str(dest),
            "config": str(dest / "config.pbtxt"),
            "artifacts": [str(dest / str(version) / f) for f in selected.artifacts],
            "backend": config.backend,
            "input": {"name": config.input[0].name, "dims": list(config.input[0].dims)},
            "output": {"name": config.output[0].name, "dims": list(config.output[0].dims)},
        },
        version=version,
        artifact_sha256={f"{version}/{name}": d for name, d in digests.items()},
        verified_in=verified_in,
    )


def _env_line(env: dict[str, Any]) -> str:
    if not env:
        return "an unrecorded environment"
    libs = ", ".join(f"{k} {v}" for k, v in (env.get("libraries") or {}).items())
    return f"{env.get('kind', 'the server environment')} (`{env.get('python')}`, numpy {env.get('numpy')}; {libs})"


def _serve_check_line(c: ServeCheckReport | None) -> str:
    if c is None or c.status == "skipped":
        return "skipped" + (f" ({c.reason})" if c is not None and c.reason else "")
    if c.status == "passed":
        return f"passed: {c.rows} held-out rows over gRPC through the local Triton, max |Δ| {c.max_abs_diff:.2e}"
    return f"FAILED: {c.reason}"


def render_markdown(r: CompileReport) -> str:
    """A human-readable report.md."""
    lines = [
        f"# {r.name}: compile report",
        "",
        f"- source: `{r.source.path}` ({r.source.format}) — {r.source.description}",
        f"- task: {r.source.task}, {r.source.n_features} features; served model: {r.source.final_model}",
        f"- selected: **{r.selected.format}** (runtime `{r.selected.runtime}`, backend `{r.selected.backend}`, "
        f"artifact `{r.version}/{r.selected.artifact}`, {r.selected.threads} thread(s)); weighted latency {r.selected.weighted_latency_us:.1f} µs",
        f"- version: {r.version} (`{r.version}/`, digests in `{r.version}/SHA256SUMS`)",
        f"- verification: {r.holdout_rows} held-out rows as one joined batch of mixed-size requests and a sample at batch 1, "
        f"through the model runtime in {_env_line(r.verified_in)}; tolerance |Δ| ≤ {r.tolerance:g}"
        + (f" + {r.relative_tolerance:g}·|source|" if r.relative_tolerance else ""),
        f"- serving check: {_serve_check_line(r.serve_check)}",
        *(f"- retired version {v.version}: {v.reason}; moved to `{v.moved_to}`" for v in r.retired),
        f"- machine: {r.machine.get('cpus')} CPUs, {r.machine.get('platform')}",
        f"- content hash: `{r.content_hash[:16]}…`; compiled in {r.duration_s:.1f} s"
        + (" (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in r.phases_s.items()) + "; each candidate's share below)" if r.phases_s else ""),
        "",
        "## Passes",
        "",
    ]
    if not r.passes:
        lines.append("No lossy pass requested.")
    else:
        lines += ["| pass | accepted | metric | source | result | drop | budget | trees | reason |", "|---|---|---|---|---|---|---|---|---|"]
        for p in r.passes:
            f = lambda v: "–" if v is None else f"{v:.4f}"
            lines.append(
                f"| {p.name} | {'yes' if p.accepted else 'no'} | {p.metric or '–'} | {f(p.source_quality)} | {f(p.result_quality)} | "
                f"{'–' if p.quality_drop is None else f'{p.quality_drop:.4g}'} | {'–' if p.quality_budget is None else p.quality_budget} | "
                f"{p.trees_before or '–'} → {p.trees_after or '–'} | {p.reason} |"
            )
        for p in r.passes:
            if p.details:
                lines.append("")
                lines.append(f"{p.name} details: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in p.details.items()))
    bs = [str(b) for b in r.batch_sizes]
    lines += [
        "",
        "## Candidates",
        "",
        "Median µs per call, measured in one process in interleaved rounds; weights " + ", ".join(f"batch {k}: {v:.2f}" for k, v in r.batch_weights.items()) + ".",
        "",
        "| format | status | max abs diff | threads | " + " | ".join(f"batch {b} µs" for b in bs) + " | weighted µs | build + load + verify s | reason |",
        "|---|---|---|---|" + "---|" * len(bs) + "---|---|---|",
    ]
    for c in r.candidates:
        diff = "–" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
        lat = " | ".join(f"{c.latency_us[b]:.1f}" if b in c.latency_us else "–" for b in bs)
        w = "–" if c.weighted_latency_us is None else f"{c.weighted_latency_us:.1f}"
        spent = [t for t in (c.convert_s, c.load_s, c.verify_s) if t is not None]
        took = f"{sum(spent):.1f}" if spent else "–"
        lines.append(f"| {c.format} | {c.status} | {diff} | {c.threads or '–'} | {lat} | {w} | {took} | {c.reason or ''} |")
    if any(c.accuracy is not None for c in r.candidates):
        lines += [
            "",
            f"Image classification: accuracy on {r.holdout_rows} labelled held-out images (source {100 * (r.source.accuracy or 0):.2f}%); "
            "top-class agreement with the fp32 model each candidate was converted from.",
            "",
            "| candidate | status | accuracy % | drop (points) | top-class agreement % | parameters | batch 1 µs | batch 32 µs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in r.candidates:
            if c.accuracy is None:
                continue
            pct = lambda v: "–" if v is None else f"{100 * v:.2f}"
            lines.append(
                f"| {c.format} | {c.status} | {pct(c.accuracy)} | {pct(c.accuracy_drop)} | {pct(c.argmax_agreement)} | {c.parameters or '–'} | "
                f"{c.latency_us.get('1', float('nan')):.1f} | {c.latency_us.get('32', float('nan')):.1f} |"
            )
        lines.append("")
    if r.dispatch is not None:
        d = r.dispatch
        lines += ["", "## Dispatch by batch size", "", f"{d.decision}.", ""]
        if d.status != "single":
            lines.append(
                "Bands: " + "; ".join(f"{b['format']} for {b['min_rows']}-{b['max_rows']} rows" for b in d.bands)
                + f" ({d.status}" + (f": {d.reason}" if d.reason else f"; verified at request sizes {d.edge_sizes}, max |Δ| {d.max_abs_diff:.2e}") + ")."
            )
            lines.append("")
        grid = [str(b) for b in d.grid]
        lines += ["µs per call at " + f"{d.threads} thread(s):", "", "| format | " + " | ".join(grid) + " |", "|---|" + "---|" * len(grid)]
        for fmt, curve in d.curves_us.items():
            lines.append(f"| {fmt} | " + " | ".join(f"{curve[b]:.1f}" for b in grid) + " |")
        if d.measured_us:
            lines += ["", "The dispatch artifact timed side by side with its band formats (interleaved rounds, µs per call):", ""]
            lines += ["| artifact | " + " | ".join(grid) + " |", "|---|" + "---|" * len(grid)]
            for label, curve in d.measured_us.items():
                name = f"**{label}**" if label == "dispatch" else label
                lines.append(f"| {name} | " + " | ".join(f"{curve[b]:.1f}" for b in grid) + " |")
    if r.batch_profile is not None:
        p = r.batch_profile
        lines += [
            "",
            f"Weights from the batch profile `{p.file}`: {p.requests} requests, {p.rows} rows, "
            f"{sum(p.executions.values())} executions ({p.requests_per_execution:.2f} requests per execution); executed sizes "
            + ", ".join(f"{b}: {n}" for b, n in p.executions.items())
            + ".",
        ]
    t = r.triton
    lines += [
        "",
        "## Triton settings",
        "",
        (f"max_batch_size {t.max_batch_size}, max_queue_delay_microseconds {t.max_queue_delay_us}, "
         + (f"default_timeout_microseconds {t.default_timeout_us} (REJECT), max_queue_size {t.max_queue_size}, " if t.queue_policy
            else f"no queue policy (derived timeout {t.default_timeout_us} µs, queue size {t.max_queue_size}: not set), ")
         if t.dynamic_batching else f"max_batch_size {t.max_batch_size}, no dynamic batching (no queue policy), ")
        + f"instance_group {t.instance_count} × {t.instance_kind}, {t.threads} thread(s) per instance.",
        "",
        "How they were derived:",
        "",
        *[f"- {rule}" for rule in t.rules],
        "",
    ]
    if t.measured:
        lines += [
            "Measured in the local Triton (serving.batching: auto; medians of interleaved rounds, raw gRPC requests of one row):",
            "",
            "| alternative | instances | c1 p50 ms | c1 p99 ms | callers | req/s | p99 ms | server CPU µs/request | errors | chosen |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *[f"| {m['name']} | {m['instances']} | {m['c1_p50_ms']:.3f} | {m['c1_p99_ms']:.3f} | {m['concurrency']} | {m['rate']:,.0f} | "
              f"{m['p99_ms']:.2f} | {m.get('server_cpu_us', float('nan')):.0f} | {m['errors']} | {'yes' if m['chosen'] else ''} |" for m in t.measured],
            "",
        ]
    return "\n".join(lines)
