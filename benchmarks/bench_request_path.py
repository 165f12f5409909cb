"""Request path: fraud and ranking latency per phase, and ranking chunk sizes side by side.

Runs the demo models (trained and compiled into the workspace when absent) on the local Triton,
with features from Redis (REDIS_URL, default 127.0.0.1:6379) through the async fetch layer.
Chunk sizes are measured interleaved in one run (rounds alternate the order) so machine noise
hits every variant alike. Writes benchmarks/results/request_path.{json,md}.

    .venv/bin/python benchmarks/bench_request_path.py [--rounds 5] [--requests 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from scorestack import paths
from scorestack.demo import data as demo_data
from scorestack.client.diagnose import measure
from scorestack.client.fraud import FraudService
from scorestack.client.ranking import RankingService
from scorestack.client.triton import TritonClient
from scorestack.compile import compile_model
from scorestack.demo.train import train_demo_models
from scorestack.errors import OverloadedError
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher
from scorestack.serve import LocalTriton

RESULTS = Path(__file__).resolve().parent / "results"


async def run(grpc_url: str, repo: Path, rounds: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    fields = demo_data.make_fraud_requests(2000, seed=3)
    ctx = {k: float(v) for k, v in demo_data.make_ranking_context(1, seed=4).iloc[0].items()}
    out: dict = {"fraud": {}, "ranking": {}}
    async with TritonClient(grpc_url, deadline_s=5.0) as triton, FeatureFetcher.from_repo(repo, timeout_s=0.05) as fetcher:
        fraud = FraudService(triton, fetcher)

        async def send_fraud(i: int):
            return await fraud.score({"user_id": int(rng.integers(1, 5001)), **{k: float(v) for k, v in fields.iloc[i % 2000].items()}})

        for conc in (1, 16):
            b = await measure(triton, "fraud", "fraud_xgb", send_fraud, 300, concurrency=conc)
            out["fraud"][f"concurrency_{conc}"] = {
                "p50_ms": b.p50_total_ms, "p99_ms": b.p99_total_ms, "phases_mean_ms": b.phases_ms,
                "phase_p50_ms": b.client_phase_p50, "avg_batch": b.avg_batch, "dominant": b.dominant,
                "served": b.requests, "errors": b.errors,
            }
        for n_cand in (100, 500, 1000):
            # Chunks never exceed the model's max_batch_size (the compiler set it from the spec).
            mbs = (await triton.model_info("ranking_xgb")).max_batch_size
            sizes = sorted({min(c, mbs) for c in (50, 100, mbs)})
            variants = {f"chunk_{c}" + (" (max_batch_size)" if c == mbs else ""): c for c in sizes}
            samples: dict[str, list[float]] = {k: [] for k in variants}
            rejected: dict[str, int] = {k: 0 for k in variants}
            services = {k: RankingService(triton, fetcher, chunk_size=v, max_candidates=2000) for k, v in variants.items()}
            for r in range(rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for k in order:
                    for _ in range(n):
                        items = rng.choice(np.arange(1, 2001), n_cand, replace=False).tolist()
                        try:
                            res = await services[k].rank(int(rng.integers(1, 5001)), items, ctx)
                        except OverloadedError:  # chunks queued past the model's queue timeout
                            rejected[k] += 1
                            continue
                        samples[k].append(res.timings_ms["infer"])
            out["ranking"][f"candidates_{n_cand}"] = {
                k: {
                    "infer_p50_ms": float(np.percentile(v, 50)) if v else None,
                    "infer_p99_ms": float(np.percentile(v, 99)) if v else None,
                    "served": len(v),
                    "rejected": rejected[k],
                }
                for k, v in samples.items()
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=25)
    args = ap.parse_args()
    ws = paths.workspace()
    specs = {p.stem: p for p in train_demo_models(ws / "models")}
    repository = ws / "model_repository"
    for name in ("fraud_xgb", "ranking_xgb"):
        compile_model(specs[name], repository)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    repo = ws / "feature_repo_bench"
    demo_features.init_repo(repo, online="redis", redis_url=redis_url, project="bench_request_path")
    store.apply(repo)
    store.materialize(repo)
    with LocalTriton(repository, models=["fraud_xgb", "ranking_xgb"]) as server:
        t = time.time()
        result = asyncio.run(run(server.grpc_url, repo, args.rounds, args.requests))
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "seconds": round(time.time() - t, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "request_path.json").write_text(json.dumps(result, indent=2))
    lines = ["# Request path (local Triton, Redis features, demo models)", "", "## Fraud, 300 requests", "",
             "| concurrency | served | failed | p50 ms | p99 ms | avg batch | dominant | features | client | queue | compute | network |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in result["fraud"].items():
        p = v["phases_mean_ms"]
        lines.append(f"| {k.split('_')[1]} | {v['served']} | {sum(v['errors'].values())} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} | {v['avg_batch']:.1f} | {v['dominant']} | "
                     + " | ".join(f"{p[x]:.3f}" for x in ("features", "client", "queue", "compute", "network")) + " |")
    lines += ["", "## Ranking: infer phase by chunk size (interleaved rounds)", "", "| candidates | variant | served | rejected (OverloadedError) | infer p50 ms | infer p99 ms |", "|---|---|---|---|---|---|"]
    for n_c, variants in result["ranking"].items():
        for k, v in variants.items():
            fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(f"| {n_c.split('_')[1]} | {k} | {v['served']} | {v['rejected']} | {fmt(v['infer_p50_ms'])} | {fmt(v['infer_p99_ms'])} |")
    lines += ["", "A rejected request is Triton's queue policy at work (REJECT after the compiled queue timeout, "
              "derived from the spec's 10 ms budget); the client raises OverloadedError instead of retrying it."]
    (RESULTS / "request_path.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
