"""Triton's queue policy and the dynamic batcher's slot wait: stalls of ~500 ms, measured.

Triton 2.51's dynamic batcher pre-fetches batches only when the model has no queue policy (no
default timeout, no timeout override, no max queue size; core src/scheduler_utils.cc). With a policy
(REJECT after the budget's slack, scorestack's compiled default until compiler 6; now
`serving.queue_policy: true`) a batcher that finds every instance
busy waits for a free one on a condition variable whose wake-up can come before the instance counts
as free; it then sleeps until the next request arrives or 500 ms pass (dynamic_batch_scheduler.cc,
default_wait_microseconds), and the waiting requests have run out of their queue timeout and are
rejected. This sends k chunks of 200 ranking rows at once (more than the model's instances, as a
ranking request's fan-out does), with and without the policy, and counts rejections and calls that
took over 100 ms. Writes benchmarks/results/queue_policy.{json,md}.

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
from bench_request_path import cpu_model, git_commit, start_server  # noqa: E402

from scorestack import paths  # noqa: E402
from scorestack.client.triton import TritonClient  # noqa: E402
from scorestack.errors import OverloadedError  # noqa: E402

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
        triton = json.loads((latest / "report.json").read_text() if (latest / "report.json").exists() else (src / "report.json").read_text())["triton"]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40, help="gathers per fan-out and variant")
    ap.add_argument("--fanouts", default="1,2,3,4,6")
    args = ap.parse_args()
    repository = paths.workspace() / "model_repository"
    if not (repository / MODEL / "config.pbtxt").exists():
        sys.exit(f"{repository / MODEL} is not compiled: run benchmarks/bench_request_path.py (or `scorestack demo`) first")
    fanouts = [int(v) for v in args.fanouts.split(",")]
    load_before, t0 = os.getloadavg(), time.time()
    result: dict = {"variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "queue policy (REJECT after the derived timeout)": variant(repository / MODEL, Path(tmp) / "policy", True),
            "no queue policy (the default; the batcher pre-fetches)": variant(repository / MODEL, Path(tmp) / "none", False),
        }
        for name, repo in variants.items():
            server = start_server(repo, [MODEL])
            try:
                result["variants"][name] = asyncio.run(measure(server.grpc_url, fanouts, args.rounds))
            finally:
                server.stop()
            print(name, json.dumps(result["variants"][name]))
    result["machine"] = {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "seconds": round(time.time() - t0, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "queue_policy.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    lines = ["# Triton's queue policy and the batcher's slot wait", "",
             f"{m['cpus']} CPUs ({m['cpu_model']}), commit {m['commit']}, {m['date']}; load average before/after "
             f"{' '.join(f'{v:.2f}' for v in m['loadavg_before'])} / {' '.join(f'{v:.2f}' for v in m['loadavg_after'])}.",
             f"Model {MODEL} (native backend), chunks of max_batch_size rows; k chunks sent at once, {args.rounds} times per k.", "",
             "| variant | k at once | requests | rejected | gathers over 100 ms | wall p50 / p99 / max ms |", "|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        for k in fanouts:
            r = v[f"fanout_{k}"]
            lines.append(f"| {name} | {k} | {r['requests']} | {r['rejected']} | {r['gathers_over_100ms']} of {r['gathers']} | "
                         f"{r['wall_p50_ms']:.2f} / {r['wall_p99_ms']:.2f} / {r['wall_max_ms']:.1f} |")
    lines += ["", __doc__.split("\n\n")[1].replace("\n", " ")]
    (RESULTS / "queue_policy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
