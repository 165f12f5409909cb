"""`scorestack demo` (the whole demo, no flags needed), `scorestack demo train` and `scorestack demo diagnose`."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Optional

import typer

from .errors import needs, reported


@reported
def demo(
    ctx: typer.Context,
    workspace: Optional[Path] = typer.Option(None, help="Where demo state lives, its model repository included (default ./.scorestack)."),
    fraud_requests: int = typer.Option(300, help="Fraud requests to send."),
    ranking_requests: int = typer.Option(100, help="Ranking requests to send."),
    candidates: int = typer.Option(200, help="Candidates per ranking request."),
    vision_requests: int = typer.Option(200, help="Images to classify with the vision demo model, one per request (0: skip the vision model)."),
    train_threads: int = typer.Option(2, min=1, help="Threads for training the demo models (1 on a machine busy with other work: two threads that wait on each other's core train several times slower)."),
) -> None:
    """Run the whole demo on this machine, with nothing else running and no flags needed."""
    if ctx.invoked_subcommand is not None:
        return
    # It trains and compiles the demo's models; the digits CNN (vision requests) needs torch.
    needs("scorestack demo", "compile", *(["vision"] if vision_requests > 0 else []))
    from rich.console import Console

    from scorestack.demo.run import run_demo

    # The console keeps the terminal while native build chatter goes to the workspace log.
    console = Console(file=os.fdopen(os.dup(1), "w", buffering=1))
    run_demo(console, workspace, fraud_requests, ranking_requests, candidates, vision_requests, train_threads=train_threads)


@reported
def train(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for models, held-out rows and specs (default: <workspace>/models)."),
    vision: bool = typer.Option(False, "--vision/--no-vision", help="Also train the image classifiers (a small CNN and a small residual network on upsampled digits)."),
) -> None:
    """Train the demo models (fraud XGBoost, fraud scikit-learn, XGBRanker; with --vision the digit CNNs) and write their specs."""
    needs("scorestack demo train", "compile", *(["vision"] if vision else []))
    from rich.console import Console

    from scorestack.demo.train import train_demo_models, train_vision_models
    from scorestack.paths import workspace

    out_dir = out or workspace() / "models"
    console = Console()
    with console.status(f"training demo models into {out_dir}"):
        specs = train_demo_models(out_dir)
    if vision:
        with console.status(f"training the vision demo models into {out_dir}"):
            specs += train_vision_models(out_dir)
    for s in specs:
        console.print(f"spec: {s}")


@reported
def diagnose(
    url: str = typer.Option(..., "--url", help="Triton gRPC address serving the demo models, e.g. 127.0.0.1:8001."),
    feature_repo: Optional[Path] = typer.Option(None, help="Working demo feature repository (default ./.scorestack/feature_repo)."),
    fraud_requests: Optional[int] = typer.Option(None, min=1, help="Fraud requests to send (default 200)."),
    ranking_requests: Optional[int] = typer.Option(None, min=0, help="Ranking requests to send (default 50; 0 sends none)."),
    candidates: Optional[int] = typer.Option(None, min=1, help="Candidates per ranking request (default 200)."),
    fraud_model: str = typer.Option("fraud_xgb", help="Fraud model name in Triton."),
    ranking_model: str = typer.Option("ranking_xgb", help="Ranking model name in Triton."),
    users: Optional[int] = typer.Option(None, min=1, help="Sample user ids from 1..USERS (default 5000)."),
    items: Optional[int] = typer.Option(None, min=1, help="Sample item ids from 1..ITEMS (default 2000)."),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", min=0, max=65535, help="Serve the traffic's request-phase and feature-fetch metrics at http://ADDRESS:PORT/metrics while it runs."
    ),
    metrics_address: str = typer.Option(
        "127.0.0.1", "--metrics-address", help="Address --metrics-port binds (0.0.0.0 inside a container network, for Prometheus)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    velocity: bool = typer.Option(
        False, "--velocity", help="Read the windowed velocity counters and add each scored transaction to them (exact under several replicas at once)."
    ),
    tls_dir: Optional[Path] = typer.Option(
        None, "--tls-dir", envvar="SCORESTACK_TLS_DIR", help="Talk gRPC over TLS with the CA (and client certificate for mutual TLS) in DIR."
    ),
) -> None:
    """Send the demo's fraud and ranking traffic through the demo services and say where the time went (the compose `demo` service).

    For your own models and traffic use `scorestack diagnose`, which sends nothing unless asked to replay. Triton's statistics API may be restricted: the admin key comes from SCORESTACK_ADMIN_KEY or SCORESTACK_ADMIN_KEY_FILE, never from the command line."""
    from dataclasses import asdict

    from rich.console import Console

    from scorestack import paths
    from scorestack.client.breakdown import diagnosis_line, render
    from scorestack.demo.traffic import DEFAULTS, run_diagnosis
    from scorestack.serve.security import ClientTls

    # No wrapping: messages stay one line each, for logs and for whoever reads them by line.
    err = Console(stderr=True, soft_wrap=True)
    given = {"fraud_requests": fraud_requests, "ranking_requests": ranking_requests, "candidates": candidates, "users": users, "items": items}
    n = {k: given[k] if given[k] is not None else v for k, v in DEFAULTS.items()}
    repo = feature_repo or paths.workspace() / "feature_repo"
    tls = ClientTls.from_dir(tls_dir) if tls_dir else None
    err.print(f"sending the demo's traffic to {url}: {n['fraud_requests']} fraud requests ({fraud_model}), {n['ranking_requests']} ranking requests of {n['candidates']} candidates ({ranking_model})")
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
                fraud_model=fraud_model, ranking_model=ranking_model, n_users=n["users"], n_items=n["items"], tls=tls, registry=registry, velocity=velocity,
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
