"""The end-to-end demo (`scorestack demo`): train, compile, materialize features, serve, score, diagnose, shut down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path


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


def run_demo(console, workspace: Path | None, n_fraud: int, n_ranking: int, n_candidates: int, n_vision: int = 0, *, train_threads: int = 2) -> list:
    """Run the whole demo in `workspace` (default: scorestack.paths.workspace()), printing to the rich `console`.

    The demo keeps everything in its workspace, its model repository included
    (`<workspace>/model_repository`): the project's `model_repository/` stays the user's own.
    """
    from scorestack import paths
    from scorestack.client.breakdown import diagnosis_line, render
    from scorestack.compile import compile_model
    from scorestack.features import store
    from scorestack.serve import LocalTriton

    from .features import init_repo
    from .traffic import run_diagnosis, vision_traffic
    from .train import train_demo_models, train_vision_models

    ws = Path(workspace) if workspace else paths.workspace()
    ws.mkdir(parents=True, exist_ok=True)
    models_dir, repository, feature_repo = ws / "models", ws / "model_repository", ws / "feature_repo"
    log = ws / "demo.log"
    console.print(f"workspace {ws} (build output in {log})")

    with console.status("training demo models (skipped when present)"), _quiet(log):
        specs = train_demo_models(models_dir, threads=train_threads)
        if n_vision > 0:
            # The small CNN only: the residual network is compiled by the tests and the vision benchmark.
            specs = specs + train_vision_models(models_dir, names=("digits_cnn",), threads=train_threads)
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
        init_repo(feature_repo, online=online, redis_url=redis_url)
        store.apply(feature_repo)
        store.materialize(feature_repo)
    console.print(f"[green]features[/green] materialized into {online} ({feature_repo})")

    with console.status("starting Triton"):
        server = LocalTriton(repository, exit_timeout_s=0).start()  # stopped after its own traffic is answered
    try:
        console.print(f"[green]Triton[/green] ready at {server.grpc_url} serving {', '.join(server.ready_models())}")
        breakdowns = asyncio.run(run_diagnosis(server.grpc_url, feature_repo, n_fraud, n_ranking, n_candidates))
        if n_vision > 0:
            console.print(asyncio.run(vision_traffic(server.grpc_url, models_dir, n_vision)))
    finally:
        server.stop()

    console.print(render(breakdowns))
    for b in breakdowns:
        console.print(f"[bold]diagnosis[/bold] {diagnosis_line(b)}")
    console.print("Triton stopped; demo done.")
    return breakdowns
