"""Where does the time go on any deployment? Triton's per-model statistics (+ the client's phases) over a window.

`watch` reads Triton's statistics over a window of live traffic and sends nothing; `client/replay.py`
sends rows at a concurrency or rate; with the client's exported histograms (client/metrics.py) the
request path is diagnosed end to end. This module reads the deployment: the statistics, the served
configs, the compile reports and specs of the models, the failure counts of /metrics; what the
readings mean is client/diagnosis.py's, and the phases of a service's own requests
(`measure`, `Breakdown`) are client/breakdown.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from scorestack.client.advice import FeatureSide, ServedConfig

# The benchmarks still import breakdown, measure and server_snapshot from here (client.breakdown is their home).
from scorestack.client.breakdown import breakdown, measure, server_snapshot
from scorestack.client.diagnosis import ClientSide, Diagnosis, ModelContext, client_named_phases, diagnose_model
from scorestack.client.metrics import Scrape
from scorestack.client.server_stats import ModelStats, failures_by_reason, fetch_text, read_statistics
from scorestack.client.triton import TritonClient
from scorestack.errors import InferenceError
from scorestack.serve.security import ClientTls, load_admin_key

if TYPE_CHECKING:
    from scorestack.compile.report import CompileReport

__all__ = ["Target", "breakdown", "failure_delta", "load_report", "measure", "model_context", "open_client", "read_failures", "save_profile", "server_snapshot", "watch"]


def load_report(repository: Path, model: str) -> "tuple[CompileReport | None, Path, str | None]":
    """The model's compile report (<repository>/<model>/report.json), or None with the reason."""
    path = repository / model / "report.json"
    if not path.is_file():
        return None, path, None
    from pydantic import ValidationError

    from scorestack.compile.report import CompileReport

    try:
        return CompileReport.model_validate_json(path.read_text()), path, None
    except (OSError, ValueError, ValidationError) as exc:
        return None, path, f"compile report {path} unreadable ({str(exc).splitlines()[0]}); deciding without it"


async def _served_config(triton: TritonClient, model: str) -> ServedConfig | None:
    from tritonclient.utils import InferenceServerException

    try:
        return ServedConfig.from_json(await triton.grpc.get_model_config(model, as_json=True, client_timeout=5))
    except InferenceServerException:
        return None


async def _ready_models(triton: TritonClient, stats: Mapping[str, ModelStats]) -> list[str]:
    """Every model Triton reports statistics for that is ready now."""
    from tritonclient.utils import InferenceServerException

    ready = []
    for name in stats:
        try:
            if await triton.grpc.is_model_ready(name, client_timeout=5):
                ready.append(name)
        except InferenceServerException:
            continue
    return ready


def save_profile(path: Path, deltas: Sequence[ModelStats]) -> Path:
    """The window's statistics in Triton's JSON shape: `scorestack compile --batch-profile` reads them."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_stats": [d.to_triton_json() for d in deltas]}, indent=1))
    return path


@dataclass(frozen=True)
class Target:
    """Where the deployment is and what the diagnosis may read besides it."""

    url: str
    models: tuple[str, ...] = ()  # () = every ready model
    repository: Path | None = None  # compile reports: <repository>/<model>/report.json
    metrics_url: str | None = None  # Triton's /metrics (failure reasons: queue-policy rejections)
    stats_file: Path | None = None  # where the window's statistics are saved for --batch-profile
    tls: ClientTls | None = None


def open_client(target: Target) -> TritonClient:
    # The admin key comes from the environment only (serve.security.load_admin_key): never argv.
    return TritonClient(target.url, deadline_s=5.0, tls=target.tls or ClientTls.from_env(), admin_key=load_admin_key())


async def model_context(triton: TritonClient, target: Target, model: str, features: FeatureSide | None = None) -> ModelContext:
    from scorestack.paths import default_repository

    repository = (target.repository or default_repository()).resolve()
    report, report_path, problem = load_report(repository, model)
    return ModelContext(
        config=await _served_config(triton, model),
        report=report,
        report_path=report_path,
        repository=repository,
        stats_file=target.stats_file,
        features=features,
        notes=(problem,) if problem else (),
    )


def read_failures(target: Target) -> dict[str, dict[str, int]] | None:
    return None if target.metrics_url is None else failures_by_reason(fetch_text(target.metrics_url), target.metrics_url)


def failure_delta(before: dict[str, dict[str, int]] | None, after: dict[str, dict[str, int]] | None, model: str) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    b, a = before.get(model, {}), after.get(model, {})
    return {r: a[r] - b.get(r, 0) for r in a if a[r] - b.get(r, 0) > 0}


async def watch(
    target: Target,
    window_s: float,
    *,
    client_metrics: str | None = None,
    on_start: Callable[[list[str]], None] | None = None,
) -> list[Diagnosis]:
    """Passive: read Triton's statistics (and the client's metrics) before and after `window_s` of
    live traffic; sends no inference. `on_start(models)` runs once the first readings are taken."""
    import time

    if window_s <= 0:
        raise ValueError(f"window: {window_s} s; give a positive number of seconds of live traffic to watch")
    async with open_client(target) as triton:
        before = await read_statistics(triton, target.models or None)
        models = list(target.models) if target.models else await _ready_models(triton, before)
        if not models:
            raise InferenceError(f"Triton at {target.url} has no ready model to diagnose")
        missing = [m for m in models if m not in before]
        if missing:
            raise InferenceError(f"model(s) {missing} not served by Triton at {target.url}; it serves {sorted(before)}")
        fail_before = read_failures(target)
        client_before = Scrape.read(client_metrics) if client_metrics else None
        started = time.monotonic()
        if on_start is not None:
            on_start(models)
        await asyncio.sleep(window_s)
        client_after = Scrape.read(client_metrics) if client_metrics else None
        after = await read_statistics(triton, models)
        window = time.monotonic() - started
        fail_after = read_failures(target)
        deltas = [after[m] - before[m] for m in models]
        if target.stats_file is not None:
            save_profile(target.stats_file, deltas)
        out = []
        client_delta = client_after.minus(client_before) if client_after is not None and client_before is not None else None
        for delta in deltas:
            failures = failure_delta(fail_before, fail_after, delta.model)
            if client_delta is None:
                ctx = await model_context(triton, target, delta.model)
                out.append(diagnose_model("passive", delta, window, ctx, failures=failures))
                continue
            sides = client_delta.request_phases(delta.model)
            ctx = await model_context(triton, target, delta.model, client_delta.feature_side())
            if not sides:
                ctx = replace(ctx, notes=(*ctx.notes, f"the client metrics at {client_metrics} have no requests to {delta.model!r} in the window"))
                out.append(diagnose_model("passive", delta, window, ctx, failures=failures))
                continue
            for service, means, count in sides:
                client = ClientSide(service, count, means, triton_calls_per_request=delta.success.count / max(count, 1))
                named = client_named_phases(means)
                out.append(diagnose_model("client-metrics", delta, window, ctx, client=client, client_phases=named, failures=failures))
        return out
