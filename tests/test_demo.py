"""The README's first command, minus setup: `scorestack demo` trains, compiles, serves and prints the table.

The workspace starts with what the session's `compiled_demo` fixture already made with the very calls
the demo makes (`train_demo_models(threads=1)`, `compile_model`): the trained models, and the two XGBoost
models compiled. So the demo skips training and those two compiles (it says so: a path users take on
every second run) and compiles `fraud_sklearn` itself, through its own quiet-output wrapper, from an
empty model folder. The cold training and the XGBoost compiles are the fixture's, asserted in
test_compile_demo.py; doing them twice cost the suite about 90 worker-seconds. The demo runs without
its vision step (`--vision-requests 0`): training and compiling the digits CNN took 86 of its 100 s, and
test_vision.py trains and compiles that model and runs the demo's `vision_traffic` against it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)


SEEDED = ("fraud_xgb", "ranking_xgb")  # compiled by the fixture; fraud_sklearn the demo compiles


def test_demo_runs_end_to_end(tmp_path, server_environment, compiled_demo):
    models_dir, repository, _, _ = compiled_demo
    ws = tmp_path / "ws"
    shutil.copytree(models_dir, ws / "models")
    for name in SEEDED:
        shutil.copytree(repository / name, ws / "model_repository" / name)
    exe = Path(sys.executable).parent / "scorestack"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the default path: SQLite
    env["SCORESTACK_WORKSPACE"] = str(ws)
    env["COLUMNS"] = "200"  # rich wraps at 80 columns without a terminal; one line per compiled model
    run_tmp = tmp_path / "tmp"  # the server's run directory lands here, so we can see it is gone
    run_tmp.mkdir()
    env["TMPDIR"] = str(run_tmp)
    out = subprocess.run(
        # One training thread: the suite runs two workers on 2 cores (docs/testing.md).
        [str(exe), "demo", "--fraud-requests", "60", "--ranking-requests", "15", "--candidates", "100", "--train-threads", "1",
         "--vision-requests", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "Where the time goes" in text
    for phase in ("validate", "features", "assemble", "infer", "total"):
        assert phase in text
    assert "diagnosis fraud:" in text and "diagnosis ranking:" in text
    assert "Triton stopped; demo done." in text
    for name in ("fraud_xgb", "ranking_xgb", "fraud_sklearn"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"compiled {name}: selected "))
        assert "serving check passed" in line and ("(unchanged, not recompiled)" in line) == (name in SEEDED), line
        assert (ws / "model_repository" / name / "report.json").exists()
    assert (ws / "feature_repo" / "feature_store.yaml").exists()
    # Shut down cleanly: no tritonserver outlives the demo, and its run directory is removed.
    ps = subprocess.run(["pgrep", "-f", f"--model-repository={run_tmp}"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""
    assert not list(run_tmp.glob("scorestack-triton-*"))
