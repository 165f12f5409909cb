"""Side by side: scorestack against what a user would run instead, same fraud model, same machine, same client.

Every peer (benchmarks/peers/) is checked for the source model's probability, then loaded by h2load
(loadgen.py) in interleaved rounds: closed loop at each concurrency, open loop at fractions of its
closed-loop maximum. Writes results/peers.{json,md} and regenerates REPORT.md (docs/benchmarks.md).

    .venv/bin/python benchmarks/suite.py            # 2 rounds, 2 s per point (~8 minutes)
    .venv/bin/python benchmarks/suite.py --quick    # 1 round, 0.7 s per point: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # loadgen, peers, report live beside this file

import numpy as np

import harness
import loadgen
import report
from peers import servers
from peers.model import prepare

RESULTS = harness.RESULTS
# FastAPI peers: `fastapi_<runtime>` is the async endpoint on 1 worker (the strongest honest
# single-process service); `_sync` the threadpool endpoint users also write; `_w2` two workers.
FASTAPI_TARGETS = tuple(f"fastapi_{rt}{v}" for rt in ("onnxruntime", "xgboost") for v in ("", "_w2", "_sync"))
TRITON_HTTP = ("scorestack_http", "scorestack_http_binary")  # the scorestack server's HTTP endpoint
TARGETS = ("scorestack", "scorestack_nobatch", "scorestack_python", "triton_cache_floor", *TRITON_HTTP, "mlserver", "bentoml", *FASTAPI_TARGETS)
DESCRIPTIONS = {
    "scorestack": "scorestack: compiled fraud model in the local Triton, derived dynamic batching, KServe v2 gRPC",
    "scorestack_nobatch": "the same model folder with the dynamic_batching block removed, KServe v2 gRPC",
    "scorestack_python": "the same model folder served through Triton's Python backend (scorestack's model runtime in a stub process) instead of scorestack's native backend, derived dynamic batching, KServe v2 gRPC",
    "triton_cache_floor": "Triton response-cache hit (the same request repeated, response_cache enabled): the server-path floor, KServe v2 gRPC",
    "scorestack_http": "the scorestack server's KServe v2 HTTP endpoint, JSON tensors",
    "scorestack_http_binary": "the scorestack server's KServe v2 HTTP endpoint, input in Triton's binary tensor extension (JSON header + 120 raw bytes), JSON output",
}
MLSERVER_MIN_BATCH_TIME_US = 200  # MLServer skips adaptive batching when max_batch_time is 0 (mlserver/batching/hooks.py)
AGREE_ATOL = 1e-4  # served probability vs the source XGBoost model (float32 artifacts)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_peers(model, run_dir: Path, names: tuple[str, ...]) -> tuple[dict, dict]:
    """Start every requested peer; a peer that fails to start is recorded with its reason, the rest run."""
    started: dict[str, servers.Peer] = {}
    failed: dict[str, str] = {}
    variants = servers.triton_variants(model, run_dir)
    triton = model.report.get("triton", {})
    for name in names:
        log(f"starting {name}")
        try:
            if name in ("scorestack", "scorestack_nobatch", "scorestack_python", "triton_cache_floor"):
                variant = {"scorestack": "batching", "scorestack_nobatch": "nobatch", "scorestack_python": "python", "triton_cache_floor": "cache"}[name]
                if variant not in variants:
                    raise ValueError("the compiled fraud model is served through the Python backend already (no native-backend config to compare)")
                peer = servers.start_triton(name, variants[variant], DESCRIPTIONS[name])
            elif name in TRITON_HTTP:
                base = started.get("scorestack")
                if base is None:
                    raise ValueError("measured on the scorestack server's HTTP port: include target scorestack")
                peer = dataclasses.replace(base, name=name, protocol="http", address=base.http_address, model=f"/v2/models/{base.model}/infer",
                                           description=DESCRIPTIONS[name], stop=lambda: None)
            elif name == "mlserver":
                # Adaptive batching set like scorestack's derived dynamic batching (same max batch, same delay), except
                # that MLServer turns batching off at max_batch_time 0: then 200 µs (scorestack's earlier derived delay).
                peer = servers.start_mlserver(model, run_dir / "mlserver", int(triton.get("max_batch_size", 64)),
                                              int(triton.get("max_queue_delay_us") or MLSERVER_MIN_BATCH_TIME_US), log=log)
            elif name == "bentoml":
                peer = servers.start_bentoml(model, run_dir / "bentoml", log=log)
            elif name in FASTAPI_TARGETS:
                peer = servers.start_fastapi(name.split("_")[1], model, run_dir, endpoint="sync" if name.endswith("_sync") else "async",
                                             workers=2 if name.endswith("_w2") else 1)
            else:
                raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
        except Exception as exc:  # the comparison runs without it and says why
            failed[name] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
            log(f"  {name} did not start: {failed[name][:300]}")
            continue
        started[name] = peer
    return started, failed


def make_target(peer: servers.Peer, row: np.ndarray) -> loadgen.Target:
    row = np.asarray(row, dtype=np.float32).reshape(1, -1)
    if peer.protocol == "grpc":
        return loadgen.grpc_target(peer.name, peer.address, peer.model, peer.input_name, row, description=peer.description)
    if peer.name == "scorestack_http":
        body = {"inputs": [{"name": peer.input_name, "shape": list(row.shape), "datatype": "FP32", "data": row[0].tolist()}]}
        return loadgen.http_target(peer.name, peer.address, peer.model, json.dumps(body).encode(), description=peer.description)
    if peer.name == "scorestack_http_binary":
        head = json.dumps({"inputs": [{"name": peer.input_name, "shape": list(row.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": row.nbytes}}]}).encode()
        return loadgen.http_target(peer.name, peer.address, peer.model, head + row.tobytes(), content_type="application/octet-stream",
                                   headers=(f"inference-header-content-length: {len(head)}",), description=peer.description)
    return loadgen.http_target(peer.name, peer.address, peer.model, json.dumps({"features": row[0].tolist()}).encode(), description=peer.description)


def answer(target: loadgen.Target) -> float:
    """The probability a target answers for its prebuilt request, sent once from Python: the value check before loading it."""
    import urllib.request

    if target.protocol == "http":
        headers = dict(h.split(": ", 1) for h in target.headers)
        req = urllib.request.Request(f"http://{target.address}{target.path}", data=target.body, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
        return float(body["probability"]) if "probability" in body else float(np.ravel(body["outputs"][0]["data"])[-1])
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    with grpc.insecure_channel(target.address) as channel:
        raw = channel.unary_unary(target.path)(target.body[5:], timeout=10)
    resp = pb.ModelInferResponse.FromString(raw)
    out = resp.outputs[0]
    if resp.raw_output_contents:
        dtype = {"FP32": np.float32, "FP64": np.float64}[out.datatype]
        return float(np.frombuffer(resp.raw_output_contents[0], dtype=dtype)[-1])
    values = out.contents.fp32_contents or out.contents.fp64_contents
    return float(values[-1])


def server_stats(before: dict | None, after: dict | None) -> dict | None:
    """Triton's statistics between two reads of Peer.stats(): failures (h2load sees HTTP status only), average batch,
    time in the server (arrival to response) and queue wait."""
    if not (before and after):
        return None
    d = {k: after[k] - before[k] for k in after}
    return {"avg_batch": round(d["inferences"] / d["executions"], 2) if d["executions"] else None, "failed": d["fail"],
            "avg_request_ms": round(d["success_ns"] / d["success"] / 1e6, 3) if d["success"] else None,
            "avg_queue_ms": round(d["queue_ns"] / d["queue"] / 1e6, 3) if d["queue"] else None}


def measure(peer: servers.Peer, target: loadgen.Target, mode: str, value: float, duration_s: float, cpus: list[int] | None) -> dict:
    before = peer.stats()
    if mode == "closed":
        res = loadgen.closed(target, int(value), duration_s, cpus=cpus, pids=peer.pids)
    else:
        res = loadgen.open_loop(target, value, duration_s, cpus=cpus, pids=peer.pids)
    st = server_stats(before, peer.stats())
    failed = (st or {}).get("failed", 0) + res["requests"] - res["http_ok"]
    if st and st["failed"]:
        res["throughput"] *= 1 - st["failed"] / res["requests"]  # HTTP 200 with a gRPC error status is not served
    return {**res, "server_stats": st, "errors": failed}


def summarize(runs: list[dict]) -> dict:
    """Median over rounds (and the min-max range) per target and point."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["mode"], str(r["point"])), []).append(r)
    out: dict = {}
    med = lambda vals: statistics.median(vals) if vals else None
    for (target, mode, point), rs in groups.items():
        stat = lambda k, rs=rs: med([r["server_stats"][k] for r in rs if (r.get("server_stats") or {}).get(k) is not None])
        entry = {k: med([r[k] for r in rs if r.get(k) is not None]) for k in ("throughput", "rate", "achieved_rate", "p50_ms", "p99_ms", "p999_ms", "max_ms", "client_cpu_cores",
                                     "server_cpu_us_per_request", "server_cpu_cores")}
        entry.update(rounds=len(rs), requests=sum(r["requests"] for r in rs), errors=sum(r["errors"] for r in rs),
                     throughput_range=[min(r["throughput"] for r in rs), max(r["throughput"] for r in rs)],
                     p50_range=[min(r["p50_ms"] for r in rs), max(r["p50_ms"] for r in rs)],
                     avg_batch=stat("avg_batch"), triton_avg_request_ms=stat("avg_request_ms"), triton_avg_queue_ms=stat("avg_queue_ms"),
                     shape=f"{rs[0]['connections']} x {rs[0]['streams']}")
        out.setdefault(target, {"closed": {}, "open": {}})[mode][point] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, 0.7 s per point")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; quick 1)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per point (default 2; quick 0.7)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--open-fractions", default="0.5,0.8", help="open-loop rates as fractions of each target's closed-loop maximum")
    ap.add_argument("--client-cpus", default=None, help="pin h2load to these cores, e.g. 0")
    ap.add_argument("--server-cpus", default=None, help="pin every server's process tree to these cores, e.g. 1")
    ap.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    ap.add_argument("--recompile", action="store_true", help="compile the fraud model again even if its spec is unchanged")
    args = ap.parse_args(argv)
    if missing := loadgen.h2load_missing():
        ap.error(missing)
    rounds = args.rounds or (1 if args.quick else 2)
    duration = args.duration or (0.7 if args.quick else 2.0)
    names = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if unknown := [n for n in names if n not in TARGETS]:
        ap.error(f"--targets: unknown {unknown}; choose from {', '.join(TARGETS)}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    fractions = [float(f) for f in args.open_fractions.split(",") if f]
    cpus = [int(c) for c in args.client_cpus.split(",")] if args.client_cpus else None
    server_cpus = [int(c) for c in args.server_cpus.split(",")] if args.server_cpus else None
    started_at = time.time()
    data: dict = {
        "name": "peers", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "mode": "quick" if args.quick else "full",
        "command": " ".join(["benchmarks/suite.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {"rounds": rounds, "duration_s": duration, "concurrency": concurrencies, "open_fractions": fractions,
                     "client_cpus": cpus, "server_cpus": server_cpus},
        "machine": harness.machine(), "load_before": list(os.getloadavg()),
        "loadgen": {"client": loadgen.version(), "grpc_connections_max": loadgen.GRPC_CONNECTIONS, "open_http_connections": loadgen.OPEN_HTTP_CONNECTIONS},
    }
    from scorestack import paths

    log("preparing the fraud model (train and compile once, cached)")
    model = prepare(paths.workspace() / "bench_peers", recompile=args.recompile)
    X = np.load(model.xgb_json.parent / "fraud_holdout.npz")["X"][:1].astype(np.float32)
    import xgboost as xgb

    want = float(xgb.Booster(model_file=str(model.xgb_json)).predict(xgb.DMatrix(X))[0])
    data["model"] = {"name": "fraud_xgb", "source": "XGBoost 300 trees, depth 6, 30 features (scorestack demo)",
                     "selected": model.report.get("selected", {}).get("format"), "artifacts": model.report.get("selected", {}).get("artifacts"),
                     "latency_budget_ms": model.report.get("latency_budget_ms"), "compiled_at": model.report.get("created_at"),
                     "triton": {k: v for k, v in model.report.get("triton", {}).items() if k not in ("rules", "measured")},
                     "source_probability": want}
    run_dir = servers.tmp_run_dir("scorestack-peers-")
    peers, failed = start_peers(model, run_dir, names)
    runs: list[dict] = []
    try:
        targets = {}
        for name, peer in list(peers.items()):
            target = make_target(peer, X[0])
            try:
                got = answer(target)
            except Exception as exc:  # a peer whose answer cannot be read is not measured
                got, why = None, f"{type(exc).__name__}: {exc}"
            if got is None or abs(got - want) > AGREE_ATOL:
                failed[name] = f"answered {got} for the held-out row, the source model {want:.6f}" if got is not None else why
                log(f"  {name} not measured: {failed[name][:300]}")
                peers.pop(name).stop()
                continue
            targets[name] = target
            if server_cpus and name not in TRITON_HTTP:
                harness.pin(peer.pids(), server_cpus, children=True)
        data["peers"] = {n: {"description": p.description, "protocol": p.protocol, "config": p.config, "versions": p.versions,
                             "probability": answer(targets[n])} for n, p in peers.items()}
        data["peers_failed"] = failed
        order = list(targets)
        total, done = rounds * len(order) * (len(concurrencies) + len(fractions)), 0
        for r in range(rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                capacity = 0.0
                points = [("closed", c) for c in concurrencies] + [("open", f) for f in fractions]
                for mode, value in points:
                    done += 1
                    if mode == "open" and capacity <= 0:
                        continue
                    try:
                        res = measure(peers[name], targets[name], mode, value if mode == "closed" else value * capacity, duration, cpus)
                    except loadgen.LoadGenError as exc:
                        log(f"[{done}/{total}] {name} {mode} {value}: FAILED {exc}")
                        data.setdefault("failed_points", []).append({"round": r, "target": name, "mode": mode, "point": value, "reason": str(exc)[:500]})
                        continue
                    if mode == "closed":
                        capacity = max(capacity, res["throughput"])
                    runs.append({**res, "round": r, "target": name, "mode": mode, "point": value})
                    log(f"[{done}/{total}] round {r + 1} {name:24s} {mode} {value:<4g} {res['throughput']:8,.0f} req/s  p50 {res['p50_ms']:6.2f}  "
                        f"p99 {res['p99_ms']:7.2f} ms  errors {res['errors']}  server {res.get('server_cpu_us_per_request', 0):.0f} µs/req  "
                        f"h2load {res['client_cpu_cores']:.2f} cores")
    finally:
        for name, peer in peers.items():
            try:
                peer.stop()
            except Exception as exc:  # stopping the others matters more
                log(f"stopping {name}: {exc}")
    data.update(load_after=list(os.getloadavg()), seconds=round(time.time() - started_at, 1), runs=runs, summary=summarize(runs))
    data["goals"] = report.evaluate_peers(data)
    harness.write_results(args.out.stem, data, "\n".join(report.render_peers(data)), args.out.parent)
    log(f"wrote {args.out} ({data['seconds']} s)")
    if args.out == RESULTS / "peers.json":
        log(f"wrote {report.write_report()}")
    for row in data["goals"]:
        log(f"{'MET   ' if row['met'] else 'MISSED'} {row['target']}: {row['measured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
