"""The one place where an error becomes a message and an exit code.

Every command is wrapped by `reported`: an error scorestack raises on purpose prints one line,
`error: <what was wrong and the fix>`, on stderr and exits 1 (the work failed) or 2 (the command
line asked for something that cannot be done as asked). Typer's own usage errors (an unknown flag,
a bad value: `typer.BadParameter`) keep typer's formatting and exit 2. Anything else is a bug and
keeps its traceback.

A command that needs an optional install (an extra: `compile`, `vision`, ...) says so first,
`needs("scorestack compile", "compile")`; a missing one is an error naming the extra and its `pip install` line, exit 2.
An import of an extra's module that fails deeper down is reported the same way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import typer

from scorestack.errors import ScorestackError
from scorestack.extras import MissingExtra, extra_of, require

F = TypeVar("F", bound=Callable[..., Any])

FAILED = 1  # the work failed: a model did not compile, a server did not start, a request failed
USAGE = 2  # the invocation was wrong: contradicting flags, an unusable file or key it names


class BadInvocation(Exception):
    """The command line asked for something that cannot be done as asked (flags that contradict each
    other, a key or certificate it names that cannot be used): exit 2, like a usage error."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an error the command line reports as a message; None for one it does not (a bug)."""
    from pydantic import ValidationError

    if isinstance(exc, (BadInvocation, ValidationError, MissingExtra)):
        return USAGE
    if isinstance(exc, ScorestackError):
        return FAILED
    return None


def message(exc: BaseException) -> str:
    """One line (or one line per field, for a pydantic validation error) naming what was wrong."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(input)'}: {e['msg']}" for e in exc.errors())
        return f"{exc.title}: {fields}"
    return str(exc)


def fail(exc: BaseException) -> typer.Exit:
    """Print `exc` as the command line reports errors and return the typer.Exit to raise."""
    from rich.console import Console
    from rich.markup import escape

    code = exit_code(exc)
    if code is None:
        raise exc
    # No wrapping: one message stays one line, for logs and for whoever reads them by line.
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message(exc))}")
    return typer.Exit(code)


def needs(command: str, *extras: str) -> None:
    """Stop `command` (`"scorestack compile"`) with an exit-2 message naming the `pip install` line unless `extras` are installed."""
    require(command, *extras)


def reported(func: F) -> F:
    """Wrap a command so the errors it raises are reported by `fail` (typer reads the wrapped signature)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (BadInvocation, ScorestackError) as exc:
            raise fail(exc) from None
        except ModuleNotFoundError as exc:
            extra = extra_of(exc.name)
            if extra is None:  # not an optional dependency: a broken install or a bug, keep the traceback
                raise
            raise fail(MissingExtra("this command", [extra], [(exc.name or "").split(".")[0]])) from None
        except ValueError as exc:
            if exit_code(exc) is None:  # not a pydantic ValidationError: a bug, keep the traceback
                raise
            raise fail(exc) from None

    return wrapper  # type: ignore[return-value]
