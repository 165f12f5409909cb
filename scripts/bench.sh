#!/usr/bin/env bash
# The benchmark suite, in one command: scorestack side by side with MLServer, FastAPI (+XGBoost,
# +onnxruntime), Triton's response-cache floor and its own HTTP endpoint (same fraud model, same
# machine, the same C load generator h2load for every target, interleaved rounds); overload through
# the client's admission control; the whole fraud and ranking request against the hand-written Feast +
# onnxruntime service (e2e: fraud with Redis features at concurrency 1/16/64 and open loop at 50%/80%
# of each service's maximum, the phases diagnose reports, ranking with 100-2000 candidates by chunk
# plan); the velocity counters under 4 writer processes and a Redis restart (velocity). Writes
# benchmarks/results/{peers,admission,e2e,velocity}.{json,md} and regenerates benchmarks/REPORT.md,
# whose tables judge the goals. The soak (10 minutes at 70% of the sustainable maximum) runs on its own:
# --only soak (with --quick: 60 seconds); so do the compiles of six tree models users bring:
# --only trees (~2 minutes; benchmarks/results/trees.{json,md}).
#
#   scripts/bench.sh                 # everything (~15 minutes on 2 cores)
#   scripts/bench.sh --quick         # everything, short (a smoke run, not for the results)
#   scripts/bench.sh --only peers    # one part: peers, admission, e2e, velocity or soak
#   scripts/bench.sh --only peers --targets scorestack,fastapi_onnxruntime --rounds 3   # other options go to suite.py
#
# The first run also trains/compiles the demo models (~1 minute) and builds MLServer's own virtual
# environment under ~/.cache/scorestack/peers/ (a few minutes, from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
quick=()
only=""
suite_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=(--quick); shift ;;
    --only) [ $# -ge 2 ] || { echo "scripts/bench.sh: --only needs a part: peers, admission, e2e, velocity, soak or trees" >&2; exit 2; }
            only="$2"; shift 2 ;;
    --only=*) only="${1#--only=}"; shift ;;
    *) suite_args+=("$1"); shift ;;
  esac
done
case "$only" in
  ""|peers|admission|e2e|velocity|soak|trees) ;;
  *) echo "scripts/bench.sh: --only $only: choose peers, admission, e2e, velocity, soak or trees" >&2; exit 2 ;;
esac
if [ ${#suite_args[@]} -gt 0 ] && [ "$only" != "peers" ]; then
  echo "scripts/bench.sh: options ${suite_args[*]} are suite.py's: add --only peers" >&2
  exit 2
fi
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
if [ -z "$only" ] || [ "$only" = peers ]; then
  step "peers: benchmarks/suite.py"
  "$PY" benchmarks/suite.py "${quick[@]}" "${suite_args[@]}"
fi
if [ -z "$only" ] || [ "$only" = admission ]; then
  step "admission control: benchmarks/bench_admission.py"
  if [ ${#quick[@]} -gt 0 ]; then
    "$PY" benchmarks/bench_admission.py --rounds 1 --duration 1
  else
    "$PY" benchmarks/bench_admission.py
  fi
fi
if [ -z "$only" ] || [ "$only" = e2e ]; then
  step "end to end against the hand-written service: benchmarks/bench_e2e.py"
  "$PY" benchmarks/bench_e2e.py "${quick[@]}"
fi
if [ -z "$only" ] || [ "$only" = velocity ]; then
  step "velocity counters under concurrent replicas: benchmarks/bench_velocity.py"
  if [ ${#quick[@]} -gt 0 ]; then
    "$PY" benchmarks/bench_velocity.py --events 2000 --rounds 1 --fetch-seconds 1
  else
    "$PY" benchmarks/bench_velocity.py
  fi
fi
if [ "$only" = trees ]; then
  step "tree models users bring, compiled with a first spec: benchmarks/bench_trees.py"
  "$PY" benchmarks/bench_trees.py "${quick[@]}"
fi
if [ "$only" = soak ]; then
  step "soak: benchmarks/soak.py"
  if [ ${#quick[@]} -gt 0 ]; then "$PY" benchmarks/soak.py --seconds 60; else "$PY" benchmarks/soak.py; fi
fi
step "report: benchmarks/report.py"
"$PY" benchmarks/report.py
