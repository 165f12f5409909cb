"""`scorestack serve`, `scorestack server-env` and `scorestack dev-certs`: the local Triton's commands."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer

from .errors import BadInvocation, reported


@reported
def serve(
    repository: Path = typer.Option(None, "--repository", "-r", help="Model repository (default ./model_repository, or $SCORESTACK_REPOSITORY)."),
    grpc_port: Optional[int] = typer.Option(None, help="gRPC port (default: a free port)."),
    http_port: Optional[int] = typer.Option(None, help="HTTP port (default: a free port)."),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus metrics port (default: a free port)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    ready_timeout_s: float = typer.Option(120.0, help="Seconds to wait for readiness."),
    strict: bool = typer.Option(False, "--strict", help="Exit if any model fails to load (default: serve the models that load, report the others)."),
    watch_s: float = typer.Option(1.0, "--watch-s", help="Seconds between looks at the repository for new versions to load (0: never)."),
    tls_dir: Optional[Path] = typer.Option(None, "--tls-dir", help="Serve gRPC over TLS with DIR/server.crt and DIR/server.key (`scorestack dev-certs DIR` makes throwaway ones)."),
    mtls: bool = typer.Option(False, "--mtls", help="With --tls-dir: mutual TLS, clients must present a certificate signed by DIR/ca.crt."),
    admin_key_file: Optional[Path] = typer.Option(None, "--admin-key-file", help="File holding the admin key (default: $SCORESTACK_ADMIN_KEY, else the file $SCORESTACK_ADMIN_KEY_FILE). Never pass the key itself on a command line."),
    allow_open_admin: bool = typer.Option(False, "--allow-open-admin", help="Serve on a non-loopback address without an admin key (anyone who reaches the port may load and unload models)."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="CPUs tritonserver may run on, e.g. 1 or 2-3 (default: all of this process's). Give the server cores of its own where its callers share the machine."),
    exit_timeout_s: int = typer.Option(30, "--exit-timeout-s", min=0, help="At Ctrl-C, seconds to let in-flight requests finish (Triton's --exit-timeout-secs); 0 stops at once."),
) -> None:
    """Run a real Triton Inference Server on this machine until Ctrl-C.

    Models that fail to load are reported with Triton's reason while the others serve; the command
    fails only if no model loads (or any, with --strict). A new version written into the repository
    (`scorestack compile`) is loaded while serving.

    With an admin key (env or file), Triton's model-repository, shared-memory, statistics, trace and
    logging APIs need it; inference, metadata, model config and health stay open.
    """
    from rich.console import Console

    from scorestack import paths
    from scorestack.errors import ScorestackError
    from scorestack.serve import LocalTriton
    from scorestack.serve.security import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, ADMIN_KEY_HEADER, RESTRICTED_APIS, ServerTls, is_loopback, load_admin_key

    console = Console()
    repository = repository or paths.default_repository()
    try:
        admin_key = load_admin_key(admin_key_file)
        tls = ServerTls.from_dir(tls_dir, mutual=mtls) if tls_dir else None
    except ScorestackError as exc:  # the key or certificates the command line points to
        raise BadInvocation(str(exc)) from exc
    if mtls and tls is None:
        raise BadInvocation("--mtls needs --tls-dir DIR (with ca.crt, server.crt, server.key)")
    if admin_key is None and not is_loopback(host) and not allow_open_admin:
        raise BadInvocation(
            f"serving on {host} without an admin key would let anyone who reaches the port load and unload "
            f"models: set {ADMIN_KEY_ENV} or {ADMIN_KEY_FILE_ENV} (or --admin-key-file), or pass --allow-open-admin"
        )
    server = LocalTriton(
        repository,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        host=host,
        ready_timeout_s=ready_timeout_s,
        strict=strict,
        watch_interval_s=watch_s or None,
        admin_key=admin_key,
        tls=tls,
        cpus=cpus,
        exit_timeout_s=exit_timeout_s,
    )
    with console.status("starting tritonserver (first run creates the server environment: a few minutes)"):
        server.start()
    console.print(f"[green]Triton ready[/green] serving {', '.join(server.ready_models()) or 'no models'} from {repository}")
    for name, status in sorted(server.model_status.items()):
        if status.ready:
            console.print(f"  [green]ready[/green]     {name} (versions {', '.join(status.versions)})", soft_wrap=True)
        else:
            console.print(f"  [red]not ready[/red] {name}: {status.reason}", soft_wrap=True)
    if server.cpus is not None:
        console.print(f"  cpus    {','.join(str(c) for c in sorted(server.cpus))}")
    console.print(f"  gRPC    {server.grpc_url}{' (mutual TLS)' if mtls else ' (TLS)' if tls else ' (plaintext)'}\n  HTTP    {server.http_url} (plaintext)\n  metrics {server.metrics_url}\n  log     {server.log_path}")
    if admin_key is not None:
        # The key's source, never the key.
        console.print(f"  admin   {', '.join(RESTRICTED_APIS)} restricted to callers with header {ADMIN_KEY_HEADER!r} (key from {admin_key.source})", soft_wrap=True)
    else:
        console.print(f"  [yellow]admin   open[/yellow]: anyone who reaches these ports may load and unload models; set {ADMIN_KEY_ENV} or {ADMIN_KEY_FILE_ENV} to restrict", soft_wrap=True)
    console.print("Ctrl-C to stop.")
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    # SIGINT explicitly too: a process started in the background by a non-interactive shell (CI
    # scripts, `cmd &`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _stop)
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


@reported
def server_env(
    path: Optional[Path] = typer.Option(None, help="Where to create it (default $SCORESTACK_HOME/server-env-<hash>)."),
) -> None:
    """Create (once) the managed server environment holding tritonserver, and print where it is."""
    from scorestack.serve import ensure_server_environment

    env = ensure_server_environment(path, quiet=False)
    typer.echo(f"server environment: {env.root}\ntritonserver: {env.tritonserver}")


@reported
def dev_certs(
    directory: Path = typer.Argument(..., help="Where to write ca.crt, server.crt/.key and client.crt/.key."),
    host: list[str] = typer.Option(["127.0.0.1", "localhost"], "--host", help="Names and addresses the server certificate is valid for (repeat)."),
    days: int = typer.Option(7, help="Validity in days."),
) -> None:
    """Create a THROWAWAY CA, server and client certificate for local TLS tests and demos (never production)."""
    from scorestack.serve.devcerts import write_dev_certs

    files = write_dev_certs(directory, hosts=tuple(host), days=days)
    typer.echo(f"throwaway TLS files in {files.directory} (valid {days} days, for tests and demos only):")
    for p in (files.ca, files.server_cert, files.server_key, files.client_cert, files.client_key):
        typer.echo(f"  {p}")
    typer.echo(f"serve: scorestack serve --tls-dir {files.directory} [--mtls]; clients: SCORESTACK_TLS_DIR={files.directory}")
