"""Pin every distribution the scorestack image installs, from the environments the tests ran in.

    .venv/bin/python deploy/scorestack/lock.py          # rewrite both files
    .venv/bin/python deploy/scorestack/lock.py --check  # exit 1 if either differs from the environments

- constraints.txt: the project environment (.venv: Python 3.11.7 on Debian 12 x86_64, as the image's
  base), the closure of what the image installs: the project with the extras in IMAGE (bench, dev and
  gpu are not in the image).
- server-env-constraints.txt: the server environment (`scorestack server-env`), the closure of
  serve/environment.py's SERVER_REQUIREMENTS (nvidia-pytriton + serve/runtime/requirements.txt).

Each closure is walked through the installed distributions' metadata under that interpreter's
markers. tests/test_deploy.py checks both files against the environments the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "constraints.txt"
SERVER_CONSTRAINTS = HERE / "server-env-constraints.txt"
HEADER = """\
# {what}, pinned. The Dockerfile installs with this file as pip constraints.
# Generated from {where}, where the tests ran, by deploy/scorestack/lock.py: do not edit by hand.
"""


def _canon(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """{canonical name: installed version} of the roots' requirements, transitively (the roots'
    own versions included, except the project's)."""
    from packaging.requirements import Requirement  # in both environments

    seen: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = []
    for root in roots:
        req = Requirement(root)
        todo.append((_canon(req.name), frozenset(_canon(e) for e in req.extras)))
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        dist = metadata.distribution(name)
        if name != "scorestack":
            seen[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            todo.append((_canon(req.name), frozenset(_canon(e) for e in req.extras)))
    return seen


# What the Dockerfile installs: the base (serving, scoring, features) and the compiler with every
# CPU candidate, image models included (its torch is the CPU build it installs first).
IMAGE = "scorestack[compile,vision,hummingbird]"


def project_pins() -> dict[str, str]:
    return closure([IMAGE])


def server_pins(python: Path | None = None) -> dict[str, str]:
    """The closure in the server environment, walked by its own interpreter."""
    from scorestack.serve.environment import SERVER_REQUIREMENTS, ensure_server_environment

    python = python or ensure_server_environment().python
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import lock; print(json.dumps(lock.closure({list(SERVER_REQUIREMENTS)!r})))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def render(pins: dict[str, str], what: str, where: str) -> str:
    return HEADER.format(what=what, where=where) + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def read(path: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file; every line must pin with ==."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep or not version:
                raise ValueError(f"{path}: {line!r} is not pinned with ==")
            pins[_canon(name)] = version
    return pins


def expected() -> dict[Path, str]:
    return {
        CONSTRAINTS: render(project_pins(), "Every distribution of the scorestack image's Python", "the project environment (.venv)"),
        SERVER_CONSTRAINTS: render(server_pins(), "Every distribution of the image's server environment", "`scorestack server-env`"),
    }


def main(argv: list[str]) -> int:
    want = expected()
    if argv[1:] == ["--check"]:
        stale = [p.name for p, text in want.items() if not p.exists() or p.read_text() != text]
        if stale:
            print(f"{', '.join(stale)} differ from the environments: run .venv/bin/python deploy/scorestack/lock.py", file=sys.stderr)
            return 1
        return 0
    for path, text in want.items():
        path.write_text(text)
        print(f"{path}: {len(read(path))} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
