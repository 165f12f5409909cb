"""Velocity counters under several writer processes (issue 28): exactness, a Redis restart, the
atomic write against an optimistic transaction, and the fraud path's fetch + write-back cost.

    .venv/bin/python benchmarks/bench_velocity.py [--events 10000] [--users 100] [--burst 50] [--replicas 4]

1. exact: `replicas` processes add `events` transactions over `users` users, in bursts of `burst`
   for one user spread over every replica at once (the card-testing shape), with event times over
   the last 2 hours (late and out-of-order ones included). Every user's four windows are then read
   and compared with a reference computed from the event log (the events each replica saw added).
   Modes: `lua` (scorestack.features.velocity: one atomic script per event), `optimistic`
   (WATCH/MULTI/EXEC with retry on conflict) and `rmw` (the old read-modify-write, for contrast).
2. outage: the `lua` run again with the Redis server killed (SIGKILL) a third of the way in and
   restarted a second later (append-only file, fsync always: what was acknowledged survives).
   Writes during the outage must be counted failed; none may be lost or counted twice.
3. fetch: the fraud service's store path in one process (the Triton call is left out: it is the
   same on both sides): fetch only (write-back off) against fetch with window reads + the atomic
   write-back submitted (on), c1 p50 and c16 req/s, side by side in alternating rounds.

Every Redis here is a redis-server of the benchmark's own on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Tally, closed_loop, machine, table, write_results

from scorestack.features.velocity import FRAUD_VELOCITY, RedisVelocity, VelocityWriter
from scorestack.serve.ports import free_port


class Server:
    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port, self.proc = workdir, port, None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port).ping()
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# --- the writers -----------------------------------------------------------------------------------


def _groups(args: list) -> list[tuple[int, str, int, list[tuple[str, float]]]]:
    """The add script's per-resolution groups: (bucket, time field, oldest bucket, [(field, delta)])."""
    out, a = [], 2
    while a < len(args):
        b, tf, oldest, n = args[a], args[a + 1], args[a + 2], args[a + 3]
        a += 4
        out.append((b, tf, oldest, [(args[a + 2 * i], float(args[a + 2 * i + 1])) for i in range(n)]))
        a += 2 * n
    return out


def _new_values(reader, key: str, groups) -> dict[str, str]:
    """What the add script would write, computed in the client from values read first."""
    mapping: dict[str, str] = {}
    for b, tf, oldest, fields in groups:
        if b < oldest:
            continue
        cur = reader.hget(key, tf)
        cur = int(float(cur)) if cur is not None else -1
        if cur > b:
            continue
        olds = reader.hmget(key, [f for f, _ in fields]) if cur == b else [None] * len(fields)
        if cur < b:
            mapping[tf] = str(b)
        for (f, delta), old in zip(fields, olds):
            mapping[f] = repr(float(old or 0) + delta)
    return mapping


def _optimistic_add(client, store: RedisVelocity, entity, event_id, event, t) -> tuple[str, int]:
    """WATCH the marker and the entity's hash, read, then MULTI/EXEC; retry on a conflict. (outcome, retries)"""
    import redis

    (marker, key), args = store.add_call(entity, event_id, event, t)
    groups = _groups(args)
    retries = 0
    while True:
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(marker, key)
                if pipe.exists(marker):
                    return "duplicate", retries
                mapping = _new_values(pipe, key, groups)
                pipe.multi()
                pipe.set(marker, 1, ex=args[0])
                if mapping:
                    pipe.hset(key, mapping=mapping)
                    pipe.expire(key, args[1])
                pipe.execute()
                return "added", retries
            except redis.WatchError:
                retries += 1


def _rmw_add(client, store: RedisVelocity, entity, event_id, event, t) -> tuple[str, int]:
    """The old shape: read the values, add, write them back (no transaction, no marker)."""
    (_, key), args = store.add_call(entity, event_id, event, t)
    mapping = _new_values(client, key, _groups(args))
    if mapping:
        client.hset(key, mapping=mapping)
    return "added", 0


def replica(port: int, mode: str, prefix: str, events: list, start_at: float, out, rate: float = 0.0) -> None:
    import redis

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    store = RedisVelocity(client, FRAUD_VELOCITY, prefix=prefix)
    writer = VelocityWriter(store)
    while time.time() < start_at:
        time.sleep(0.001)
    log, retries = [], 0
    t0 = time.perf_counter()
    for k, (event_id, user, t, amount) in enumerate(events):
        if rate:  # paced: this replica's share of the total rate
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        event = {"amount": amount}
        if mode == "lua":
            outcome = writer.add(user, event_id, event, t)
        else:
            try:
                outcome, r = (_optimistic_add if mode == "optimistic" else _rmw_add)(client, store, user, event_id, event, t)
                retries += r
            except Exception:
                outcome = "failed"
        log.append((event_id, user, t, amount, outcome))
    out.put((log, retries, time.perf_counter() - t0))


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


def exact_run(mode: str, args, workdir: Path, *, outage: bool = False) -> dict:
    import redis

    port = free_port()
    server = Server(workdir / f"{mode}{'-outage' if outage else ''}", port)
    server.workdir.mkdir(parents=True, exist_ok=True)
    server.start()
    now = time.time()
    events = make_events(args.events, args.users, args.burst, now)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0
    prefix = f"bench:{mode}:"
    procs = [ctx.Process(target=replica, args=(port, mode, prefix, events[k :: args.replicas], start_at, out,
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
    retries = sum(r[1] for r in results)
    write_s = max(r[2] for r in results)
    outcomes = {k: sum(1 for row in log if row[4] == k) for k in ("added", "duplicate", "expired", "failed")}
    store = RedisVelocity(redis.Redis(port=port), FRAUD_VELOCITY, prefix=prefix)
    lost = double = 0
    lost_amount = 0.0
    mismatched_users = 0
    read_now = now + 1
    for user in range(args.users):
        mine = [(t, {"amount": a}) for _, u, t, a, o in log if u == user and o == "added"]
        expected = FRAUD_VELOCITY.reference(read_now, mine)
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
        mismatched_users += bad
    server.stop()
    return {
        "mode": mode, "outage": outage, "events": len(log), "outcomes": outcomes, "retries": retries,
        "lost_counts": lost, "double_counts": double, "lost_amount": round(lost_amount, 2), "users_mismatched": mismatched_users,
        "write_s": write_s, "events_per_s": len(log) / write_s, "outage_s": outage_s,
    }


# --- the fraud path's store part -------------------------------------------------------------------


async def fetch_runs(workdir: Path, seconds: float, rounds: int) -> dict:
    from scorestack.demo import features as demo_features
    from scorestack.features import store as feature_store
    from scorestack.features.fetch import FeatureFetcher
    from scorestack.features.velocity import AsyncVelocityWriter

    server = Server(workdir / "fetch", free_port())
    server.workdir.mkdir(parents=True, exist_ok=True)
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    repo = demo_features.init_repo(workdir / "repo", online="redis", redis_url=url, n_users=1000, n_items=10, project="bench_velocity")
    feature_store.apply(repo)
    feature_store.materialize(repo)
    fs = feature_store.feature_store(repo)
    writer = AsyncVelocityWriter.for_store(fs, max_pending=100_000)
    off = FeatureFetcher(fs, timeout_s=0.5, freeze_heap=False)
    on = FeatureFetcher(fs, timeout_s=0.5, windows=True, freeze_heap=False)
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
    tallies: dict[str, dict[int, list[Tally]]] = {name: {1: [], 16: []} for name in sends}
    for r in range(rounds):
        for concurrency in (1, 16):
            names = list(sends) if r % 2 == 0 else list(reversed(sends))
            for name, send in ((n, sends[n]) for n in names):
                tallies[name][concurrency].append(await closed_loop(send, concurrency, duration_s=seconds, warmup_s=0.5))
    await writer.drain(30)
    counts = {k: writer.count(k) for k in ("added", "duplicate", "failed", "dropped")}
    await writer.close()
    await on.close()
    await off.close()
    server.stop()
    out = {"writes": counts, "backend_on": on.backend_of("fraud")}
    for name in sends:
        c1 = Tally.merge(tallies[name][1]).summary()
        c16 = Tally.merge(tallies[name][16]).summary()
        # Rounds are separate spans: the rate is answers over their summed time, not the longest one.
        rate16 = sum(t.ok for t in tallies[name][16]) / sum(t.wall_s for t in tallies[name][16])
        out[name] = {"c1_p50_ms": c1["p50_ms"], "c1_p99_ms": c1["p99_ms"], "c16_rate": rate16, "c16_p50_ms": c16["p50_ms"],
                     "c1_errors": c1["errors"], "c16_errors": c16["errors"]}
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
    parser.add_argument("--only-fetch", action="store_true", help="the fetch comparison only (results not written)")
    parser.add_argument("--outage-rate", type=float, default=2000.0, help="events/s of all replicas together in the restart run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_velocity_"))
    try:
        runs = [] if args.only_fetch else [exact_run(mode, args, workdir) for mode in ("lua", "optimistic", "rmw")]
        if not args.only_fetch:
            runs.append(exact_run("lua", args, workdir, outage=True))
        fetch = None if args.skip_fetch else asyncio.run(fetch_runs(workdir, args.fetch_seconds, args.rounds))
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
            ["write", "Redis restart", "added", "duplicate", "expired", "failed", "lost counts", "double counts", "users wrong", "conflict retries", "events/s (4 procs)"],
            [[r["mode"], f"yes ({r['outage_s']:.1f} s down)" if r["outage"] else "no", r["outcomes"]["added"], r["outcomes"]["duplicate"],
              r["outcomes"]["expired"], r["outcomes"]["failed"], r["lost_counts"], r["double_counts"], r["users_mismatched"], r["retries"], f"{r['events_per_s']:.0f}"] for r in runs],
        ),
        "",
        "`lua` is scorestack.features.velocity (one atomic script per event, an idempotency marker per event id); "
        "`optimistic` is WATCH/MULTI/EXEC with retry on conflict; `rmw` is the old read-modify-write, for contrast.",
    ]
    if fetch:
        off, on = fetch["off"], fetch["on"]
        lines += [
            "",
            "## The fraud path's store part, write-back off against on",
            "",
            "One process, its own redis-server, 1,000 users; off: fetch only; on: fetch with the windows read in the same pipeline "
            "+ the atomic write-back submitted (a worker thread). The Triton call is left out (the same on both sides). "
            f"Alternating rounds of {args.fetch_seconds:.0f} s, {args.rounds} each. Backend: {fetch['backend_on']}.",
            "",
            *table(["", "c1 p50 ms", "c1 p99 ms", "c16 req/s", "c16 p50 ms"],
                   [[k, f"{v['c1_p50_ms']:.3f}", f"{v['c1_p99_ms']:.3f}", f"{v['c16_rate']:.0f}", f"{v['c16_p50_ms']:.3f}"]
                    for k, v in fetch.items() if isinstance(v, dict) and "c1_p50_ms" in v]),
            "",
            f"on / off: c1 p50 {on['c1_p50_ms'] / off['c1_p50_ms']:.3f}x, c16 req/s {on['c16_rate'] / off['c16_rate']:.3f}x. "
            f"Write-back outcomes: {fetch['writes']}.",
        ]
    if not args.only_fetch:
        write_results("velocity", data, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
