"""Triton 2.51's queue policy, both ways: the batcher's ~500 ms stalls with it, and what client
cancellations do to the server without it.

Triton 2.51's dynamic batcher pre-fetches batches only when the model has no queue policy (no
default timeout, no timeout override, no max queue size; core src/scheduler_utils.cc). With a policy
(REJECT after the budget's slack: scorestack's compiled default, `serving.queue_policy`) a batcher that finds every instance
busy waits for a free one on a condition variable whose wake-up can come before the instance counts
as free; it then sleeps until the next request arrives or 500 ms pass (dynamic_batch_scheduler.cc,
default_wait_microseconds), and the waiting requests have run out of their queue timeout and are
rejected. This sends k chunks of 200 ranking rows at once (more than the model's instances, as a
ranking request's fan-out does), with and without the policy, and counts rejections and calls that
took over 100 ms.

Then a cancellation burst: 64 callers in a closed loop send the one-row fraud model requests with a
short gRPC deadline (10 and 20 ms), so calls are cancelled while Triton answers them. Triton 2.51's
gRPC frontend can crash on that race (triton-inference-server/server#7368, fixed in 24.12); the
queue policy makes it rarer because the server rejects a request before the caller gives up.
Recorded: whether tritonserver was still alive, and the calls' outcomes. Writes
benchmarks/results/queue_policy.{json,md}.

    .venv/bin/python benchmarks/bench_queue_policy.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_request_path import cpu_model, git_commit, start_server

from scorestack import paths
from scorestack.client.triton import TritonClient
from scorestack.errors import OverloadedError

RESULTS = Path(__file__).parent / "results"
MODEL = "ranking_xgb"


def variant(src: Path, root: Path, policy: bool) -> Path:
    """A repository holding the latest version of `src`, its config with the queue policy the compiler
    derived (REJECT after report.json's default_timeout_us, its max_queue_size) or with none."""
    dst = root / src.name
    latest = max((d for d in src.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    shutil.copytree(latest, dst / latest.name, symlinks=True)
    cfg = re.sub(r"  default_queue_policy \{.*?\n  \}\n", "", (src / "config.pbtxt").read_text(), flags=re.S)
    if policy:
        triton = json.loads((src / "report.json").read_text())["triton"]
        cfg = cfg.replace("dynamic_batching {\n", "dynamic_batching {\n  default_queue_policy {\n    timeout_action: REJECT\n"
                          f"    default_timeout_microseconds: {triton['default_timeout_us']}\n    allow_timeout_override: true\n"
                          f"    max_queue_size: {triton['max_queue_size']}\n  }}\n", 1)
    (dst / "config.pbtxt").write_text(cfg)
    return root


async def measure(url: str, fanouts: list[int], rounds: int) -> dict:
    out = {}
    async with TritonClient(url, deadline_s=5.0) as triton:
        info = await triton.model_info(MODEL)
        x = np.random.default_rng(0).random((info.max_batch_size, info.inputs[0].shape[-1]), dtype=np.float32)
        for _ in range(5):
            await triton.infer(MODEL, {info.inputs[0].name: x})
        for k in fanouts:
            rejected = stalled = 0
            walls = []
            for _ in range(rounds):
                start = time.perf_counter()
                got = await asyncio.gather(*(triton.infer(MODEL, {info.inputs[0].name: x}) for _ in range(k)), return_exceptions=True)
                wall = (time.perf_counter() - start) * 1e3
                walls.append(wall)
                rejected += sum(isinstance(g, OverloadedError) for g in got)
                stalled += wall > 100
                other = [g for g in got if isinstance(g, Exception) and not isinstance(g, OverloadedError)]
                if other:
                    raise other[0]
            out[f"fanout_{k}"] = {
                "requests": k * rounds, "rejected": rejected, "gathers_over_100ms": stalled, "gathers": rounds,
                "wall_p50_ms": float(np.percentile(walls, 50)), "wall_p99_ms": float(np.percentile(walls, 99)), "wall_max_ms": float(max(walls)),
            }
        out["instances"], out["queue_timeout_us"] = info.instances, info.queue_timeout_us
    return out


async def storm(url: str, model: str, deadline_s: float, seconds: float, callers: int = 64) -> dict:
    """Closed loop of `callers` one-row requests, each cancelled by its gRPC deadline if not answered in time."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    channel = grpc.aio.insecure_channel(url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    async with TritonClient(url, deadline_s=5.0) as triton:
        info = await triton.model_info(model)
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=info.inputs[0].name, datatype="FP32", shape=[1, info.inputs[0].shape[-1]])
    request.raw_input_contents.append(np.random.default_rng(1).random((1, info.inputs[0].shape[-1]), dtype=np.float32).tobytes())
    outcomes: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def caller() -> None:
        while time.monotonic() < end:
            try:
                await stub.ModelInfer(request, timeout=deadline_s)
                key = "ok"
            except grpc.aio.AioRpcError as exc:
                key = exc.code().name.lower()
            outcomes[key] = outcomes.get(key, 0) + 1

    await asyncio.gather(*(caller() for _ in range(callers)))
    await channel.close()
    return outcomes


def run_storms(repository: Path, tmp: Path, seconds: float) -> dict:
    out = {}
    for policy in (True, False):
        repo = variant(repository / "fraud_xgb", tmp / f"storm-{policy}", policy)
        for deadline_ms in (10, 20):
            server = start_server(repo, ["fraud_xgb"])
            try:
                outcomes = asyncio.run(storm(server.grpc_url, "fraud_xgb", deadline_ms / 1000.0, seconds))
                time.sleep(0.5)
                alive = server.is_running()
                log = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
                crash = next((line.strip() for line in log.splitlines() if "Signal (" in line or "pure virtual" in line), None)
            finally:
                server.stop()
            out[f"policy_{policy}_deadline_{deadline_ms}ms"] = {"queue_policy": policy, "deadline_ms": deadline_ms, "alive_after": alive,
                                                                "crash_line": crash, "outcomes": outcomes}
            print("storm", policy, deadline_ms, alive, outcomes, crash)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40, help="gathers per fan-out and variant")
    ap.add_argument("--fanouts", default="1,2,3,4,6")
    ap.add_argument("--storm-seconds", type=float, default=6.0, help="length of each cancellation burst (0: skip them)")
    args = ap.parse_args()
    repository = paths.workspace() / "model_repository"
    if not (repository / MODEL / "config.pbtxt").exists():
        sys.exit(f"{repository / MODEL} is not compiled: run benchmarks/bench_request_path.py (or `scorestack demo`) first")
    fanouts = [int(v) for v in args.fanouts.split(",")]
    load_before, t0 = os.getloadavg(), time.time()
    result: dict = {"variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "queue policy (the default: REJECT after the derived timeout)": variant(repository / MODEL, Path(tmp) / "policy", True),
            "no queue policy (serving.queue_policy: false; the batcher pre-fetches)": variant(repository / MODEL, Path(tmp) / "none", False),
        }
        for name, repo in variants.items():
            server = start_server(repo, [MODEL])
            try:
                result["variants"][name] = asyncio.run(measure(server.grpc_url, fanouts, args.rounds))
            finally:
                server.stop()
            print(name, json.dumps(result["variants"][name]))
        if args.storm_seconds > 0:
            result["storms"] = run_storms(repository, Path(tmp), args.storm_seconds)
    result["machine"] = {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "seconds": round(time.time() - t0, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "queue_policy.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    lines = ["# Triton 2.51's queue policy: the batcher's stalls with it, cancellation bursts without it", "",
             f"{m['cpus']} CPUs ({m['cpu_model']}), commit {m['commit']}, {m['date']}; load average before/after "
             f"{' '.join(f'{v:.2f}' for v in m['loadavg_before'])} / {' '.join(f'{v:.2f}' for v in m['loadavg_after'])}.",
             f"Model {MODEL} (native backend), chunks of max_batch_size rows; k chunks sent at once, {args.rounds} times per k.", "",
             "| variant | k at once | requests | rejected | gathers over 100 ms | wall p50 / p99 / max ms |", "|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        for k in fanouts:
            r = v[f"fanout_{k}"]
            lines.append(f"| {name} | {k} | {r['requests']} | {r['rejected']} | {r['gathers_over_100ms']} of {r['gathers']} | "
                         f"{r['wall_p50_ms']:.2f} / {r['wall_p99_ms']:.2f} / {r['wall_max_ms']:.1f} |")
    if result.get("storms"):
        lines += ["", f"## Cancellation bursts: 64 callers, one-row fraud requests, gRPC deadline, {args.storm_seconds:g} s each, a fresh server each", "",
                  "| queue policy | deadline ms | tritonserver alive after | calls (outcome: count) | crash line in its log |", "|---|---|---|---|---|"]
        for r in result["storms"].values():
            calls = ", ".join(f"{k} {v:,}" for k, v in sorted(r["outcomes"].items()))
            lines.append(f"| {'on' if r['queue_policy'] else 'off'} | {r['deadline_ms']} | {'yes' if r['alive_after'] else '**no**'} | {calls} | {r['crash_line'] or '–'} |")
    for paragraph in __doc__.split("\n\n")[1:3]:
        lines += ["", paragraph.replace("\n", " ")]
    (RESULTS / "queue_policy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
