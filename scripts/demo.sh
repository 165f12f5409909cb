#!/usr/bin/env bash
# One command: set up, then run the end-to-end demo (train, compile, features, Triton, requests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/scorestack demo "$@"
