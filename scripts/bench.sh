#!/usr/bin/env bash
# The benchmark suite: scorestack side by side with MLServer, FastAPI (+XGBoost, +onnxruntime) and
# Triton's response-cache floor, same fraud model, same machine, interleaved rounds.
# Writes benchmarks/results/peers.json and regenerates benchmarks/REPORT.md (+ results/plots/).
#
#   scripts/bench.sh            # full run (~8 minutes of measuring on 2 cores; 3 rounds, 2.5 s per point)
#   scripts/bench.sh --quick    # one round, 1 s per point (~2.5 minutes)
#   scripts/bench.sh --targets scorestack,fastapi_onnxruntime --rounds 2
#
# The first run also trains/compiles the demo fraud model (~1 minute) and builds MLServer's own
# virtual environment under ~/.cache/scorestack/peers/ (a few minutes, from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" benchmarks/suite.py "$@"
