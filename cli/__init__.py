"""The `scorestack` command line: the thin top floor over the stages and the demo room.

One module per stage's commands (`compile`, `serve`, `features`, `diagnose`) and the demo's
(`demo`); `errors` is the one place where an error becomes a message and an exit code. Heavy
modules are imported inside the commands, so `scorestack --help` stays fast.
"""

from __future__ import annotations

import typer

from . import compile as _compile
from . import demo as _demo
from . import diagnose as _diagnose
from . import features as _features
from . import serve as _serve

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Compile classical ML models and serve them through Triton.")
demo_app = typer.Typer(add_completion=False, help="The end-to-end demo (run with no sub-command) and its parts.")

app.command("serve")(_serve.serve)
app.command("server-env")(_serve.server_env)
app.command("dev-certs")(_serve.dev_certs)
app.command("compile")(_compile.compile_command)
app.add_typer(_features.features_app, name="features")
app.command("diagnose")(_diagnose.diagnose)
app.add_typer(demo_app, name="demo")
demo_app.callback(invoke_without_command=True)(_demo.demo)
demo_app.command("train")(_demo.train)
demo_app.command("diagnose")(_demo.diagnose)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
