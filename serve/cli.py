"""`scorestack serve` and `scorestack server-env`."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, demo_app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("server-env")(server_env)


def serve(
    repository: Path = typer.Option(None, "--repository", "-r", help="Model repository (default ./model_repository)."),
    grpc_port: Optional[int] = typer.Option(None, help="gRPC port (default: a free port)."),
    http_port: Optional[int] = typer.Option(None, help="HTTP port (default: a free port)."),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus metrics port (default: a free port)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    ready_timeout_s: float = typer.Option(120.0, help="Seconds to wait for readiness."),
    strict: bool = typer.Option(False, "--strict", help="Exit if any model fails to load (default: serve the models that load, report the others)."),
    watch_s: float = typer.Option(1.0, "--watch-s", help="Seconds between looks at the repository for new versions to load (0: never)."),
) -> None:
    """Run a real Triton Inference Server on this machine until Ctrl-C.

    Models that fail to load are reported with Triton's reason while the others serve; the command
    fails only if no model loads (or any, with --strict). A new version written into the repository
    (`scorestack compile`) is loaded while serving.
    """
    from rich.console import Console

    from scorestack import paths
    from scorestack.errors import ScorestackError
    from scorestack.serve import LocalTriton

    console = Console()
    repository = repository or paths.default_repository()
    server = LocalTriton(
        repository,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        host=host,
        ready_timeout_s=ready_timeout_s,
        strict=strict,
        watch_interval_s=watch_s or None,
    )
    try:
        with console.status("starting tritonserver (first run creates the server environment: a few minutes)"):
            server.start()
    except ScorestackError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1)
    console.print(f"[green]Triton ready[/green] serving {', '.join(server.ready_models()) or 'no models'} from {repository}")
    for name, status in sorted(server.model_status.items()):
        if status.ready:
            console.print(f"  [green]ready[/green]     {name} (versions {', '.join(status.versions)})", soft_wrap=True)
        else:
            console.print(f"  [red]not ready[/red] {name}: {status.reason}", soft_wrap=True)
    console.print(f"  gRPC    {server.grpc_url}\n  HTTP    {server.http_url}\n  metrics {server.metrics_url}\n  log     {server.log_path}")
    console.print("Ctrl-C to stop.")
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop and server.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if not server.is_running():
            console.print(f"[red]tritonserver exited[/red]\n{server.log_tail()}")
        server.stop()
        console.print("stopped")


def server_env(
    path: Optional[Path] = typer.Option(None, help="Where to create it (default $SCORESTACK_HOME/server-env-<hash>)."),
) -> None:
    """Create (once) the managed server environment holding tritonserver, and print where it is."""
    from scorestack.errors import ScorestackError
    from scorestack.serve import ensure_server_environment

    try:
        env = ensure_server_environment(path, quiet=False)
    except ScorestackError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    typer.echo(f"server environment: {env.root}\ntritonserver: {env.tritonserver}")
