"""`scorestack compile`: specs to verified, measured Triton model folders (heavy modules load inside the command)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .errors import FAILED, needs, reported


@reported
def compile_command(
    specs: list[Path] = typer.Argument(..., help="Model spec YAML files to compile.", show_default=False),
    repository: Optional[Path] = typer.Option(None, "--repository", "-r", help="Triton model repository to write (default: ./model_repository, or $SCORESTACK_REPOSITORY)."),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Specs compiled at once, each in its own process (timings share the CPUs)."),
    force: bool = typer.Option(False, "--force", "-f", help="Recompile even when spec, source and held-out rows are unchanged."),
    serve_check: bool = typer.Option(True, "--serve-check/--no-serve-check", help="Load each new model in the local Triton and check it over gRPC before it joins the repository."),
    batch_profile: Optional[Path] = typer.Option(
        None,
        "--batch-profile",
        help="Triton's statistics JSON of the served models (curl HOST:8000/v2/models/stats): fit weights, dispatch bands and batching to the batch sizes they executed.",
    ),
    serve_url: Optional[str] = typer.Option(None, "--serve-url", help="gRPC address of a Triton serving the repository (e.g. 127.0.0.1:8001): load each new version there (hot-swap)."),
) -> None:
    """Compile trained models into verified, measured Triton model folders.

    Each compile adds a version to `<repository>/<name>/`; with --serve-url the running server loads
    it while the previous version finishes its requests.
    """
    needs("scorestack compile", *_extras_for(specs))
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from scorestack.compile import compile_many
    from scorestack.paths import default_repository

    console = Console()
    repo = repository or default_repository()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as progress:
        overall = progress.add_task(f"compiling into {repo}", total=len(specs))

        def on_update(spec: str, result) -> None:
            if result is None:
                progress.console.log(f"[cyan]start[/] {spec}")
                return
            progress.advance(overall)
            colour = {"compiled": "green", "skipped": "blue", "failed": "red"}[result.status]
            progress.console.log(f"[{colour}]{result.status}[/] {result.name} ({result.duration_s:.1f} s)")

        results = compile_many(specs, repo, jobs=jobs, force=force, on_update=on_update, serve_check=serve_check, batch_profile=batch_profile)
    swap_errors = []
    if serve_url:
        from scorestack.errors import ServerError, TlsError
        from scorestack.serve.control import load_version

        for r in results:
            if r.status == "compiled" and r.version is not None:
                try:
                    took = load_version(serve_url, r.name, r.version)
                    console.print(f"[green]serving[/] {r.name} version {r.version} on {serve_url} ({took:.1f} s)")
                except (ServerError, TlsError) as exc:
                    swap_errors.append(str(exc))
                    console.print(f"[red]hot-swap failed[/] {exc}")

    table = Table(title="compile summary")
    for col in ("model", "status", "selected", "version", "µs per call by batch", "time s", "error"):
        table.add_column(col)
    for r in results:
        lat = ", ".join(f"{b}: {v:.1f}" for b, v in r.latency_us.items())
        colour = {"compiled": "green", "skipped": "blue", "failed": "red"}[r.status]
        table.add_row(r.name, f"[{colour}]{r.status}[/]", r.selected or "–", str(r.version or "–"), lat or "–", f"{r.duration_s:.1f}", (r.error or "").splitlines()[0][:200] if r.error else "")
    console.print(table)
    failed = [r for r in results if not r.ok]
    for r in failed:
        console.print(f"[red]{r.name}[/] ({r.spec}):\n{r.error}")
    if failed or swap_errors:
        raise typer.Exit(code=FAILED)


def _extras_for(specs: list[Path]) -> list[str]:
    """The extras compiling `specs` needs: `compile`, and `vision` when one is an image model. A spec
    that does not load is left to the compile, which reports it with the rest."""
    from scorestack.compile.spec import load_spec

    extras = ["compile"]
    for path in specs:
        try:
            if load_spec(path).is_vision:
                return [*extras, "vision"]
        except Exception:  # a spec that does not load: compile_many reports it, per spec
            continue
    return extras
