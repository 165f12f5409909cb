#!/usr/bin/env bash
# One command: set up, then run the whole test suite against the real Triton, Redis and Feast.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Redis is expected at 127.0.0.1:6379; start one if the binary exists and nothing answers.
if ! .venv/bin/python -c "import redis,sys; redis.Redis(host='127.0.0.1', port=6379, socket_timeout=1, socket_connect_timeout=1).ping()" 2>/dev/null; then
  if command -v redis-server >/dev/null; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
    # Bounded wait for it to answer (not a guess at how long it takes).
    .venv/bin/python -c "from scorestack.serve.readiness import port_open, wait_until; wait_until(lambda: port_open('127.0.0.1', 6379), timeout_s=10, what='redis-server on 127.0.0.1:6379')"
  else
    echo "warning: no Redis at 127.0.0.1:6379 and no redis-server binary (apt-get install redis-server): Redis tests will fail" >&2
  fi
fi
# One OpenMP thread per library call unless the caller says otherwise: two test workers share the
# cores, and two-thread pools that wait on each other's core ran several times slower (the demo test
# took 400 s instead of 100 s). Tests that measure thread counts set them explicitly.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers, a whole module each at a time: most of a test's wall time is waiting on servers,
# compiles and subprocesses, so two overlap on 2 cores. Modules start in the order tests/conftest.py
# gives (the long ones first), not xdist's default (most tests first).
# The whole run is bounded (SCORESTACK_TEST_TIMEOUT_S, default 40 minutes; it takes about 10 on 2
# cores): a worker that dies can leave pytest-xdist waiting forever, and a hang must fail, not stall CI.
limit=${SCORESTACK_TEST_TIMEOUT_S:-2400}
status=0
timeout --kill-after=60 "$limit" .venv/bin/python -m pytest -n "${SCORESTACK_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "scripts/test.sh: the suite ran past ${limit} s (SCORESTACK_TEST_TIMEOUT_S) and was stopped: a hung test or a worker that died (see above)" >&2
fi
exit "$status"
