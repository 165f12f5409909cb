"""`scorestack diagnose`: where time goes on a running server and feature store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, demo_app: typer.Typer) -> None:
    app.command("diagnose")(diagnose)


def diagnose(
    url: str = typer.Option(..., "--url", help="Triton gRPC address, e.g. 127.0.0.1:8001."),
    feature_repo: Optional[Path] = typer.Option(None, help="Working feature repository (default ./.scorestack/feature_repo)."),
    fraud_requests: int = typer.Option(200, help="Fraud requests to send."),
    ranking_requests: int = typer.Option(50, help="Ranking requests to send."),
    candidates: int = typer.Option(200, help="Candidates per ranking request."),
    fraud_model: str = typer.Option("fraud_xgb", help="Fraud model name in Triton."),
    ranking_model: str = typer.Option("ranking_xgb", help="Ranking model name in Triton."),
    users: int = typer.Option(5000, help="Sample user ids from 1..USERS."),
    items: int = typer.Option(2000, help="Sample item ids from 1..ITEMS."),
    tls_dir: Optional[Path] = typer.Option(
        None, "--tls-dir", envvar="SCORESTACK_TLS_DIR", help="Talk gRPC over TLS with the CA (and client certificate for mutual TLS) in DIR."
    ),
) -> None:
    """Send sample traffic, read Triton's statistics, and say which phase dominates and what to do.

    Triton's statistics API may be restricted: the admin key comes from SCORESTACK_ADMIN_KEY or
    SCORESTACK_ADMIN_KEY_FILE, never from the command line."""
    from rich.console import Console

    from scorestack import paths
    from scorestack.client.diagnose import diagnosis_line, render, run_diagnosis
    from scorestack.errors import ScorestackError
    from scorestack.serve.security import ClientTls

    console = Console()
    repo = feature_repo or paths.workspace() / "feature_repo"
    try:
        result = asyncio.run(
            run_diagnosis(url, repo, fraud_requests, ranking_requests, candidates, fraud_model=fraud_model, ranking_model=ranking_model, n_users=users, n_items=items, tls=ClientTls.from_dir(tls_dir) if tls_dir else None)
        )
    except ScorestackError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1)
    console.print(render(result))
    for b in result:
        console.print(f"[bold]diagnosis[/bold] {diagnosis_line(b)}")
