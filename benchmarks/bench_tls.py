"""The cost of TLS: plaintext vs TLS vs mutual TLS gRPC to the local Triton, at concurrency 1 and 64, side by side.

One small fraud-shaped XGBoost model (compiled to ONNX) is served by three local Tritons from the
same repository: plaintext, TLS and mutual TLS (throwaway certificates). Each round sends the same
requests through one long-lived TritonClient per server, in an order that rotates every round, so
machine noise hits every variant alike; a second measurement opens a fresh channel per request
(the handshake cost a client without connection reuse pays). Writes benchmarks/results/tls.{json,md}.

    .venv/bin/python benchmarks/bench_tls.py [--rounds 5] [--requests 300] [--requests-64 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import xgboost as xgb
import yaml

from scorestack import schema
from scorestack.demo import data as demo_data
from scorestack.client.triton import TritonClient
from scorestack.compile import compile_model
from scorestack.serve import LocalTriton
from scorestack.serve.devcerts import write_dev_certs
from scorestack.serve.security import ClientTls, ServerTls

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "fraud_bench_tls"
VARIANTS = ("plaintext", "tls", "mutual_tls")


def build_model(root: Path) -> Path:
    users = demo_data.make_users(500)
    X, y, _ = demo_data.make_fraud_dataset(users, n=6000)
    clf = xgb.XGBClassifier(n_estimators=100, max_depth=5, n_jobs=1, random_state=0).fit(X[:5000], y[:5000])
    clf.get_booster().save_model(root / "model.json")
    np.savez(root / "holdout.npz", X=X[5000:], y=y[5000:])
    spec = {
        "name": MODEL,
        "source": {"path": "model.json", "format": "xgboost-json"},
        "task": "binary",
        "inputs": {"features": list(schema.FRAUD_FEATURES), "dtype": "float32"},
        "outputs": [schema.OUTPUT_TENSORS["binary"]],
        # A generous budget: the queue policy must not shed load at concurrency 64 (this measures
        # transport cost, not load shedding).
        "serving": {"batch_sizes": [1, 64], "latency_budget_ms": 2000},
        "holdout": "holdout.npz",
        "formats": ["onnx"],
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    repo = root / "repo"
    compile_model(root / "spec.yaml", repo, serve_check=False)
    return repo


async def closed_loop(client: TritonClient, rows: np.ndarray, n: int, concurrency: int) -> dict:
    latencies: list[float] = []
    errors = 0
    next_i = 0

    async def worker() -> None:
        nonlocal next_i, errors
        while next_i < n:
            i = next_i
            next_i += 1
            t = time.perf_counter()
            try:
                await client.infer(MODEL, {schema.INPUT_TENSOR: rows[i % len(rows) : i % len(rows) + 1]})
            except Exception:  # counted, reported: a benchmark must not hide failures
                errors += 1
                continue
            latencies.append((time.perf_counter() - t) * 1e3)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    lat = np.array(latencies)
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)), "req_per_s": len(lat) / wall, "served": len(lat), "errors": errors}


async def fresh_channel(url: str, tls: ClientTls | None, rows: np.ndarray, n: int) -> dict:
    """Connect + first request, a new channel each time: what a client without connection reuse pays."""
    lat = []
    for i in range(n):
        t = time.perf_counter()
        async with TritonClient(url, deadline_s=5.0, tls=tls) as c:
            await c.infer(MODEL, {schema.INPUT_TENSOR: rows[i : i + 1]})
        lat.append((time.perf_counter() - t) * 1e3)
    a = np.array(lat)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


async def run(urls: dict[str, str], tls: dict[str, ClientTls | None], rounds: int, n1: int, n64: int, n_fresh: int) -> dict:
    rows = np.random.default_rng(1).normal(size=(512, len(schema.FRAUD_FEATURES))).astype(np.float32)
    clients = {v: TritonClient(urls[v], deadline_s=5.0, tls=tls[v]) for v in VARIANTS}
    samples: dict[str, dict[str, list[dict]]] = {v: {"c1": [], "c64": [], "fresh": []} for v in VARIANTS}
    try:
        for c in clients.values():  # warm-up: channel, metadata, model
            await closed_loop(c, rows, 200, 8)
        for r in range(rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for v in order:
                samples[v]["c1"].append(await closed_loop(clients[v], rows, n1, 1))
            for v in order:
                samples[v]["c64"].append(await closed_loop(clients[v], rows, n64, 64))
            for v in order:
                samples[v]["fresh"].append(await fresh_channel(urls[v], tls[v], rows, n_fresh))
    finally:
        for c in clients.values():
            await c.close()
    out: dict = {}
    for v in VARIANTS:
        out[v] = {}
        for key, runs in samples[v].items():
            out[v][key] = {m: float(np.median([s[m] for s in runs])) for m in runs[0] if m not in ("served", "errors")}
            if key != "fresh":
                out[v][key]["served"] = int(sum(s["served"] for s in runs))
                out[v][key]["errors"] = int(sum(s["errors"] for s in runs))
    return out


def render(result: dict) -> str:
    r = result["results"]
    lines = [
        "# TLS vs plaintext gRPC to the local Triton",
        "",
        f"{result['model']}; {result['rounds']} interleaved rounds (order rotates), medians of per-round values; client and "
        f"server share the machine ({result['machine']['cpus']} CPUs). Load average before {result['loadavg_before']}, after {result['loadavg_after']}.",
        "",
        "| variant | c=1 p50 ms | c=1 p99 ms | c=1 req/s | c=64 p50 ms | c=64 p99 ms | c=64 req/s | new channel + 1 request p50 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        a, b, f = r[v]["c1"], r[v]["c64"], r[v]["fresh"]
        lines.append(
            f"| {v} | {a['p50_ms']:.3f} | {a['p99_ms']:.3f} | {a['req_per_s']:.0f} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | {b['req_per_s']:.0f} | {f['p50_ms']:.2f} | {a['errors'] + b['errors']} |"
        )
    lines += ["", "Ratios to plaintext (same run):", ""]
    base = r["plaintext"]
    for v in VARIANTS[1:]:
        lines.append(
            f"- {v}: c=1 p50 x{r[v]['c1']['p50_ms'] / base['c1']['p50_ms']:.2f}, c=64 throughput x{r[v]['c64']['req_per_s'] / base['c64']['req_per_s']:.2f}, "
            f"c=64 p99 x{r[v]['c64']['p99_ms'] / base['c64']['p99_ms']:.2f}, new channel x{r[v]['fresh']['p50_ms'] / base['fresh']['p50_ms']:.2f}"
        )
    lines += [
        "",
        "One long-lived channel per client (as TritonClient keeps) pays the TLS handshake once; the per-request cost is "
        "record encryption on both sides. The new-channel column is what a client that reconnects per request would pay.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300, help="requests per round at concurrency 1")
    ap.add_argument("--requests-64", type=int, default=3000, help="requests per round at concurrency 64")
    ap.add_argument("--fresh", type=int, default=20, help="new-channel requests per round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        root = Path(tmp)
        repo = build_model(root)
        certs = write_dev_certs(root / "certs")
        server_tls = {"plaintext": None, "tls": ServerTls.from_dir(certs.directory), "mutual_tls": ServerTls.from_dir(certs.directory, mutual=True)}
        client_tls = {"plaintext": None, "tls": ClientTls(certs.ca), "mutual_tls": ClientTls.from_dir(certs.directory)}
        servers = {v: LocalTriton(repo, tls=server_tls[v], exit_timeout_s=0).start() for v in VARIANTS}
        try:
            before = [round(x, 2) for x in os.getloadavg()]
            results = asyncio.run(run({v: s.grpc_url for v, s in servers.items()}, client_tls, args.rounds, args.requests, args.requests_64, args.fresh))
            after = [round(x, 2) for x in os.getloadavg()]
        finally:
            for s in servers.values():
                s.stop()
    result = {
        "model": f"{MODEL}: XGBoost 100 trees depth 5, 30 float32 features, ONNX via the model runtime (Python backend), batch-1 requests",
        "rounds": args.rounds,
        "requests": {"c1_per_round": args.requests, "c64_per_round": args.requests_64, "fresh_per_round": args.fresh},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "loadavg_before": before,
        "loadavg_after": after,
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tls.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "tls.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
