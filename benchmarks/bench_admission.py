"""Admission control through scorestack's client under open-loop overload, side by side in one run.

Triton pinned to one core, one driver process on the other sending through `TritonClient` with each
policy in turn (none, fixed, adaptive), Poisson arrivals at fractions of the capacity measured in the
same round. docs/benchmarks.md ("Admission control under overload"). Results: results/admission.{json,md}.

    .venv/bin/python benchmarks/bench_admission.py [--rows 64] [--rounds 2] [--duration 3] [--fractions 0.8,1.2,1.5]
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

import harness
import numpy as np

POLICIES = ("none", "fixed", "adaptive")  # "adaptive:T" (--policies) sets the adaptive target to T ms


# -- the driver (a harness worker, pinned) ---------------------------------------------------------------
def _kind(exc: BaseException) -> str:
    from scorestack.errors import InferenceError, OverloadedError

    if isinstance(exc, OverloadedError):
        return "refused_client" if exc.local else "rejected_server"
    if isinstance(exc, InferenceError):
        return "deadline" if "deadline" in str(exc) else "other"
    return type(exc).__name__


class Driver:
    """Sends through `TritonClient` itself, with the admission policy of each point."""

    def __init__(self, settings: dict, index: int) -> None:
        self.s = settings

    async def __aenter__(self) -> "Driver":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def point(self, url: str, model: str, policy, mode: str, value: float, duration_s: float, warmup_s: float, deadline_s: float, seed: int) -> dict:
        from scorestack.client.triton import TritonClient

        rows, per = self.s["rows"], self.s["per_request"]
        batches = [np.ascontiguousarray(rows[(i * per) % len(rows):][:per]) for i in range(64)]
        batches = [b if len(b) == per else np.ascontiguousarray(rows[:per]) for b in batches]
        client = TritonClient(url, deadline_s=deadline_s, max_in_flight=policy)
        await client.infer(model, {"features": batches[0]})  # metadata and channel first
        send = lambda i: client.infer(model, {"features": batches[i % 64]})
        if mode == "closed":
            t = await harness.closed_loop(send, int(value), duration_s=duration_s, warmup_s=warmup_s, classify=_kind)
        else:
            (t,) = await harness.open_loop(send, value, duration_s=duration_s, warmup_s=warmup_s, seed=seed, classify=_kind)
        state = client.admission(model)
        await client.close()
        sm = t.summary()
        counts = {"served": t.ok, **{k: t.errors.get(k, 0) for k in ("refused_client", "rejected_server", "deadline", "other")}}
        return {"counts": counts, "samples": t.error_samples, "served_per_s": t.ok / duration_s,
                **{k: sm[k] for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms")}, "send_lag_p99_ms": sm.get("send_lag_ms_p99"),
                "client_cpu_cores": sm["client_cpu_cores"], "admission": state}


# -- the run --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="rows per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--fractions", default="0.8,1.2,1.5", help="open-loop rates as fractions of the round's closed-loop capacity")
    ap.add_argument("--deadline", type=float, default=1.0, help="the client's deadline per call (s)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="none, fixed, adaptive, adaptive:T (target T ms)")
    ap.add_argument("--out", type=Path, default=harness.RESULTS / "admission.json")
    args = ap.parse_args(argv)

    import suite
    from peers import servers
    from peers.model import prepare
    from scorestack import paths
    from scorestack.client.admission import AdaptiveLimit

    model = prepare(paths.workspace() / "bench_peers")
    triton = model.report.get("triton", {})
    if args.rows > int(triton.get("max_batch_size", 64)):
        raise SystemExit(f"--rows {args.rows} exceeds the model's max_batch_size {triton.get('max_batch_size')}")
    budget_ms = float(model.report.get("latency_budget_ms") or 10.0)
    rows = np.load(model.xgb_json.parent / "fraud_holdout.npz")["X"][:4096].astype(np.float32)
    cores = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = cores[:1], cores[-1:]
    fractions = [float(f) for f in args.fractions.split(",")]
    data = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": harness.machine(), "load_before": list(os.getloadavg()),
            "rows_per_request": args.rows, "rounds": args.rounds, "duration_s": args.duration, "deadline_s": args.deadline,
            "budget_ms": budget_ms, "model": {k: v for k, v in triton.items() if k != "rules"}, "server_cpus": server_cpus,
            "client_cpus": client_cpus, "policies": args.policies, "points": [], "failures": []}

    def start():
        peer = servers.start_triton("scorestack", servers.triton_variants(model, servers.tmp_run_dir("scorestack-admission-"))["batching"], "")
        harness.pin(peer.pids(), server_cpus, children=True)
        return peer

    driver = harness.Workers(1, "bench_admission:Driver", {"rows": rows, "per_request": args.rows, "uvloop": False}, cpus=client_cpus)
    peer = start()
    t_start = time.monotonic()

    def run(policy_name, policy, mode, value, seed=0):
        nonlocal peer
        before = peer.stats()
        try:
            (got,) = driver.run("point", [{"url": peer.address, "model": peer.model, "policy": policy, "mode": mode, "value": value, "duration_s": args.duration,
                                          "warmup_s": args.warmup, "deadline_s": args.deadline, "seed": seed}], timeout_s=args.duration + args.warmup + args.deadline + 120)
        except harness.WorkerError as exc:  # recorded, and the server restarted
            got = exc
        after = peer.stats()
        if isinstance(got, Exception) or not (before and after):
            reason = f"{type(got).__name__}: {got}" if isinstance(got, Exception) else "Triton's statistics did not answer"
            data["failures"].append({"policy": policy_name, "mode": mode, "value": value, "reason": reason})
            print(f"  {policy_name} {mode} {value:,.0f}: {reason}; restarting the server", flush=True)
            peer.stop()
            peer = start()
            return None
        got["server_stats"] = suite.server_stats(before, after)
        return got

    try:
        for r in range(args.rounds):
            cap = run("none", None, "closed", 32)
            if cap is None:
                continue
            capacity = cap["served_per_s"]
            fixed = max(int(triton.get("instance_count", 1)), round(capacity * budget_ms / 2e3))
            data["points"].append({"round": r, "policy": "none", "mode": "closed", "callers": 32, "capacity": capacity, **cap})
            print(f"round {r}: capacity {capacity:,.0f} req/s ({args.rows} rows each) through TritonClient, 32 callers; fixed limit {fixed}", flush=True)
            policies = {}
            for name in args.policies.split(","):
                if name in ("none", "fixed", "adaptive"):
                    policies[name] = {"none": None, "fixed": fixed, "adaptive": AdaptiveLimit()}[name]
                elif name.startswith("adaptive:"):
                    policies[name] = AdaptiveLimit(target_ms=float(name.split(":", 1)[1]))
                else:
                    raise SystemExit(f"--policies: unknown {name!r}; use none, fixed, adaptive or adaptive:T")
            names = list(policies)
            for f in fractions:
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    got = run(name, policies[name], "open", f * capacity, seed=1000 * r + int(f * 100))
                    if got is None:
                        continue
                    data["points"].append({"round": r, "policy": name, "mode": "open", "fraction": f, "rate": f * capacity, "capacity": capacity,
                                           "limit": fixed if name == "fixed" else None, **got})
                    c = got["counts"]
                    print(f"  {name:8s} {f:.0%} ({f * capacity:,.0f}/s): served {got['served_per_s']:,.0f}/s p99 {got['p99_ms']:.1f} ms; "
                          f"refused in the client {c['refused_client']}, rejected by Triton {c['rejected_server']}, deadline {c['deadline']}, "
                          f"other {c['other']}; limit {got['admission'] and got['admission']['limit']}; send lag p99 {got['send_lag_p99_ms']:.1f} ms, "
                          f"client {got['client_cpu_cores']:.2f} cores", flush=True)
    finally:
        driver.close()
        peer.stop()
    data["seconds"] = round(time.monotonic() - t_start, 1)
    data["load_after"] = list(os.getloadavg())
    print("wrote {} and {}".format(*harness.write_results(args.out.stem, data, render(data), args.out.parent)))
    return 0


def render(data: dict) -> str:
    m = data["machine"]
    lines = [
        "# Admission control through scorestack's client, open-loop overload",
        "",
        f"Generated by `benchmarks/bench_admission.py` ({data['date']}; {m['cpus']} cores, {m['cpu_model']}; load {data['load_before']} → "
        f"{data['load_after']}; {data['rounds']} rounds, {data['duration_s']} s per point). The compiled fraud model "
        f"({json.dumps(data['model'])}) in the local Triton pinned to core {data['server_cpus']}; one driver process on core "
        f"{data['client_cpus']} sends through `TritonClient` ({data['rows_per_request']} rows per request, deadline {data['deadline_s']} s), "
        f"Poisson arrivals at fractions of the capacity measured in the same round (closed loop, 32 callers, no limit). "
        f"Latency budget {data['budget_ms']} ms. Latencies are of served requests from their scheduled time.",
        "",
        "| round | policy | offered | rate/s | served/s | p50 ms | p99 ms | refused in the client | rejected by Triton | deadline | other | limit at the end | client send lag p99 ms | client cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in data["points"]:
        c = p["counts"]
        adm = p.get("admission") or {}
        offered = "closed, 32 callers" if p["mode"] == "closed" else f"{p['fraction']:.0%}"
        rate = "–" if p["mode"] == "closed" else f"{p['rate']:,.0f}"
        limit = adm.get("limit", "–") if p["policy"] != "none" else "–"
        if adm.get("policy") == "adaptive":
            limit = f"{limit} (target {adm['target_ms']:g} ms)"
        lines.append(f"| {p['round']} | {p['policy']} | {offered} | {rate} | {p['served_per_s']:,.0f} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} | "
                     f"{c['refused_client']} | {c['rejected_server']} | {c['deadline']} | {c['other']} | {limit} | "
                     f"{p['send_lag_p99_ms'] if p['send_lag_p99_ms'] is None else format(p['send_lag_p99_ms'], '.1f')} | {p['client_cpu_cores']:.2f} |")
    if data["failures"]:
        lines += ["", "Points that did not complete (the server was restarted after each):", ""]
        lines += [f"- {f['policy']} {f['mode']} {f['value']:,.0f}: {f['reason']}" for f in data["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
