"""`scorestack demo` (the whole demo, no flags needed) and `scorestack demo train`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from .errors import reported


@reported
def demo(
    ctx: typer.Context,
    workspace: Optional[Path] = typer.Option(None, help="Where demo state lives, its model repository included (default ./.scorestack)."),
    fraud_requests: int = typer.Option(300, help="Fraud requests to send."),
    ranking_requests: int = typer.Option(100, help="Ranking requests to send."),
    candidates: int = typer.Option(200, help="Candidates per ranking request."),
    vision_requests: int = typer.Option(200, help="Images to classify with the vision demo model, one per request (0: skip the vision model)."),
) -> None:
    """Run the whole demo on this machine, with nothing else running and no flags needed."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    from scorestack.demo.run import run_demo

    # The console keeps the terminal while native build chatter goes to the workspace log.
    console = Console(file=os.fdopen(os.dup(1), "w", buffering=1))
    run_demo(console, workspace, fraud_requests, ranking_requests, candidates, vision_requests)


@reported
def train(
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for models, held-out rows and specs (default: <workspace>/models)."),
    vision: bool = typer.Option(False, "--vision/--no-vision", help="Also train the image classifiers (a small CNN and a small residual network on upsampled digits)."),
) -> None:
    """Train the demo models (fraud XGBoost, fraud scikit-learn, XGBRanker; with --vision the digit CNNs) and write their specs."""
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
