#!/usr/bin/env bash
# Set up scorestack on a fresh machine: the project environment (.venv) and the managed server
# environment that holds the real tritonserver. Idempotent; re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "scorestack needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.scorestack-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
  # torch is pinned in pyproject (torch==2.13.0, CPU build); never let it float.
  .venv/bin/python -m pip install --disable-pip-version-check -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
.venv/bin/scorestack server-env
