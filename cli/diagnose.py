"""`scorestack diagnose`: where time goes on any running Triton (and the request path in front of it); with no model, rows or window it sends the demo's traffic (scorestack.demo.traffic)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import BadInvocation, reported


@reported
def diagnose(
    url: str = typer.Option(..., "--url", help="Triton gRPC address, e.g. 127.0.0.1:8001."),
    models: list[str] = typer.Option([], "--model", "-m", help="Model to diagnose (repeat for several; default: every ready model)."),
    window: Optional[float] = typer.Option(None, "--window", help="Passive: watch S seconds of live traffic and send nothing."),
    client_metrics: Optional[str] = typer.Option(
        None, "--client-metrics", help="The request path's Prometheus endpoint (client/metrics.py), joined with Triton's statistics over the window."
    ),
    metrics_url: Optional[str] = typer.Option(None, "--metrics-url", help="Triton's metrics endpoint (e.g. http://127.0.0.1:8002/metrics): failures by reason, queue-policy rejections."),
    rows: Optional[Path] = typer.Option(None, "--rows", help="Active: replay array X of this .npz (default: the held-out rows the model's compile report points to)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Active: requests to replay per model (default 500)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Active: requests in flight (closed loop; default 1)."),
    rate: Optional[float] = typer.Option(None, "--rate", min=0.001, help="Active: requests per second (open loop) instead of a concurrency."),
    rows_per_request: int = typer.Option(1, "--rows-per-request", min=1, help="Active: rows in each replayed request."),
    repository: Optional[Path] = typer.Option(None, "--repository", "-r", help="Model repository with the compile reports (default ./model_repository)."),
    save_stats: Optional[Path] = typer.Option(None, "--save-stats", help="Save the window's Triton statistics here, for `scorestack compile --batch-profile` (default ./.scorestack/diagnose-stats.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    feature_repo: Optional[Path] = typer.Option(None, help="Demo traffic: working feature repository (default ./.scorestack/feature_repo)."),
    fraud_requests: Optional[int] = typer.Option(None, help="Demo traffic: fraud requests to send (default 200)."),
    ranking_requests: Optional[int] = typer.Option(None, help="Demo traffic: ranking requests to send (default 50)."),
    candidates: Optional[int] = typer.Option(None, help="Demo traffic: candidates per ranking request (default 200)."),
    fraud_model: str = typer.Option("fraud_xgb", help="Demo traffic: fraud model name in Triton."),
    ranking_model: str = typer.Option("ranking_xgb", help="Demo traffic: ranking model name in Triton."),
    users: Optional[int] = typer.Option(None, help="Demo traffic: sample user ids from 1..USERS (default 5000)."),
    items: Optional[int] = typer.Option(None, help="Demo traffic: sample item ids from 1..ITEMS (default 2000)."),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", min=0, max=65535, help="Demo traffic: serve its request-phase and feature-fetch metrics at http://ADDRESS:PORT/metrics while it runs."
    ),
    metrics_address: str = typer.Option(
        "127.0.0.1", "--metrics-address", help="Address --metrics-port binds (0.0.0.0 inside a container network, for Prometheus)."
    ),
    tls_dir: Optional[Path] = typer.Option(
        None, "--tls-dir", envvar="SCORESTACK_TLS_DIR", help="Talk gRPC over TLS with the CA (and client certificate for mutual TLS) in DIR."
    ),
) -> None:
    """Say which phase dominates a model's latency and what to do about it.

    Passive (--window S): watch Triton's statistics over live traffic, sending nothing; with --client-metrics, join the request path's exported phases for an end-to-end breakdown.

    Active (--model, --rows): replay rows at --concurrency or --rate. Neither: send the demo's fraud and ranking traffic through the demo services.

    Triton's statistics API may be restricted: the admin key comes from SCORESTACK_ADMIN_KEY or SCORESTACK_ADMIN_KEY_FILE, never from the command line."""
    from rich.console import Console
    from rich.markup import escape

    from scorestack import paths
    from scorestack.client import diagnose as dg
    from scorestack.serve.security import ClientTls

    # No wrapping: messages stay one line each, for logs and for whoever reads them by line.
    err = Console(stderr=True, soft_wrap=True)
    demo_flags = {"--metrics-port": metrics_port, "--feature-repo": feature_repo, "--fraud-requests": fraud_requests, "--ranking-requests": ranking_requests, "--candidates": candidates, "--users": users, "--items": items}
    active_flags = {"--rows": rows, "--requests": requests, "--concurrency": concurrency, "--rate": rate}
    passive = window is not None or client_metrics is not None
    replaying = not passive and (bool(models) or rows is not None)
    if client_metrics is not None and window is None:
        raise typer.BadParameter("--client-metrics joins two readings over a window: give --window S as well", param_hint="--window")
    if passive and any(v is not None for v in active_flags.values()):
        given = [k for k, v in active_flags.items() if v is not None]
        raise typer.BadParameter(f"{', '.join(given)} replay traffic; --window watches live traffic and sends nothing: drop one", param_hint="--window")
    if (passive or replaying) and any(v is not None for v in demo_flags.values()):
        given = [k for k, v in demo_flags.items() if v is not None]
        raise typer.BadParameter(f"{', '.join(given)} apply to the demo's traffic only (no --model, --rows or --window)", param_hint=given[0])
    if rate is not None and concurrency is not None:
        raise typer.BadParameter("give --rate (open loop) or --concurrency (closed loop), not both", param_hint="--rate")

    tls = ClientTls.from_dir(tls_dir) if tls_dir else None
    stats_file = (save_stats or paths.workspace() / "diagnose-stats.json").resolve()
    target = dg.Target(url, tuple(models), repository, metrics_url, stats_file, tls)
    try:
        if passive:
            def started(names: list[str]) -> None:
                err.print(escape(f"watching {', '.join(names)} on {url} for {window:g} s (sending nothing)"))
                sys.stderr.flush()

            result = asyncio.run(dg.watch(target, window, client_metrics=client_metrics, on_start=started))
        elif replaying:
            result = asyncio.run(_replay_all(target, rows, requests or 500, concurrency or 1, rate, rows_per_request, err))
        else:
            _demo(
                url, feature_repo, fraud_model, ranking_model, tls, json_out, err,
                fraud_requests=fraud_requests, ranking_requests=ranking_requests, candidates=candidates, users=users, items=items,
                metrics_port=metrics_port, metrics_address=metrics_address,
            )  # fmt: skip
            return
    except ValueError as exc:  # a value the command line gave (a window, rows for several models)
        raise BadInvocation(str(exc)) from exc
    if json_out:
        print(json.dumps(dg.to_json(result, url=url, stats_file=str(stats_file)), indent=1))
    else:
        print(dg.render_diagnoses(result))
        print(f"window statistics saved to {stats_file} (for scorestack compile --batch-profile)")


async def _replay_all(target, rows: Path | None, requests: int, concurrency: int, rate: float | None, rows_per_request: int, err) -> list:  # noqa: ANN001
    from rich.markup import escape

    from scorestack.client import replay as rp
    from scorestack.paths import default_repository

    models = list(target.models)
    if not models:
        raise BadInvocation("--rows replays into one model: name it with --model")
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


def _demo(url: str, feature_repo: Path | None, fraud_model: str, ranking_model: str, tls, json_out: bool, err, metrics_port: int | None = None, metrics_address: str = "127.0.0.1", **counts) -> None:  # noqa: ANN001
    """The demo's fraud and ranking traffic through the demo services (what `scorestack demo` and the compose demo run)."""
    from dataclasses import asdict

    from rich.console import Console

    from scorestack import paths
    from scorestack.client.diagnose import diagnosis_line, render
    from scorestack.demo.traffic import DEFAULTS, run_diagnosis

    n = {k: counts.get(k) if counts.get(k) is not None else v for k, v in DEFAULTS.items()}
    repo = feature_repo or paths.workspace() / "feature_repo"
    err.print("no --model, --rows or --window: sending the demo's fraud and ranking traffic (--window S watches your own traffic)")
    registry = http = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from scorestack.client.metrics import serve

        registry = CollectorRegistry()
        http, _ = serve(metrics_port, registry, addr=metrics_address)
        err.print(f"request metrics at http://{metrics_address}:{http.server_port}/metrics while the traffic runs")
    try:
        result = asyncio.run(
            run_diagnosis(
                url, repo, n["fraud_requests"], n["ranking_requests"], n["candidates"],
                fraud_model=fraud_model, ranking_model=ranking_model, n_users=n["users"], n_items=n["items"], tls=tls, registry=registry,
            )  # fmt: skip
        )
    finally:
        if http is not None:
            http.shutdown()
    if json_out:
        print(json.dumps({"mode": "demo", "url": url, "services": [asdict(b) for b in result]}, indent=1))
        return
    console = Console()
    console.print(render(result))
    for b in result:
        console.print(f"[bold]diagnosis[/bold] {diagnosis_line(b)}")
