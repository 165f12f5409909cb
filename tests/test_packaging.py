"""The distribution: a non-editable install carries every stage and the model runtime; the console script lists the stages.
(The images and the compose file: tests/test_deploy.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_every_stage(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (wheel,) = wheels.glob("scorestack-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "scorestack/cli/__init__.py",
        "scorestack/cli/__main__.py",
        "scorestack/demo/__init__.py",
        "scorestack/compile/__init__.py",
        "scorestack/serve/server.py",
        "scorestack/serve/runtime/model.py",
        "scorestack/features/__init__.py",
        "scorestack/client/triton.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True, timeout=300)
    # Import from outside the checkout, with the installed copy first on the path.
    code = (
        "import scorestack, scorestack.serve, scorestack.compile, scorestack.features, scorestack.client, scorestack.demo, scorestack.cli;"
        "from scorestack.serve import runtime_source;"
        "p = runtime_source(); assert p.exists(), p;"
        f"assert str(p).startswith({str(target)!r}), p;"
        "print(scorestack.serve.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target))


def test_console_script_lists_the_stages():
    out = subprocess.run([str(Path(sys.executable).parent / "scorestack"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("serve", "server-env", "demo"):
        assert command in out.stdout
