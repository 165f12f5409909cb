"""The `scorestack` command line: each stage registers its own commands."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Compile classical ML models and serve them through Triton.")
demo_app = typer.Typer(add_completion=False, help="The end-to-end demo (run with no sub-command) and its parts.")
app.add_typer(demo_app, name="demo")

# Each stage's cli module defines `register(app, demo_app)` and imports its heavy modules lazily,
# inside the commands, so `scorestack --help` stays fast.
_STAGES = (
    "scorestack.serve.cli",
    "scorestack.compile.cli",
    "scorestack.features.cli",
    "scorestack.client.cli",
    "scorestack.demo",
)


def _register_stages() -> None:
    for name in _STAGES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # stage without commands yet
                continue
            raise
        module.register(app, demo_app)


_register_stages()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
