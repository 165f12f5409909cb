"""`scorestack diagnose`: where time goes on any running Triton (and the request path in front of it).

With no --model, --rows or --window it watches every ready model for DEFAULT_WINDOW_S of live
traffic and sends nothing; the demo's own traffic is `scorestack demo diagnose` (cli/demo.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import BadInvocation, reported

DEFAULT_WINDOW_S = 10.0  # passive, when neither --window nor anything to replay is given


@reported
def diagnose(
    url: str = typer.Option(..., "--url", help="Triton gRPC address, e.g. 127.0.0.1:8001."),
    models: list[str] = typer.Option([], "--model", "-m", help="Model to diagnose (repeat for several; default: every ready model)."),
    window: Optional[float] = typer.Option(None, "--window", help=f"Passive: watch S seconds of live traffic and send nothing (the default, for {DEFAULT_WINDOW_S:g} s, unless --replay is given)."),
    replay: bool = typer.Option(False, "--replay", help="Active: send traffic, replaying rows into each --model at --concurrency or --rate (default rows: the held-out rows its compile report points to). Without it, nothing is sent."),
    client_metrics: Optional[str] = typer.Option(
        None, "--client-metrics", help="The request path's Prometheus endpoint (client/metrics.py), joined with Triton's statistics over the window (passive)."
    ),
    metrics_url: Optional[str] = typer.Option(None, "--metrics-url", help="Triton's metrics endpoint (e.g. http://127.0.0.1:8002/metrics): failures by reason, queue-policy rejections."),
    rows: Optional[Path] = typer.Option(None, "--rows", help="With --replay: replay array X of this .npz (default: the held-out rows the model's compile report points to)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="With --replay: requests to replay per model (default 500)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="With --replay: requests in flight (closed loop; default 1)."),
    rate: Optional[float] = typer.Option(None, "--rate", min=0.001, help="With --replay: requests per second (open loop) instead of a concurrency."),
    rows_per_request: Optional[int] = typer.Option(None, "--rows-per-request", min=1, help="With --replay: rows in each replayed request (default 1)."),
    repository: Optional[Path] = typer.Option(None, "--repository", "-r", help="Model repository with the compile reports (default ./model_repository)."),
    save_stats: Optional[Path] = typer.Option(None, "--save-stats", help="Save the window's Triton statistics here, for `scorestack compile --batch-profile` (default ./.scorestack/diagnose-stats.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    tls_dir: Optional[Path] = typer.Option(
        None, "--tls-dir", envvar="SCORESTACK_TLS_DIR", help="Talk gRPC over TLS with the CA (and client certificate for mutual TLS) in DIR."
    ),
) -> None:
    """Say which phase dominates a model's latency and what to do about it.

    Passive (the default; --window S, else 10 s): watch Triton's statistics over live traffic on every ready model (or each --model), sending nothing; with --client-metrics, join the request path's exported phases for an end-to-end breakdown.

    Active (only with --replay): replay rows into each --model at --concurrency or --rate (--rows, --requests, --rows-per-request). The demo's own fraud and ranking traffic is `scorestack demo diagnose`.

    Triton's statistics API may be restricted: the admin key comes from SCORESTACK_ADMIN_KEY or SCORESTACK_ADMIN_KEY_FILE, never from the command line."""
    from rich.console import Console
    from rich.markup import escape

    from scorestack import paths
    from scorestack.client import diagnose as dg
    from scorestack.client.diagnosis import render_diagnoses, to_json
    from scorestack.serve.security import ClientTls

    # No wrapping: messages stay one line each, for logs and for whoever reads them by line.
    err = Console(stderr=True, soft_wrap=True)
    replay_settings = {"--rows": rows, "--requests": requests, "--concurrency": concurrency, "--rate": rate, "--rows-per-request": rows_per_request}
    given = [k for k, v in replay_settings.items() if v is not None]
    watching = window is not None or client_metrics is not None
    # Traffic is sent only when --replay asks for it; naming a model alone watches that model.
    if given and not replay:
        raise typer.BadParameter(f"{', '.join(given)} set how to replay traffic: add --replay to send it (without --replay, diagnose watches live traffic and sends nothing)", param_hint="--replay")
    if replay and watching:
        raise typer.BadParameter("--replay sends traffic; --window and --client-metrics watch live traffic and send nothing: drop one", param_hint="--replay")
    replaying = replay
    if rate is not None and concurrency is not None:
        raise typer.BadParameter("give --rate (open loop) or --concurrency (closed loop), not both", param_hint="--rate")
    if window is not None and window <= 0:
        raise typer.BadParameter(f"{window:g} s: give a positive number of seconds of live traffic to watch", param_hint="--window")

    tls = ClientTls.from_dir(tls_dir) if tls_dir else None
    stats_file = (save_stats or paths.workspace() / "diagnose-stats.json").resolve()
    target = dg.Target(url, tuple(models), repository, metrics_url, stats_file, tls)
    # Values the command line gives are checked above (and by typer's ranges): a ValueError from here on is a bug.
    if not replaying:
        if window is None:
            window = DEFAULT_WINDOW_S
            what = ", ".join(models) if models else "every ready model"
            err.print(escape(f"no --window: passive over {what} for {window:g} s, the default window (--window S to change it); sending nothing"))

        def started(names: list[str]) -> None:
            err.print(escape(f"watching {', '.join(names)} on {url} for {window:g} s (sending nothing)"))
            sys.stderr.flush()

        result = asyncio.run(dg.watch(target, window, client_metrics=client_metrics, on_start=started))
    else:
        result = asyncio.run(_replay_all(target, rows, requests or 500, concurrency or 1, rate, rows_per_request or 1, err))
    if json_out:
        print(json.dumps(to_json(result, url=url, stats_file=str(stats_file)), indent=1))
    else:
        print(render_diagnoses(result))
        print(f"window statistics saved to {stats_file} (for scorestack compile --batch-profile)")


async def _replay_all(target, rows: Path | None, requests: int, concurrency: int, rate: float | None, rows_per_request: int, err) -> list:
    from rich.markup import escape

    from scorestack.client import replay as rp
    from scorestack.paths import default_repository

    models = list(target.models)
    if not models:
        raise BadInvocation("--replay sends rows into a served model: name it with --model M (or drop --replay to watch live traffic)")
    out = []
    for model in models:
        if rows is not None:
            data, source = rp.load_rows(rows), str(rows)
        else:
            data, source = rp.holdout_rows(target.repository or default_repository(), model)
        mode = f"{rate:g} requests/s" if rate is not None else f"concurrency {concurrency}"
        err.print(escape(f"replaying {requests} requests of {rows_per_request} row(s) into {model} at {mode}, from {source}"))
        out.append(await rp.replay(target, model, data, requests=requests, concurrency=concurrency, rate=rate, rows_per_request=rows_per_request))
    return out

