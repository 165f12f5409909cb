"""Request path: fraud end to end, and ranking chunk plans.

Runs the demo models (trained and compiled into the workspace when absent) on the local Triton,
with features from Redis (REDIS_URL, default 127.0.0.1:6379) through the async fetch layer.

1. Fraud end to end (features + inference) on the compiled settings at concurrency 1, 16, 64, and in
   open loop (Poisson arrivals) at 50% and 80% of the closed-loop maximum measured with 64 callers;
   the phases (features, client, queue, compute, network) as `scorestack diagnose` breaks them down.
2. Ranking at concurrency 1 with 100-2000 candidates (the most `scorestack.limits.MAX_CANDIDATES`
   allows), chunks of max_batch_size, by how many of a request's chunks are in Triton at once.
Client and Triton share the cores, one server start per round. (Earlier runs also placed them on
cores of their own and compared asyncio with uvloop in the client; their results stay in
results/request_path_*.md.) The dynamic-batching settings are the compiler's.

Writes benchmarks/results/request_path.{json,md}, with the load average before and after.

    .venv/bin/python benchmarks/bench_request_path.py [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from scorestack import limits, paths
from scorestack.client.diagnose import breakdown, measure, server_snapshot
from scorestack.client.fraud import FraudService
from scorestack.client.ranking import RankingService
from scorestack.client.server_stats import settled
from scorestack.client.triton import TritonClient
from scorestack.compile import compile_model
from scorestack.demo import data as demo_data
from scorestack.demo.features import init_repo
from scorestack.demo.train import train_demo_models
from scorestack.errors import OverloadedError, ServerError
from scorestack.features import store
from scorestack.features.fetch import FeatureFetcher
from scorestack.serve import LocalTriton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness



def start_server(repository: Path, models: list[str], attempts: int = 3) -> LocalTriton:
    """A started LocalTriton; a start that fails (two of its free ports drawn equal) is retried."""
    for attempt in range(attempts):
        try:
            return LocalTriton(repository, models=models, exit_timeout_s=0).start()
        except ServerError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def served_settings(folder: Path) -> dict:
    cfg = (folder / "config.pbtxt").read_text()
    grab = lambda key: int(m.group(1)) if (m := re.search(rf"{key}: (\d+)", cfg)) else 0
    return {"max_queue_delay_us": grab("max_queue_delay_microseconds"), "instances": grab("count"),
            "default_timeout_us": grab("default_timeout_microseconds"), "max_queue_size": grab("max_queue_size")}


# --- fraud end to end and ranking -------------------------------------------------------------------
OPEN_FRACTIONS = (0.5, 0.8)  # of the closed-loop maximum (64 callers)
OPEN_SECONDS = 3.0


async def open_loop(triton: TritonClient, model: str, send, rate: float, seconds: float, seed: int) -> dict:
    """Poisson arrivals at `rate`/s for `seconds` through the whole request path (harness.open_loop: latency from
    each request's due time); the phases are Triton's statistics joined with the client's timings, as diagnose's
    breakdown does."""
    before = await server_snapshot(triton, model)
    (t,) = await harness.open_loop(send, rate, duration_s=seconds, seed=seed, keep=True)
    after = await settled(lambda: server_snapshot(triton, model), lambda s: s.success_count - before.success_count >= t.ok)
    if not t.ok:
        return {"rate": rate, "served": 0, "errors": dict(t.errors)}
    b = breakdown("fraud", model, [r.timings_ms for r in t.values], t.ok, before, after, sum(bool(r.degraded) for r in t.values))
    p50, p99, p999 = t.percentiles("latencies_ms", (50, 99, 99.9))
    return {
        "rate": rate, "sent": t.sent, "served": t.ok, "served_per_s": t.ok / t.wall_s, "errors": dict(t.errors),
        "p50_ms": p50, "p99_ms": p99, "p999_ms": p999, "p99_from_send_ms": b.p99_total_ms, "send_lag_p99_ms": float(np.percentile(t.lags_ms, 99)),
        "phases_mean_ms": b.phases_ms, "phase_p50_ms": b.client_phase_p50, "avg_batch": b.avg_batch, "dominant": b.dominant,
    }


async def run_paths(grpc_url: str, repo: Path, rounds: int, n_rank: int, quick: bool, first_round: int = 0) -> dict:
    rng = np.random.default_rng(0)
    fields = demo_data.make_fraud_requests(2000, seed=3)
    rows = [{k: float(v) for k, v in fields.iloc[i].items()} for i in range(2000)]
    ctx = {k: float(v) for k, v in demo_data.make_ranking_context(1, seed=4).iloc[0].items()}
    out: dict = {"fraud": {}, "ranking": {}}
    async with TritonClient(grpc_url, deadline_s=5.0) as triton, FeatureFetcher.from_repo(repo, timeout_s=0.05) as fetcher:
        out["feature_backend"] = {s: [fetcher.backend_of(s), fetcher.backend_reason(s)] for s in ("fraud", "ranking")}
        fraud = FraudService(triton, fetcher)

        async def send_fraud(i: int):
            return await fraud.score({"user_id": int(rng.integers(1, 5001)), **rows[i % 2000]})

        # 2000 lone requests: the p99 at concurrency 1 is then the 20th slowest, not the 4th of 400.
        for conc, n in ((1, 2000), (16, 1000), (64, 2000)):
            b = await measure(triton, "fraud", "fraud_xgb", send_fraud, n // (4 if quick else 1), concurrency=conc)
            out["fraud"][f"concurrency_{conc}"] = {
                "p50_ms": b.p50_total_ms, "p99_ms": b.p99_total_ms, "phases_mean_ms": b.phases_ms,
                "phase_p50_ms": b.client_phase_p50, "avg_batch": b.avg_batch, "dominant": b.dominant,
                "served": b.requests, "errors": b.errors,
            }
            print(f"  fraud c{conc}: p50 {b.p50_total_ms:.2f} p99 {b.p99_total_ms:.2f} errors {b.errors}")
        # Open loop at fractions of the closed-loop maximum (64 callers), measured here, just before.
        top = (await harness.closed_loop(send_fraud, 64, n=2000 // (4 if quick else 1))).summary()["rate"]
        out["fraud_max_per_s"] = top
        for f in OPEN_FRACTIONS:
            o = await open_loop(triton, "fraud_xgb", send_fraud, f * top, OPEN_SECONDS / (4 if quick else 1), seed=int(rng.integers(1 << 30)))
            out["fraud"][f"open_{round(f * 100)}pct"] = o
            print(f"  fraud open {f:.0%} of {top:,.0f}/s: served {o.get('served_per_s', 0):,.0f}/s p50 {o.get('p50_ms', float('nan')):.2f} "
                  f"p99 {o.get('p99_ms', float('nan')):.2f} errors {o['errors']}")
        info = await triton.model_info("ranking_xgb")
        mbs, inst = info.max_batch_size, info.instances
        default = RankingService.default_window(info)
        variants = {f"{default} in flight (instances - 1, default)": default, f"{inst} in flight (instances)": inst, "all at once": 0}
        services = {k: RankingService(triton, fetcher, max_candidates=limits.MAX_CANDIDATES, max_in_flight=v) for k, v in variants.items()}
        # Warm-up, not measured: every catalog item read once (the fetch layer caches item rows), so the first plan
        # measured does not pay the cold reads for the others.
        for _ in range(3):
            await services[next(iter(variants))].rank(int(rng.integers(1, 5001)), rng.permutation(np.arange(1, 2001))[: limits.MAX_CANDIDATES].tolist(), ctx)
        for n_cand in (100, 500, 1000, limits.MAX_CANDIDATES):
            samples: dict[str, dict[str, list[float]]] = {k: {"infer": [], "total": []} for k in variants}
            rejected = {k: 0 for k in variants}
            for r in range(first_round, first_round + rounds):
                for k in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                    for _ in range(n_rank):
                        items = rng.choice(np.arange(1, 2001), n_cand, replace=False).tolist()
                        try:
                            res = await services[k].rank(int(rng.integers(1, 5001)), items, ctx)
                        except OverloadedError:  # chunks queued past the model's queue timeout
                            rejected[k] += 1
                            continue
                        samples[k]["infer"].append(res.timings_ms["infer"])
                        samples[k]["total"].append(res.timings_ms["total"])
            out["ranking"][f"candidates_{n_cand}"] = {
                k: {
                    "chunks": -(-n_cand // mbs), "served": len(v["total"]), "rejected": rejected[k],
                    **{f"{ph}_{q}_ms": (float(np.percentile(v[ph], int(q[1:]))) if v[ph] else None) for ph in ("infer", "total") for q in ("p50", "p99")},
                }
                for k, v in samples.items()
            }
            print(f"  ranking {n_cand}: " + "; ".join(f"{k}: total p50 {v['total_p50_ms']:.2f} p99 {v['total_p99_ms']:.2f} rej {v['rejected']}" for k, v in out["ranking"][f"candidates_{n_cand}"].items() if v["served"]))
    return out


def run_round(repository: Path, repo: Path, n_rank: int, quick: bool, r: int) -> dict:
    """One round of the request paths on a server of its own, client and server sharing every core."""
    cpus = sorted(os.sched_getaffinity(0))
    server = start_server(repository, ["fraud_xgb", "ranking_xgb"])
    try:
        out = asyncio.run(run_paths(server.grpc_url, repo, 1, n_rank, quick, first_round=r))
    finally:
        server.stop()
    return {**out, "cpus": {"client": cpus, "server": cpus}, "event_loop": "asyncio", "round": r}


def render(result: dict) -> str:
    fmt = lambda x: "–" if x is None else f"{x:.2f}"
    m = result["machine"]
    lines = ["# Request path (local Triton, Redis features, demo models)", "",
             f"{m['cpus']} CPUs ({m['cpu_model']}), {m['platform']}, commit {m['commit']}, {m['date']}; load average before/after: "
             f"{' '.join(f'{x:.2f}' for x in m['loadavg_before'])} / {' '.join(f'{x:.2f}' for x in m['loadavg_after'])}; client and server share the cores."
             + (f" Note: {m['note']}" if m.get("note") else ""), ""]
    for placement, runs in (result.get("paths") or {}).items():  # one placement: "shared"
        cpus = runs[0]["cpus"] if runs else {}
        where = ("client and Triton on every core" if cpus.get("client") == cpus.get("server") else
                 f"client on CPU {','.join(map(str, cpus.get('client', [])))}, Triton on CPU {','.join(map(str, cpus.get('server', [])))} (LocalTriton cpus=)")
        loop = runs[0].get("event_loop", "asyncio") if runs else "asyncio"
        lines += [f"## Fraud end to end (features from Redis + inference), compiled settings, placement {placement}: {where}, client event loop {loop}", "",
                  f"Feature backend: {runs[0]['feature_backend']['fraud'][0]} ({runs[0]['feature_backend']['fraud'][1]}). Redis is the machine's own service, on any core.", "",
                  "| round | concurrency | served | failed | p50 ms | p99 ms | avg batch | dominant | features | client | queue | compute | network |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for run in runs:
            for k, v in run["fraud"].items():
                if "phases_mean_ms" not in v:  # an open-loop point where nothing was served
                    lines.append(f"| {run['round']} | {k} | 0 | {sum(v['errors'].values())} | – | – | – | – | – | – | – | – | – |")
                    continue
                p = v["phases_mean_ms"]
                label = (f"open {k.split('_')[1][:-3]}% ({v['rate']:,.0f}/s, served {v['served_per_s']:,.0f}/s, send lag p99 {v['send_lag_p99_ms']:.2f} ms)"
                         if k.startswith("open") else k.split("_")[1])
                lines.append(f"| {run['round']} | {label} | {v['served']} | {sum(v['errors'].values())} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} | {v['avg_batch']:.1f} | {v['dominant']} | "
                             + " | ".join(f"{p[x]:.3f}" for x in ("features", "client", "queue", "compute", "network")) + " |")
        maxima = [f"{r['fraud_max_per_s']:,.0f}" for r in runs if r.get("fraud_max_per_s")]
        lines += ["", "Phases are means in ms (features: the fetch; client: validation and assembly; queue/compute: Triton's statistics; network: the rest of the inference call)."
                  + (f" Open-loop rows: Poisson arrivals at fractions of the closed-loop maximum measured just before with 64 callers ({', '.join(maxima)} req/s by round), "
                     "p50/p99 from each request's scheduled time (the client's own lateness included), phases of the served requests." if maxima else ""),
                  "", f"### Ranking at concurrency 1, placement {placement}: chunks of max_batch_size, by chunks of one request in flight", "",
                  "| round | candidates | chunks | in flight | served | rejected (OverloadedError) | infer p50 / p99 ms | total p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
        for run in runs:
            for n_c, variants in run["ranking"].items():
                for k, v in variants.items():
                    lines.append(f"| {run['round']} | {n_c.split('_')[1]} | {v['chunks']} | {k} | {v['served']} | {v['rejected']} | {fmt(v['infer_p50_ms'])} / {fmt(v['infer_p99_ms'])} | {fmt(v['total_p50_ms'])} / {fmt(v['total_p99_ms'])} |")
        lines += ["", "A rejected request is Triton's queue policy at work (REJECT after the compiled queue timeout); the client raises OverloadedError instead of retrying it.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranking-requests", type=int, default=40, help="ranking requests per variant, candidate count and round")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not for the results)")
    ap.add_argument("--out", default="request_path", help="results name under benchmarks/results/")
    ap.add_argument("--note", default="", help="a line about the conditions of this run, kept in the results")
    ap.add_argument("--recompile", action="store_true", help="compile the demo models again even when unchanged (after a change to the compiler)")
    args = ap.parse_args()
    ws = paths.workspace()
    specs = {p.stem: p for p in train_demo_models(ws / "models")}
    repository = ws / "model_repository"
    for name in ("fraud_xgb", "ranking_xgb"):
        compile_model(specs[name], repository, force=args.recompile)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    repo = ws / "feature_repo_bench"
    init_repo(repo, online="redis", redis_url=redis_url, project="bench_request_path")
    store.apply(repo)
    store.materialize(repo)
    load_before = os.getloadavg()
    t = time.time()
    n_rank = max(2, args.ranking_requests // (5 if args.quick else 1))
    runs: dict[str, list[dict]] = {"shared": []}
    for r in range(args.rounds):
        print(f"paths, round {r}", flush=True)
        runs["shared"].append(run_round(repository, repo, n_rank, args.quick, r))
    result: dict = {"paths": runs, "served_settings": {m: served_settings(repository / m) for m in ("fraud_xgb", "ranking_xgb")}}
    result["machine"] = harness.machine(seconds=round(time.time() - t, 1), loadavg_before=load_before, loadavg_after=os.getloadavg(),
                                        quick=args.quick, note=args.note)
    text = render(result)
    harness.write_results(args.out, result, text)
    print(text)


if __name__ == "__main__":
    main()
