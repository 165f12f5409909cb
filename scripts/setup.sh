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
# From Debian: docker-compose checks the compose file (tests/test_deploy.py; no Docker engine needed);
# nghttp2-client's h2load is the benchmarks' load generator (benchmarks/loadgen.py, tests/test_loadgen.py).
debs=()
command -v docker-compose >/dev/null 2>&1 || debs+=(docker-compose)
command -v h2load >/dev/null 2>&1 || debs+=(nghttp2-client)
if [ ${#debs[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq "${debs[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.scorestack-installed
want=$(cat pyproject.toml deploy/scorestack/constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
  # The dev extra: the base install plus every extra the tests, the demo and the benchmarks use
  # (compile, vision, hummingbird, bench; docs/deployment.md, "What to install"). Every distribution
  # the image holds at the version it pins (deploy/scorestack/constraints.txt, written by
  # deploy/scorestack/lock.py); torch is pinned in pyproject's extras (torch==2.13.0, CPU build).
  .venv/bin/python -m pip install --disable-pip-version-check -q -c deploy/scorestack/constraints.txt -e ".[dev]"
  echo "$want" > "$stamp"
fi
PIP_CONSTRAINT="$PWD/deploy/scorestack/server-env-constraints.txt" .venv/bin/scorestack server-env
