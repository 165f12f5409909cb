"""Velocity counters under several writer processes (issue 28): exactness, a Redis restart, and the
fraud path's fetch + write-back cost. docs/benchmarks.md ("Velocity counters") says each part.

    .venv/bin/python benchmarks/bench_velocity.py [--events 10000] [--users 100] [--burst 50] [--replicas 4]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Tally, closed_loop, cpu_seconds, demo_stack, machine, table, write_results

from scorestack.features.velocity import FRAUD_VELOCITY, RedisVelocity, VelocityWriter
from scorestack.serve.ports import free_port
from scorestack.serve.readiness import process_exit, wait_until


class Server:
    def __init__(self, workdir: Path, port: int, fsync: str = "always") -> None:
        self.workdir, self.port, self.fsync, self.proc = workdir, port, fsync, None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", self.fsync, "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        def pong() -> str | None:
            try:
                return None if redis.Redis(port=self.port, socket_timeout=0.5).ping() else "no PONG"
            except redis.RedisError as exc:  # not listening yet, or loading its append-only file
                return str(exc)

        wait_until(pong, timeout_s=10, what="redis-server", died=process_exit(self.proc))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def replica(port: int, prefix: str, events: list, start_at: float, out, rate: float = 0.0) -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    writer = VelocityWriter(RedisVelocity(client, FRAUD_VELOCITY, prefix=prefix))
    while time.time() < start_at:
        time.sleep(0.001)
    log = []
    t0 = time.perf_counter()
    for k, (event_id, user, t, amount) in enumerate(events):
        if rate:  # paced: this replica's share of the total rate
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        log.append((event_id, user, t, amount, writer.add(user, event_id, {"amount": amount}, t)))
    out.put((log, time.perf_counter() - t0))


def make_events(n: int, users: int, burst: int, now: float, seed: int = 28) -> list[list]:
    """Bursts of `burst` events for one user; each burst is dealt round-robin to the replicas, so
    all of them write the same user's buckets at the same moment."""
    rng = random.Random(seed)
    events = []
    for b in range(n // burst):
        user = rng.randrange(users)
        base = now - rng.uniform(0, 7200)
        for i in range(burst):
            # Mostly within seconds of the burst's time; one in ten late by up to an hour (out of order).
            t = base + rng.uniform(0, 5) - (rng.uniform(0, 3600) if rng.random() < 0.1 else 0)
            events.append((f"e{b}-{i}", user, t, round(rng.uniform(0.5, 500), 2)))
    return events


def exact_run(args, workdir: Path, *, outage: bool = False) -> dict:
    import redis

    port = free_port()
    server = Server(workdir / ("outage" if outage else "steady"), port)
    server.workdir.mkdir(parents=True, exist_ok=True)
    server.start()
    now = time.time()
    events = make_events(args.events, args.users, args.burst, now)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0
    prefix = f"bench:{'outage' if outage else 'steady'}:"
    procs = [ctx.Process(target=replica, args=(port, prefix, events[k :: args.replicas], start_at, out,
                                                 args.outage_rate / args.replicas if outage else 0.0)) for k in range(args.replicas)]
    for p in procs:
        p.start()
    outage_s = None
    if outage:
        # Kill once a third of the events are in (count the markers), restart a second later. The
        # replicas are paced (--outage-rate) so that the outage falls within the run.
        probe = redis.Redis(port=port)
        while True:
            n = probe.dbsize()
            if n >= args.events // 3:
                break
            time.sleep(0.005)
        t_kill = time.monotonic()
        server.kill()
        time.sleep(1.0)
        server.start()
        outage_s = time.monotonic() - t_kill
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    log = [row for r in results for row in r[0]]
    write_s = max(r[1] for r in results)
    outcomes = {k: sum(1 for row in log if row[4] == k) for k in ("added", "duplicate", "expired", "failed")}
    store = RedisVelocity(redis.Redis(port=port), FRAUD_VELOCITY, prefix=prefix)
    # Read (and make the reference) at a time no earlier than any write's clock: a writer leaves out an
    # event already older than its window when written, so a reference taken earlier than that write
    # (as `now + 1` was: a 5-minute bucket's edge crossed between the start and a late retry showed
    # up as "lost" counts, 141 in one run) would count an event the window had already dropped.
    read_now = time.time() + 1
    out = {"outage": outage, "events": len(log), "outcomes": outcomes, "write_s": write_s, "events_per_s": len(log) / write_s, "outage_s": outage_s}
    out.update(compare(store, log, args.users, read_now))
    if outcomes["failed"]:
        # A failed write is unconfirmed, not undone: SIGKILL can land after Redis applied a script (fsync'd) and
        # before its reply left, so the counters may already hold it. What a service does with its failed log:
        # send each event again with its id once Redis is back. The marker answers "duplicate" for those that
        # landed; the rest are added. After that every counter must equal the reference over every event.
        writer = VelocityWriter(store)
        retried = {row[0]: writer.add(row[1], row[0], {"amount": row[3]}, row[2]) for row in log if row[4] == "failed"}
        out["before_retry"] = {k: out[k] for k in ("lost_counts", "double_counts", "lost_amount", "users_mismatched")}
        out["retry_of_failed"] = {k: sum(v == k for v in retried.values()) for k in ("added", "duplicate", "failed")}
        out.update(compare(store, [(*row[:4], retried.get(row[0], row[4])) for row in log], args.users, time.time() + 1))
    server.stop()
    return out


def compare(store: RedisVelocity, log: list, users: int, read_now: float) -> dict:
    """Every user's windows against the reference from the events the log says were added (or found already there)."""
    lost = double = mismatched = 0
    lost_amount = 0.0
    for user in range(users):
        expected = FRAUD_VELOCITY.reference(read_now, [(t, {"amount": a}) for _, u, t, a, o in log if u == user and o in ("added", "duplicate")])
        got = store.read(user, now=read_now)
        bad = False
        for name in ("txn_count_1h", "txn_count_24h"):
            diff = int(round(got[name] - expected[name]))
            lost += max(0, -diff)
            double += max(0, diff)
            bad |= diff != 0
        for name in ("amount_sum_1h", "amount_sum_24h"):
            if abs(got[name] - expected[name]) > 1e-6 * max(1.0, abs(expected[name])):
                bad = True
                lost_amount += max(0.0, expected[name] - got[name])
        mismatched += bad
    return {"lost_counts": lost, "double_counts": double, "lost_amount": round(lost_amount, 2), "users_mismatched": mismatched}


# --- the fraud path's store part -------------------------------------------------------------------


async def fetch_runs(workdir: Path, seconds: float, rounds: int, repository: Path | None = None) -> dict:
    """The store part off/on, and with a compiled fraud model in `repository` the whole fraud path
    (FraudService: fetch, the model in the local Triton over gRPC, the write-back) off/on too."""
    from scorestack.client.fraud import FraudService
    from scorestack.client.triton import TritonClient
    from scorestack.demo import data as demo_data
    from scorestack.demo import features as demo_features
    from scorestack.serve import LocalTriton
    from scorestack.features import store as feature_store
    from scorestack.features.fetch import FeatureFetcher
    from scorestack.features.velocity import AsyncVelocityWriter

    # The fetch comparison's Redis fsyncs its append-only file every second (Redis's default policy);
    # the exactness runs fsync every write, so a kill loses nothing that was acknowledged.
    server = Server(workdir / "fetch", free_port(), "everysec")
    server.workdir.mkdir(parents=True, exist_ok=True)
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    repo = demo_features.init_repo(workdir / "repo", online="redis", redis_url=url, n_users=1000, n_items=10, project="bench_velocity")
    feature_store.apply(repo)
    feature_store.materialize(repo)
    fs = feature_store.feature_store(repo)
    writer = AsyncVelocityWriter.for_store(fs, max_pending=100_000)
    # The fetchers freeze the start-up heap as a service's do (the default; without it, full collections
    # over the ~400k objects of Feast, pandas and gRPC fell on the requests in flight).
    off = FeatureFetcher(fs, timeout_s=0.5)
    on = FeatureFetcher(fs, timeout_s=0.5, windows=True)
    await off.start()
    await on.start()
    rng = random.Random(1)

    def sender(fetcher: FeatureFetcher, write: bool):
        async def send(i: int):
            user = rng.randrange(1000)
            result = await fetcher.fetch("fraud", {"user_id": user})
            if write:
                writer.submit(user, {"amount": 12.5})
            return result
        return send

    sends = {"off": sender(off, False), "on": sender(on, True), "windows read only": sender(on, False), "write only": sender(off, True)}
    triton = tc = None
    if repository is not None:
        triton = LocalTriton(repository, models=["fraud_xgb"], exit_timeout_s=0).start()
        tc = await TritonClient(triton.grpc_url, deadline_s=5.0).__aenter__()
        txns = [{k: float(v) for k, v in row.items()} for _, row in demo_data.make_fraud_requests(1000, seed=5).iterrows()]
        paths = {"fraud path off": FraudService(tc, off), "fraud path on": FraudService(tc, on, velocity=writer),
                 "fraud path windows read, no write-back": FraudService(tc, on)}
        sends.update({name: (lambda i, svc=svc: svc.score({"user_id": rng.randrange(1000), **txns[i % 1000]})) for name, svc in paths.items()})
    tallies: dict[str, dict[int, list[Tally]]] = {name: {1: [], 16: []} for name in sends}
    # CPU per request at 16 callers, by process: the service (this one, over the counted span), Redis
    # and Triton (over the whole loop, warm-up included, per request sent): where a saturated
    # 2-core machine's time goes, and which part would leave with Redis on a host of its own.
    import redis

    stats_client = redis.Redis(port=server.port)

    def others() -> tuple[float, float]:
        info = stats_client.info("cpu")
        return info["used_cpu_user"] + info["used_cpu_sys"], cpu_seconds([triton.process.pid], children=False) if triton is not None else 0.0

    cpu16: dict[str, list[dict[str, float]]] = {name: [] for name in sends}
    for r in range(rounds):
        for concurrency in (1, 16):
            names = list(sends) if r % 2 == 0 else list(reversed(sends))
            for name, send in ((n, sends[n]) for n in names):
                before = others()
                tally = await closed_loop(send, concurrency, duration_s=seconds, warmup_s=0.5)
                after = others()
                tallies[name][concurrency].append(tally)
                if concurrency == 16 and tally.ok:
                    cpu16[name].append({"service": tally.cpu_s / tally.ok * 1e6, "redis": (after[0] - before[0]) / tally.sent_all * 1e6,
                                        "triton": (after[1] - before[1]) / tally.sent_all * 1e6})
    await writer.drain(30)
    counts = {k: writer.count(k) for k in ("added", "duplicate", "failed", "dropped")}
    await writer.close()
    await on.close()
    await off.close()
    if triton is not None:
        await tc.__aexit__(None, None, None)
        triton.stop()
    stats_client.close()
    server.stop()
    out = {"writes": counts, "backend_on": on.backend_of("fraud")}
    for name in sends:
        c1 = Tally.merge(tallies[name][1]).summary()
        c16 = Tally.merge(tallies[name][16]).summary()
        # Rounds are separate spans: the rate is answers over their summed time, not the longest one.
        rate16 = sum(t.ok for t in tallies[name][16]) / sum(t.wall_s for t in tallies[name][16])
        out[name] = {"c1_p50_ms": c1["p50_ms"], "c1_p99_ms": c1["p99_ms"], "c16_rate": rate16, "c16_p50_ms": c16["p50_ms"],
                     "c1_errors": c1["errors"], "c16_errors": c16["errors"],
                     "rounds": [{"c1_p50_ms": a.summary()["p50_ms"], "c16_rate": b.ok / b.wall_s} for a, b in zip(tallies[name][1], tallies[name][16])],
                     "c16_cpu_us": {k: statistics.median(c[k] for c in cpu16[name]) for k in ("service", "redis", "triton")} if cpu16[name] else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--fetch-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-fetch", action="store_true")
    parser.add_argument("--no-model", action="store_true", help="the store part only: no compiled fraud model, no Triton")
    parser.add_argument("--only-fetch", action="store_true", help="the fetch comparison only (results not written)")
    parser.add_argument("--outage-rate", type=float, default=2000.0, help="events/s of all replicas together in the restart run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_velocity_"))
    try:
        runs = [] if args.only_fetch else [exact_run(args, workdir), exact_run(args, workdir, outage=True)]
        repository = None if args.skip_fetch or args.no_model else demo_stack(("fraud_xgb",), project=None)[0]
        fetch = None if args.skip_fetch else asyncio.run(fetch_runs(workdir, args.fetch_seconds, args.rounds, repository))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    data = {"machine": machine(), "settings": vars(args), "runs": runs, "fetch": fetch}
    lines = [
        "# Velocity counters: exact under concurrent replicas (issue 28)",
        "",
        f"{args.replicas} writer processes, {args.events} transactions over {args.users} users in bursts of {args.burst} for one user "
        "(each burst spread over every replica at once), event times over the last 2 h with one in ten late by up to 1 h. "
        "Counters read back and compared with a reference from the event log (the events each replica saw added). "
        f"Machine: {data['machine']['cpus']} CPUs, {data['machine']['cpu_model']}, commit {data['machine']['commit']}, {data['machine']['date']}.",
        "",
        *table(
            ["Redis restart", "added", "duplicate", "expired", "failed", "failed, yet landed (their retry: duplicate)", "lost counts", "double counts",
             "users wrong", f"events/s ({args.replicas} procs)"],
            [[f"yes ({r['outage_s']:.1f} s down)" if r["outage"] else "no", r["outcomes"]["added"], r["outcomes"]["duplicate"],
              r["outcomes"]["expired"], r["outcomes"]["failed"],
              (r.get("retry_of_failed") or {}).get("duplicate", "–"), r["lost_counts"], r["double_counts"], r["users_mismatched"], f"{r['events_per_s']:.0f}"] for r in runs],
        ),
        "",
        "Writes through scorestack.features.velocity: an atomic script (a batch of events a call, each event added at most once), an idempotency marker per event id. The study that chose it "
        "over WATCH/MULTI/EXEC with retry and the old read-modify-write (which lost counts): [velocity_write_modes.md](velocity_write_modes.md). "
        "A failed write is unconfirmed: the Redis kill can fall after a script applied and before its reply, so the restart run sends every "
        "failed event again with its id once Redis is back (what a service does with its failed log); the marker answers duplicate for those "
        "that had landed. Lost and double counts are checked after that retry; before it: "
        + "; ".join(f"lost {r['before_retry']['lost_counts']}, landed though reported failed {r['before_retry']['double_counts']}" for r in runs if r.get("before_retry"))
        + ".",
    ]
    if fetch:
        off, on = fetch["off"], fetch["on"]
        lines += [
            "",
            "## The fraud path, write-back off against on",
            "",
            "One process, its own redis-server, 1,000 users; off: fetch only; on: fetch with the windows read in the same pipeline "
            "+ the atomic write-back submitted (batched by the writer's task on the event loop, a connection of its own); the store part alone, then the whole request with the demo fraud model. "
            f"Alternating rounds of {args.fetch_seconds:.0f} s, {args.rounds} each. Backend: {fetch['backend_on']}.",
            "",
            *table(["", "c1 p50 ms", "c1 p99 ms", "c16 req/s", "c16 p50 ms"],
                   [[k, f"{v['c1_p50_ms']:.3f}", f"{v['c1_p99_ms']:.3f}", f"{v['c16_rate']:.0f}", f"{v['c16_p50_ms']:.3f}"]
                    for k, v in fetch.items() if isinstance(v, dict) and "c1_p50_ms" in v]),
            "",
            f"on / off: c1 p50 {on['c1_p50_ms'] / off['c1_p50_ms']:.3f}x, c16 req/s {on['c16_rate'] / off['c16_rate']:.3f}x. "
            f"Write-back outcomes: {fetch['writes']}.",
            "",
            "CPU µs per request at 16 callers (medians over the rounds; the service over the counted span, Redis and Triton over the "
            "whole loop per request sent), where the saturated machine's time goes:",
            "",
            *table(["", "service", "Redis", "Triton", "all three"],
                   [[k, f"{v['c16_cpu_us']['service']:.0f}", f"{v['c16_cpu_us']['redis']:.0f}", f"{v['c16_cpu_us']['triton']:.0f}",
                     f"{sum(v['c16_cpu_us'].values()):.0f}"] for k, v in fetch.items() if isinstance(v, dict) and v.get("c16_cpu_us")]),
        ]
        if "fraud path on" in fetch:  # the goal's own terms: the whole fraud request, the model in the local Triton
            p_on = fetch["fraud path on"]
            lines += ["", "The whole fraud path (FraudService over gRPC to the local Triton, rows \"fraud path\" above), on / off: "
                      f"{_ratios(fetch['fraud path off'], p_on)} (goal: within 5%)."]
            p_read = fetch.get("fraud path windows read, no write-back")
            if p_read:  # the write-back alone: the same windowed features read on both sides
                lines += ["", "The write-back alone (the same windowed features read on both sides; a team whose stream processor fills the "
                          f"buckets runs the second row): on / windows read, no write-back: {_ratios(p_read, p_on)}."]
    if not args.only_fetch:
        write_results("velocity", data, "\n".join(lines))
    print("\n".join(lines))


def _ratios(base: dict, other: dict) -> str:
    """`other` over `base`: c1 p50 and c16 req/s, overall and the range of the rounds' own ratios."""
    per_round = list(zip(base["rounds"], other["rounds"]))
    c1 = [b["c1_p50_ms"] / a["c1_p50_ms"] for a, b in per_round]
    c16 = [b["c16_rate"] / a["c16_rate"] for a, b in per_round]
    return (f"c1 p50 {other['c1_p50_ms'] / base['c1_p50_ms']:.3f}x (rounds {min(c1):.3f}-{max(c1):.3f}), c16 req/s "
            f"{other['c16_rate'] / base['c16_rate']:.3f}x (rounds {min(c16):.3f}-{max(c16):.3f})")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
