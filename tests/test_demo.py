"""The README's first command, minus setup: `scorestack demo` on an empty workspace prints the table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)


def test_demo_runs_end_to_end(tmp_path, server_environment):
    exe = Path(sys.executable).parent / "scorestack"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the default path: SQLite
    env["SCORESTACK_WORKSPACE"] = str(tmp_path / "ws")
    run_tmp = tmp_path / "tmp"  # the server's run directory lands here, so we can see it is gone
    run_tmp.mkdir()
    env["TMPDIR"] = str(run_tmp)
    out = subprocess.run(
        # One training thread: the suite runs two workers on 2 cores (docs/testing.md).
        [str(exe), "demo", "--fraud-requests", "60", "--ranking-requests", "15", "--candidates", "100", "--train-threads", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "Where the time goes" in text
    for phase in ("validate", "features", "assemble", "infer", "total"):
        assert phase in text
    assert "diagnosis fraud:" in text and "diagnosis ranking:" in text
    assert "Triton stopped; demo done." in text
    ws = tmp_path / "ws"
    assert (ws / "model_repository" / "fraud_xgb" / "report.json").exists()
    assert (ws / "feature_repo" / "feature_store.yaml").exists()
    # Shut down cleanly: no tritonserver outlives the demo, and its run directory is removed.
    ps = subprocess.run(["pgrep", "-f", f"--model-repository={run_tmp}"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""
    assert not list(run_tmp.glob("scorestack-triton-*"))
