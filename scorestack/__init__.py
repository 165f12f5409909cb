"""scorestack: compile classical ML models into the fastest verified Triton artifacts and serve them."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# gRPC's client transport: grpcio 1.85 sends calls through its EventEngine client by default; the
# older poller cost ~60-80 µs less per call at concurrency 1 on the 2-core project machine (measured
# in-process, side by side, 1000 requests a run: fraud end to end p50 1.19 -> 1.11 ms, model call
# 0.69 -> 0.63 ms; model calls at 64 concurrent 10.4-11.3k vs 10.4-10.7k per second). gRPC reads the setting once, when it is first imported, so it
# applies only where scorestack is imported before grpc and GRPC_EXPERIMENTS is unset; set
# GRPC_EXPERIMENTS yourself (even to "") to keep gRPC's default. `grpc_experiments_applied` says
# whether it took effect in this process.
GRPC_CLIENT_EXPERIMENTS = "-event_engine_client"
grpc_experiments_applied = False
if "grpc" not in _sys.modules and "GRPC_EXPERIMENTS" not in _os.environ:
    _os.environ["GRPC_EXPERIMENTS"] = GRPC_CLIENT_EXPERIMENTS
    grpc_experiments_applied = True
