"""Instances with the queue policy: the compiled fraud model at N instances side by side, same machine, one run.

Why: with a queue policy Triton 2.51's dynamic batcher does not pre-fetch. It hands a batch only to an
instance already waiting for one; when none is, it waits on a condition variable that an instance going
idle never signals (core: dynamic_batch_scheduler.cc WaitForPayloadSlotAvailable; the rate limiter calls the
batcher back when a payload is dequeued, not when an instance frees up), so the next arrival or a 500 ms
timer wakes it, and the queue timeout rejects what waited. A closed loop whose callers are all queued sends
no next arrival. compile/emit.py therefore derives twice the instances that run at once; this measures it.

Closed loops from nghttp2's h2load (C; it offers what one Python process on these cores cannot) at 8 and 64
outstanding requests, with the server pinned to core 0 and h2load on core 1, then with both on both cores;
and the Python load generator (benchmarks/loadgen.py) at 1, 16 and 64 callers on shared cores, the way the
suite measures. Rounds interleave the instance counts (order rotated). Writes results/instances.{json,md}.

    .venv/bin/python benchmarks/bench_instances.py [--counts 2,4] [--rounds 2] [--duration 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import numpy as np

import loadgen
import suite
from peers import servers
from peers.model import prepare

RESULTS = HERE / "results"
STALL_MS = 400.0  # an answer this slow waited for the batcher's 500 ms timer (the model runs in < 1 ms)
H2LOAD_POINTS = ((1, 8), (1, 64), (8, 8))  # connections x outstanding streams each
PYTHON_CONCURRENCY = (1, 16, 64)


def start(model, count: int) -> servers.Peer:
    from scorestack.triton_config import load_config, write_config

    folder = servers.triton_variants(model, servers.tmp_run_dir(f"scorestack-instances-{count}-"))["batching"]
    cfg = load_config(folder / "config.pbtxt")
    cfg.instance_group[0].count = count
    write_config(cfg, folder / "config.pbtxt")
    return servers.start_triton(f"instances_{count}", folder, f"the compiled fraud folder with instance_group count {count}")


def h2load_point(peer: servers.Peer, target: loadgen.Target, connections: int, streams: int, duration_s: float, cpus: list[int]) -> dict:
    before = peer.stats()
    r = loadgen.h2load_closed(target, connections, streams, duration_s, cpus)
    after = peer.stats()
    if not (before and after):
        raise loadgen.LoadGenError("Triton's statistics did not answer")
    lat = r.pop("latencies_ms")
    ok, fail = after["success"] - before["success"], after["fail"] - before["fail"]
    return {"generator": "h2load", "callers": connections * streams, "connections": connections, "served_per_s": ok / max(r["duration_s"], 1e-9),
            "served": ok, "rejected": fail, "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "max_ms": r["max_ms"],
            "stalled": int(np.sum(lat >= STALL_MS)), "server_stats": suite.server_stats(before, after), "h2load_cores": r["client_cpu_cores"]}


def python_point(gen: loadgen.LoadGenerator, peer: servers.Peer, target: loadgen.Target, concurrency: int, duration_s: float) -> dict:
    res = suite.measure_point(gen, peer, target, "closed", concurrency, duration_s, 0.3)
    if isinstance(res, str):
        raise loadgen.LoadGenError(res)
    st = res.__dict__.get("server_stats") or {}
    return {"generator": "python", "callers": concurrency, "served_per_s": res.throughput, "served": res.ok,
            "rejected": int(st.get("failed") or 0), "p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "max_ms": res.max_ms,
            "stalled": None, "server_stats": st, "errors": res.errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="2,4", help="instance counts to compare (the compiler derives 4 on 2 CPUs with the policy)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per point")
    ap.add_argument("--out", type=Path, default=RESULTS / "instances.json")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if loadgen.h2load_missing():
        print(loadgen.h2load_missing(), file=sys.stderr)
        return 2
    from scorestack import paths

    model = prepare(paths.workspace() / "bench_peers")
    rows = np.load(model.xgb_json.parent / "fraud_holdout.npz")["X"][:64].astype(np.float32)
    cores = sorted(os.sched_getaffinity(0))
    data = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": suite.machine_info(),
            "load_before": suite.loadavg(), "counts": counts, "rounds": args.rounds, "duration_s": args.duration,
            "model": {k: v for k, v in model.report.get("triton", {}).items() if k != "rules"},
            "h2load": loadgen._h2load_version(), "points": [], "failures": []}
    peers = {n: start(model, n) for n in counts}
    t0 = time.monotonic()
    try:
        placements = (("pinned", cores[:1], cores[-1:]), ("shared", cores, cores))
        for placement, server_cpus, client_cpus in placements:
            for r in range(args.rounds):
                for n in counts[r % len(counts):] + counts[: r % len(counts)]:
                    peer = peers[n]
                    servers.pin_tree(peer.pids(), server_cpus)
                    target = suite.make_target(peer, rows)
                    for connections, streams in H2LOAD_POINTS:
                        try:
                            p = h2load_point(peer, target, connections, streams, args.duration, client_cpus)
                        except loadgen.LoadGenError as exc:
                            data["failures"].append({"placement": placement, "instances": n, "round": r, "point": f"{connections}x{streams}", "reason": str(exc)})
                            print(f"{placement} n={n} {connections}x{streams}: {exc}; restarting the server", flush=True)
                            peer.stop()
                            peer = peers[n] = start(model, n)
                            servers.pin_tree(peer.pids(), server_cpus)
                            target = suite.make_target(peer, rows)
                            continue
                        data["points"].append({"placement": placement, "instances": n, "round": r, **p})
                        print(f"{placement} n={n} h2load {connections}x{streams}: {p['served_per_s']:,.0f}/s rejected {p['rejected']} "
                              f"p99 {p['p99_ms']:.2f} max {p['max_ms']:.1f} ms stalled {p['stalled']}", flush=True)
                    servers.pin_tree(peer.pids(), cores)
        with loadgen.LoadGenerator(1) as gen:
            for r in range(args.rounds):
                for n in counts[r % len(counts):] + counts[: r % len(counts)]:
                    peer = peers[n]
                    target = suite.make_target(peer, rows)
                    for c in PYTHON_CONCURRENCY:
                        try:
                            p = python_point(gen, peer, target, c, args.duration)
                        except loadgen.LoadGenError as exc:
                            data["failures"].append({"placement": "shared", "instances": n, "round": r, "point": f"python c{c}", "reason": str(exc)})
                            continue
                        data["points"].append({"placement": "shared", "instances": n, "round": r, **p})
                        print(f"shared n={n} python c{c}: {p['served_per_s']:,.0f}/s rejected {p['rejected']} p50 {p['p50_ms']:.3f} "
                              f"p99 {p['p99_ms']:.2f} ms", flush=True)
    finally:
        for peer in peers.values():
            peer.stop()
    data["seconds"] = round(time.monotonic() - t0, 1)
    data["load_after"] = suite.loadavg()
    args.out.write_text(json.dumps(data, indent=1, default=float))
    args.out.with_suffix(".md").write_text(render(data))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def render(data: dict) -> str:
    def rng(vals: list[float], fmt: str) -> str:
        vals = [v for v in vals if v is not None]
        if not vals:
            return "–"
        lo, hi = min(vals), max(vals)
        return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"

    m = data["machine"]
    lines = [
        "# Instances with the queue policy (Triton 2.51): the compiled fraud model at each instance count, side by side",
        "",
        f"Generated by `benchmarks/bench_instances.py` ({data['date']}; {m['cores']} cores, {m['cpu_model']}; load {data['load_before']} → "
        f"{data['load_after']}; {data['rounds']} interleaved rounds, {data['duration_s']} s per point; {data['h2load']}). "
        f"Model settings as compiled: {json.dumps(data['model'])}, only the instance count changed.",
        "",
        f"'stalled' counts answers slower than {STALL_MS:.0f} ms: requests the batcher held until its 500 ms timer (the model "
        "itself runs in well under 1 ms), which the queue timeout then mostly rejects. h2load latencies are of every answer "
        "(rejections included), from the send; served/s and rejected are Triton's own counts. Ranges are over rounds.",
        "",
        "| placement | generator | callers | instances | served/s | rejected | p50 ms | p99 ms | max ms | stalled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = []
    for p in data["points"]:
        k = (p["placement"], p["generator"], p.get("connections", 1), p["callers"], p["instances"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        ps = [p for p in data["points"] if (p["placement"], p["generator"], p.get("connections", 1), p["callers"], p["instances"]) == k]
        placement, gen, conns, callers, n = k
        where = "server core 0, generator core 1" if placement == "pinned" else "both share the cores"
        who = f"h2load, {conns} conn" if gen == "h2load" else "Python (loadgen)"
        lines.append(f"| {where} | {who} | {callers} | {n} | {rng([p['served_per_s'] for p in ps], ',.0f')} | "
                     f"{rng([p['rejected'] for p in ps], 'd')} | {rng([p['p50_ms'] for p in ps], '.2f')} | {rng([p['p99_ms'] for p in ps], '.2f')} | "
                     f"{rng([p['max_ms'] for p in ps], '.1f')} | {rng([p['stalled'] for p in ps], 'd') if gen == 'h2load' else '–'} |")
    if data["failures"]:
        lines += ["", "Points that did not complete (the server was restarted after each):", ""]
        lines += [f"- {f['placement']}, {f['instances']} instances, round {f['round']}, {f['point']}: {f['reason']}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
