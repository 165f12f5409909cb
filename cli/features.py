"""`scorestack features ...`: write, apply and materialize a feature repository (with the demo's tables); read from any."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer

from .errors import reported

features_app = typer.Typer(no_args_is_help=True, add_completion=False, help="The Feast feature repository (fraud, ranking) and its online store.")

_REPO_DIR = typer.Option(None, "--repo-dir", help="Working feature repository [default: <workspace>/feature_repo].")


@features_app.command("apply")
@reported
def apply_command(
    repo_dir: Optional[Path] = _REPO_DIR,
    online: str = typer.Option("sqlite", "--online", help="Online store: sqlite (embedded) or redis."),
    redis_url: Optional[str] = typer.Option(None, "--redis-url", envvar="REDIS_URL", help="Redis for --online redis [default: redis://127.0.0.1:6379/0]."),
    users: int = typer.Option(5000, "--users", help="Demo users to generate."),
    items: int = typer.Option(2000, "--items", help="Demo items to generate."),
) -> None:
    """Write the feature repository (definitions, feature_store.yaml, the demo's users and items) and register it with Feast."""
    from scorestack.demo.features import init_repo
    from scorestack.features import store

    repo = init_repo(repo_dir, online=online, redis_url=redis_url, n_users=users, n_items=items)  # type: ignore[arg-type]
    store.apply(repo)
    typer.echo(f"feature repository applied: {repo} (online store: {online}); next: scorestack features materialize --repo-dir {repo}")


@features_app.command("materialize")
@reported
def materialize_command(
    repo_dir: Optional[Path] = _REPO_DIR,
    restamp: bool = typer.Option(False, "--restamp", help="First move the demo data's event times to now (a day-old demo reads as stale)."),
) -> None:
    """Load the repository's data into its online store."""
    from scorestack.features import store

    if restamp:
        from scorestack.demo.features import restamp as restamp_demo_tables

        restamp_demo_tables(repo_dir)
    fs = store.materialize(repo_dir)
    typer.echo(f"materialized into the {fs.config.online_store.type} online store of {fs.repo_path}")


def _typed(text: str, dtype: str):
    """A command-line value as the service's input type wants it (validation happens in the fetch)."""
    if dtype in ("Int64", "Int32"):
        try:
            return int(text)
        except ValueError:
            return text  # the fetch names the field and the expected type
    if dtype in ("Float32", "Float64"):
        try:
            return float(text)
        except ValueError:
            return text
    if dtype == "Bool":
        return text.lower() in ("1", "true", "yes")
    return text


@features_app.command("get")
@reported
def get_command(
    service: str = typer.Argument(..., help="Feature service (e.g. fraud, ranking, or any service of the repository)."),
    user_id: Optional[int] = typer.Option(None, "--user-id"),
    item_id: list[int] = typer.Option([], "--item-id", help="Item ids (ranking); repeat the option."),
    row: list[str] = typer.Option([], "--row", help="KEY=VALUE of an entity row: any join key or request field; repeat a key for several rows."),
    repo_dir: Optional[Path] = _REPO_DIR,
    timeout_ms: float = typer.Option(20.0, "--timeout-ms"),
) -> None:
    """Fetch one request's features through the fetch layer and print them with their status."""
    from scorestack.errors import FeatureError
    from scorestack.features.fetch import FeatureFetcher, FeatureStatus

    async def run():
        async with FeatureFetcher.from_repo(repo_dir, timeout_s=timeout_ms / 1000, services=[service]) as fetcher:
            inputs = fetcher.inputs(service)
            columns: dict[str, list] = {}
            for pair in row:
                key, sep, value = pair.partition("=")
                if not sep:
                    raise FeatureError(f"--row: expected KEY=VALUE, got {pair!r}")
                columns.setdefault(key, []).append(_typed(value, inputs.get(key, "String")))
            if user_id is not None:
                columns["user_id"] = [user_id]
            if item_id:
                columns["item_id"] = list(item_id)
            rows = {k: v[0] if len(v) == 1 else v for k, v in columns.items()}
            return await fetcher.fetch(service, rows)

    result = asyncio.run(run())
    typer.echo(
        f"{result.service} via {result.backend}: {result.values.shape[0]} row(s), degraded={result.degraded}"
        f"{f' ({result.reason})' if result.reason else ''}, {result.timings.total_s * 1e3:.2f} ms"
    )
    for r in range(result.values.shape[0]):
        for name, value, code in zip(result.feature_names, result.values[r], result.status[r]):
            typer.echo(f"  [{r}] {name:32s} {value:12.4f}  {FeatureStatus(int(code)).name.lower()}")
