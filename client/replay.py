"""Active diagnosis: replay rows into a served model at a concurrency or a rate, and diagnose the window.

Rows come from a .npz (array X) or, by default, from the held-out rows the model's compile report
points to (`<repository>/<model>/report.json` -> its spec -> `holdout`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np

from scorestack.client.diagnose import Target, failure_delta, load_report, model_context, open_client, read_failures, save_profile
from scorestack.client.diagnosis import ClientSide, Diagnosis, diagnose_model
from scorestack.client.server_stats import ModelStats, read_statistics, settled
from scorestack.errors import InferenceError


def holdout_rows(repository: Path, model: str) -> tuple[np.ndarray, str]:
    """The held-out rows `<repository>/<model>/report.json` points to (its spec's `holdout`), with where they came from."""
    from scorestack.compile.spec import load_spec
    from scorestack.errors import SpecError

    report, path, problem = load_report(repository.resolve(), model)
    if report is None:
        raise SpecError(problem or f"model {model!r}: no compile report at {path} to find its held-out rows; pass --rows FILE.npz (array X) or --repository")
    spec = load_spec(report.spec)
    return load_rows(spec.holdout), f"{spec.holdout} (held-out rows of {report.spec})"


def load_rows(path: str | Path) -> np.ndarray:
    """Array `X` of a .npz file, as the rows to replay."""
    from scorestack.errors import SpecError

    try:
        with np.load(Path(path)) as data:
            if "X" not in data:
                raise SpecError(f"--rows {path}: no array X (it has {sorted(data.files)}); save rows with np.savez(path, X=rows)")
            rows = np.asarray(data["X"])
    except (OSError, ValueError) as exc:
        raise SpecError(f"--rows {path}: not a readable .npz file ({exc})") from exc
    if rows.ndim < 2 or len(rows) == 0:
        raise SpecError(f"--rows {path}: X has shape {list(rows.shape)}; expected rows x features")
    return rows


async def replay(
    target: Target,
    model: str,
    rows: np.ndarray,
    *,
    requests: int = 500,
    concurrency: int = 1,
    rate: float | None = None,
    rows_per_request: int = 1,
    warmup: int = 10,
) -> Diagnosis:
    """Active: send `requests` requests of `rows_per_request` rows each, cycling through `rows`, at
    `concurrency` in flight (closed loop) or at `rate` requests/s (open loop), and diagnose the window."""
    import time

    if requests <= 0 or concurrency <= 0 or rows_per_request <= 0 or (rate is not None and rate <= 0):
        raise ValueError("requests, concurrency, rows per request and rate must be positive")
    async with open_client(target) as triton:
        info = await triton.model_info(model)
        if len(info.inputs) != 1:
            raise InferenceError(f"model {model!r} takes {len(info.inputs)} inputs; replay sends one tensor of rows")
        tensor = info.inputs[0]
        x = rows.astype(tensor.dtype, copy=False)

        def batch(i: int) -> np.ndarray:
            idx = (np.arange(rows_per_request) + i * rows_per_request) % len(x)
            return np.ascontiguousarray(x[idx])

        # Triton counts a request after its response is sent: wait until the warm-up requests are in
        # the counters before taking the window's starting reading (else they land inside the window).
        pre = await _model_statistics(triton, model)
        for i in range(warmup):
            await triton.infer(model, {tensor.name: batch(i)})
        fail_before = read_failures(target)
        before = await settled(lambda: _model_statistics(triton, model), lambda s: (s - pre).success.count >= warmup)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        sem = asyncio.Semaphore(concurrency if rate is None else max(concurrency, 1024))
        started = time.monotonic()

        async def one(i: int) -> None:
            if rate is not None:
                await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            async with sem:
                t = time.perf_counter()
                try:
                    await triton.infer(model, {tensor.name: batch(warmup + i)})
                except InferenceError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    return
                latencies.append((time.perf_counter() - t) * 1e3)

        await asyncio.gather(*(one(i) for i in range(requests)))
        after = await settled(lambda: _model_statistics(triton, model), lambda s: (s - before).success.count >= len(latencies))
        window = time.monotonic() - started
        delta = after - before
        if target.stats_file is not None:
            save_profile(target.stats_file, [delta])
        if not latencies:
            raise InferenceError(f"model {model!r}: all {requests} replayed requests failed: {errors}")
        lat = np.array(latencies)
        client = ClientSide(
            "replay", len(lat), {"infer": float(lat.mean()), "total": float(lat.mean())},
            float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), delta.success.count / len(lat),
        )  # fmt: skip
        ctx = await model_context(triton, target, model)
        if errors:
            ctx = replace(ctx, notes=(*ctx.notes, f"{sum(errors.values())} of {requests} requests failed: {errors}"))
        return diagnose_model("replay", delta, window, ctx, client=client, client_phases={}, failures=failure_delta(fail_before, read_failures(target), model))


async def _model_statistics(triton, model: str) -> ModelStats:
    return (await read_statistics(triton, [model]))[model]
