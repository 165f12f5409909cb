"""`scorestack demo`: train, compile, materialize features, serve, score, diagnose, shut down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, demo_app: typer.Typer) -> None:
    demo_app.callback(invoke_without_command=True)(demo)


def demo(
    ctx: typer.Context,
    workspace: Optional[Path] = typer.Option(None, help="Where demo state lives (default ./.scorestack)."),
    fraud_requests: int = typer.Option(300, help="Fraud requests to send."),
    ranking_requests: int = typer.Option(100, help="Ranking requests to send."),
    candidates: int = typer.Option(200, help="Candidates per ranking request."),
    vision_requests: int = typer.Option(200, help="Images to classify with the vision demo model, one per request (0: skip the vision model)."),
) -> None:
    """Run the whole demo on this machine, with nothing else running and no flags needed."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console

    from scorestack.errors import ScorestackError

    # The console keeps the terminal while native build chatter goes to the workspace log.
    console = Console(file=os.fdopen(os.dup(1), "w", buffering=1))
    try:
        run_demo(console, workspace, fraud_requests, ranking_requests, candidates, vision_requests)
    except ScorestackError as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        raise typer.Exit(1)


@contextlib.contextmanager
def _quiet(log_path: Path):
    """Send native libraries' chatter (TL2cgen, Treelite, Feast's progress) to a log file, not the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_demo(console, workspace: Path | None, n_fraud: int, n_ranking: int, n_candidates: int, n_vision: int = 0) -> list:
    from scorestack import paths
    from scorestack.client.diagnose import diagnosis_line, render, run_diagnosis
    from scorestack.compile import compile_model, train_demo_models
    from scorestack.features import store
    from scorestack.serve import LocalTriton

    ws = Path(workspace) if workspace else paths.workspace()
    ws.mkdir(parents=True, exist_ok=True)
    models_dir, repository, feature_repo = ws / "models", ws / "model_repository", ws / "feature_repo"
    log = ws / "demo.log"
    console.print(f"workspace {ws} (build output in {log})")

    with console.status("training demo models (skipped when present)"), _quiet(log):
        specs = train_demo_models(models_dir)
        if n_vision > 0:
            from scorestack.compile.demo import train_vision_models

            # The small CNN only: the residual network is compiled by the tests and the vision benchmark.
            specs = specs + train_vision_models(models_dir, names=("digits_cnn",))
    console.print(f"[green]models[/green] {', '.join(p.stem for p in specs)} in {models_dir}")
    for spec in specs:
        with console.status(f"compiling {spec.stem} (skipped when unchanged)"), _quiet(log):
            report = compile_model(spec, repository)
        check = report.serve_check.status if report.serve_check else "skipped"
        console.print(
            f"[green]compiled[/green] {spec.stem}: selected {report.selected.format}, version {report.version}, "
            f"serving check {check}" + (" (unchanged, not recompiled)" if report.skipped else "")
        )

    redis_url = os.environ.get("REDIS_URL")
    online = "redis" if redis_url else "sqlite"
    with console.status(f"feature store: apply and materialize ({online})"), _quiet(log):
        store.init_repo(feature_repo, online=online, redis_url=redis_url)
        store.apply(feature_repo)
        store.materialize(feature_repo)
    console.print(f"[green]features[/green] materialized into {online} ({feature_repo})")

    with console.status("starting Triton"):
        server = LocalTriton(repository).start()
    try:
        console.print(f"[green]Triton[/green] ready at {server.grpc_url} serving {', '.join(server.ready_models())}")
        breakdowns = asyncio.run(run_diagnosis(server.grpc_url, feature_repo, n_fraud, n_ranking, n_candidates))
        if n_vision > 0:
            console.print(asyncio.run(_vision_traffic(server.grpc_url, models_dir, n_vision)))
    finally:
        server.stop()

    console.print(render(breakdowns))
    for b in breakdowns:
        console.print(f"[bold]diagnosis[/bold] {diagnosis_line(b)}")
    console.print("Triton stopped; demo done.")
    return breakdowns


async def _vision_traffic(grpc_url: str, models_dir: Path, n: int) -> str:
    """Classify held-out digit images, one raw uint8 image per request, through the vision request path."""
    import numpy as np

    from scorestack.client.triton import TritonClient
    from scorestack.client.vision import VisionService

    data = np.load(models_dir / "digits_holdout.npz")
    X, y = data["X"], data["y"]
    correct, totals, infers = 0, [], []
    async with TritonClient(grpc_url, deadline_s=2.0) as triton:
        service = VisionService(triton, model="digits_cnn")
        for i in range(n):
            result = await service.classify(X[i % len(X)])
            correct += int(result.classes[0] == y[i % len(X)])
            totals.append(result.timings_ms["total"])
            infers.append(result.timings_ms["infer"])
    return (
        f"[bold]vision[/bold] digits_cnn: {n} images as raw uint8 [32, 32, 1] over gRPC, {100 * correct / n:.1f}% correct; "
        f"p50 total {np.median(totals):.2f} ms (infer {np.median(infers):.2f} ms), p99 {np.percentile(totals, 99):.2f} ms"
    )
