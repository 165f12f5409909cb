"""Feature reads against the real Redis, side by side in one process: the direct reader against Feast.

    python benchmarks/bench_features.py [--redis-url redis://127.0.0.1:6379/12] [--rounds 5]

Builds the demo feature repository (5,000 users, 2,000 items) on the Redis online store in a
temporary directory (a db and project of its own), then times, interleaved round by round:
  - one user + 100 and + 500 items (the ranking request):
      * the direct reader (one pipelined HMGET per entity, Feast's hashes decoded in place),
      * the fetch layer end to end on it (validation, float32 matrix in model order, statuses),
      * Feast's `get_online_features` (the way a user writes it: the `ranking` feature service,
        one entity row per item) and `get_online_features_async`;
  - 50 concurrent single-user fraud fetches through the fetch layer, coalesced (same event-loop
    turn, or a 200 us window) or not, on the direct reader and on Feast's async reads (cache off);
    and the same one fetch at a time, to show what a window costs when there is nothing to share.
Writes benchmarks/results/features.json and features.md (with the machine's load average, which
other agents share) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import redis

from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher

RESULTS = Path(__file__).resolve().parent / "results"
PROJECT = "bench_features"
N_USERS, N_ITEMS = 5000, 2000


# Appended to the benchmark's copy of the demo definitions: a ranking service with an on-demand
# view fed by request data, once per transformation mode, written as Feast's templates write them.
ODFV_DEFINITIONS = """

import pandas as pd
from feast import RequestSource
from feast.on_demand_feature_view import on_demand_feature_view
from feast.types import Float64

ranking_request = RequestSource(name="ranking_request", schema=[Field(name="ctx_budget", dtype=Float64)])


@on_demand_feature_view(
    sources=[user_ranking_profile, item_stats, ranking_request],
    schema=[Field(name="price_gap", dtype=Float64), Field(name="over_budget", dtype=Float64)],
    mode="pandas",
)
def ranking_price_pandas(inputs: pd.DataFrame) -> pd.DataFrame:
    df = pd.DataFrame()
    df["price_gap"] = inputs["item_price_level"] - inputs["user_pref_price_level"]
    df["over_budget"] = (inputs["item_price"] > inputs["ctx_budget"]).astype("float64")
    return df


@on_demand_feature_view(
    sources=[user_ranking_profile, item_stats, ranking_request],
    schema=[Field(name="price_gap", dtype=Float64), Field(name="over_budget", dtype=Float64)],
    mode="python",
)
def ranking_price_python(inputs: dict) -> dict:
    return {
        "price_gap": [i - u for i, u in zip(inputs["item_price_level"], inputs["user_pref_price_level"])],
        "over_budget": [float(p > b) for p, b in zip(inputs["item_price"], inputs["ctx_budget"])],
    }


ranking_odfv_pandas = FeatureService(name="ranking_odfv_pandas", features=[user_ranking_profile, item_stats, ranking_price_pandas])
ranking_odfv_python = FeatureService(name="ranking_odfv_python", features=[user_ranking_profile, item_stats, ranking_price_python])
"""


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = np.array(samples_s) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "n": int(ms.size),
    }


async def _time_async(fn, iterations: int) -> list[float]:
    out = []
    for _ in range(iterations):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


async def bench_ranking(repo: Path, rounds: int, iterations: int, rng: np.random.Generator) -> dict:
    fs_sync = store.feature_store(repo)
    fs_async = store.feature_store(repo)
    service = fs_sync.get_feature_service("ranking")
    service_async = fs_async.get_feature_service("ranking")
    fetcher = FeatureFetcher(fs_sync, backend="direct", cache=False, coalesce_window_s=None, timeout_s=1.0)
    await fetcher.start()
    await fs_async.initialize()
    direct = fetcher._lanes["direct"].backend  # the reader itself, under the fetch layer
    results: dict = {}
    try:
        for n_items in (100, 500):
            samples: dict[str, list[float]] = {k: [] for k in ("direct_reader", "fetch_layer_direct", "feast_sync", "feast_async")}
            checked = False
            for _ in range(rounds):
                for _ in range(iterations):
                    user = int(rng.integers(1, N_USERS + 1))
                    items = [int(i) for i in rng.choice(np.arange(1, N_ITEMS + 1), n_items, replace=False)]
                    rows = [{"user_id": user, "item_id": i} for i in items]
                    wanted = {"user_ranking_profile": [user], "item_stats": items}

                    t = time.perf_counter()
                    await direct.read(wanted)
                    samples["direct_reader"].append(time.perf_counter() - t)

                    t = time.perf_counter()
                    result = await fetcher.fetch("ranking", {"user_id": user, "item_id": items})
                    samples["fetch_layer_direct"].append(time.perf_counter() - t)

                    t = time.perf_counter()
                    reference = fs_sync.get_online_features(features=service, entity_rows=rows)
                    samples["feast_sync"].append(time.perf_counter() - t)

                    t = time.perf_counter()
                    await fs_async.get_online_features_async(features=service_async, entity_rows=rows)
                    samples["feast_async"].append(time.perf_counter() - t)

                    if not checked:  # same numbers, or the timing means nothing
                        ref = reference.to_dict()
                        expected = np.array([[ref[n][r] for n in result.feature_names] for r in range(n_items)], dtype=np.float32)
                        np.testing.assert_array_equal(result.values, expected)
                        checked = True
            summary = {k: _summary(v) for k, v in samples.items()}
            base = summary["direct_reader"]["p50_ms"]
            summary["speedup_p50_vs_direct_reader"] = {k: summary[k]["p50_ms"] / base for k in samples}
            results[f"1_user_{n_items}_items"] = summary
    finally:
        await fetcher.close()
        await fs_async.close()
        client = getattr(fs_async._get_provider().online_store, "_client_async", None)
        if client is not None:
            await client.aclose()
    return results


async def bench_on_demand(repo: Path, rounds: int, iterations: int, rng: np.random.Generator, n_items: int = 100) -> dict:
    """One user + `n_items` items with an on-demand view in the service, side by side, interleaved."""
    fs_sync = store.feature_store(repo)
    fs_async = store.feature_store(repo)
    services = ("ranking_odfv_pandas", "ranking_odfv_python")
    fetcher = FeatureFetcher(fs_sync, backend="direct", cache=False, coalesce_window_s=None, timeout_s=1.0, services=services)
    await fetcher.start()
    await fs_async.initialize()
    results: dict = {}
    try:
        for service_name in services:
            service = fs_sync.get_feature_service(service_name)
            service_async = fs_async.get_feature_service(service_name)
            samples: dict[str, list[float]] = {k: [] for k in ("fetch_layer_direct", "feast_sync", "feast_async")}
            checked = False
            for _ in range(rounds):
                for _ in range(iterations):
                    user = int(rng.integers(1, N_USERS + 1))
                    items = [int(i) for i in rng.choice(np.arange(1, N_ITEMS + 1), n_items, replace=False)]
                    budget = float(rng.uniform(10, 80))
                    rows = [{"user_id": user, "item_id": i, "ctx_budget": budget} for i in items]

                    t = time.perf_counter()
                    result = await fetcher.fetch(service_name, {"user_id": user, "item_id": items, "ctx_budget": budget})
                    samples["fetch_layer_direct"].append(time.perf_counter() - t)

                    t = time.perf_counter()
                    reference = fs_sync.get_online_features(features=service, entity_rows=rows)
                    samples["feast_sync"].append(time.perf_counter() - t)

                    t = time.perf_counter()
                    await fs_async.get_online_features_async(features=service_async, entity_rows=rows)
                    samples["feast_async"].append(time.perf_counter() - t)

                    if not checked:  # same numbers, on-demand outputs included, or the timing means nothing
                        ref = reference.to_dict()
                        expected = np.array([[ref[n][r] for n in result.feature_names] for r in range(n_items)], dtype=np.float32)
                        np.testing.assert_allclose(result.values, expected, rtol=1e-6)
                        assert {"price_gap", "over_budget"} <= set(result.feature_names) and not result.degraded
                        checked = True
            summary = {k: _summary(v) for k, v in samples.items()}
            base = summary["fetch_layer_direct"]["p50_ms"]
            summary["p50_over_fetch_layer_direct"] = {k: summary[k]["p50_ms"] / base for k in samples}
            results[service_name] = summary
    finally:
        await fetcher.close()
        await fs_async.close()
        client = getattr(fs_async._get_provider().online_store, "_client_async", None)
        if client is not None:
            await client.aclose()
    return results


async def bench_concurrency(repo: Path, rounds: int, bursts: int, rng: np.random.Generator, concurrency: int = 50) -> dict:
    results: dict = {}
    configs = {
        f"{backend}_{mode}": dict(backend=backend, coalesce_window_s=window)
        for backend in ("direct", "feast_async")
        for mode, window in (("same-turn", 0.0), ("window-200us", 0.0002), ("separate", None))
    }
    fetchers = {}
    for name, options in configs.items():
        fetchers[name] = await FeatureFetcher(store.feature_store(repo), cache=False, timeout_s=1.0, **options).start()
    burst_s: dict[str, list[float]] = {k: [] for k in configs}
    request_s: dict[str, list[float]] = {k: [] for k in configs}
    trips: dict[str, int] = {k: 0 for k in configs}
    degraded: dict[str, int] = {k: 0 for k in configs}

    async def one(fetcher, user):
        t = time.perf_counter()
        result = await fetcher.fetch("fraud", {"user_id": user})
        return time.perf_counter() - t, result.degraded

    try:
        for _ in range(rounds):
            for name, fetcher in fetchers.items():
                backend = configs[name]["backend"]
                before = fetcher.round_trips(backend)
                for _ in range(bursts):
                    users = [int(u) for u in rng.integers(1, N_USERS + 1, concurrency)]
                    t = time.perf_counter()
                    out = await asyncio.gather(*(one(fetcher, u) for u in users))
                    burst_s[name].append(time.perf_counter() - t)
                    request_s[name] += [o[0] for o in out]
                    degraded[name] += sum(o[1] for o in out)
                trips[name] += fetcher.round_trips(backend) - before
    finally:
        for fetcher in fetchers.values():
            await fetcher.close()
    n_bursts = rounds * bursts
    for name in configs:
        results[name] = {
            "burst": _summary(burst_s[name]),
            "request": _summary(request_s[name]),
            "requests_per_s": concurrency * n_bursts / sum(burst_s[name]),
            "store_round_trips_per_burst": trips[name] / n_bursts,
            "degraded_requests": degraded[name],
        }
    return results


def _markdown(report: dict) -> str:
    lines = [
        "# Feature reads: direct Redis reader vs Feast SDK",
        "",
        f"{report['date']} · {report['machine']} · Redis {report['redis_version']} on 127.0.0.1 · "
        f"Feast {report['feast_version']} · {N_USERS} users, {N_ITEMS} items · {report['rounds']} interleaved rounds",
        "",
        f"Load average (1/5/15 min) before: {' / '.join(f'{x:.2f}' for x in report['loadavg_before'])}, "
        f"after: {' / '.join(f'{x:.2f}' for x in report['loadavg_after'])} (2 cores shared with other agents).",
        "",
        "## One user + N items (ranking request), latency in ms",
        "",
        "| path | N | p50 | p90 | p99 | p50 / direct reader |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "direct_reader": "direct reader (pipelined HMGET, in-place decode)",
        "fetch_layer_direct": "fetch layer on the direct reader (matrix + statuses)",
        "feast_sync": "Feast `get_online_features`",
        "feast_async": "Feast `get_online_features_async`",
    }
    for key, summary in report["ranking"].items():
        n = key.split("_")[2]
        for path, label in labels.items():
            s = summary[path]
            ratio = summary["speedup_p50_vs_direct_reader"][path]
            lines.append(f"| {label} | {n} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | {s['p99_ms']:.2f} | {ratio:.1f}x |")
    lines += [
        "",
        "## One user + 100 items, with an on-demand feature view in the service (request data in the rows), latency in ms",
        "",
        "| service (transformation mode) | path | p50 | p90 | p99 | p50 / fetch layer |",
        "|---|---|---|---|---|---|",
    ]
    odfv_labels = {
        "fetch_layer_direct": "fetch layer on the direct reader (computes the view with Feast's transformation)",
        "feast_sync": "Feast `get_online_features`",
        "feast_async": "Feast `get_online_features_async`",
    }
    for service, summary in report["on_demand"].items():
        for path, label in odfv_labels.items():
            s = summary[path]
            lines.append(
                f"| {service} | {label} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | {s['p99_ms']:.2f} | "
                f"{summary['p50_over_fetch_layer_direct'][path]:.1f}x |"
            )
    lines += [
        "",
        "## 50 concurrent single-user fraud fetches (cache off)",
        "",
        "| backend | coalescing | burst p50 ms | request p50 ms | request p99 ms | requests/s | store round trips per burst |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["concurrency"].items():
        backend, mode = name.rsplit("_", 1)
        lines.append(
            f"| {backend} | {mode} | {r['burst']['p50_ms']:.2f} | {r['request']['p50_ms']:.2f} | {r['request']['p99_ms']:.2f} | "
            f"{r['requests_per_s']:.0f} | {r['store_round_trips_per_burst']:.1f} |"
        )
    lines += [
        "",
        "## One single-user fraud fetch at a time (cache off): the cost of a coalescing window",
        "",
        "| backend | coalescing | request p50 ms | request p99 ms | requests/s |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["sequential"].items():
        backend, mode = name.rsplit("_", 1)
        lines.append(f"| {backend} | {mode} | {r['request']['p50_ms']:.2f} | {r['request']['p99_ms']:.2f} | {r['requests_per_s']:.0f} |")
    lines += [
        "",
        "Every path read the same numbers (checked against Feast's answer before timing). `same-turn` "
        "coalesces the fetches issued in one event-loop turn (the default); `window-200us` waits 200 us "
        "for more, which asyncio's millisecond timer granularity turns into about 1 ms; `separate` "
        "issues one store read per fetch. Shared 2-core machine: ratios hold better than absolute times.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=40, help="ranking requests per path per round")
    parser.add_argument("--bursts", type=int, default=20, help="bursts of 50 per configuration per round")
    args = parser.parse_args()

    import feast

    client = redis.Redis.from_url(args.redis_url, socket_timeout=5)
    keys = list(client.scan_iter(match=b"*" + PROJECT.encode(), count=5000))
    if keys:
        client.delete(*keys)
    redis_version = client.info("server")["redis_version"]
    rng = np.random.default_rng(0)
    loadavg_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        repo = demo_features.init_repo(Path(tmp) / "repo", online="redis", redis_url=args.redis_url, n_users=N_USERS, n_items=N_ITEMS, project=PROJECT)
        with open(repo / "definitions.py", "a") as definitions:
            definitions.write(ODFV_DEFINITIONS)
        store.apply(repo)
        t = time.perf_counter()
        store.materialize(repo)
        materialize_s = time.perf_counter() - t
        ranking = asyncio.run(bench_ranking(repo, args.rounds, args.iterations, rng))
        on_demand = asyncio.run(bench_on_demand(repo, args.rounds, args.iterations, rng))
        concurrency = asyncio.run(bench_concurrency(repo, args.rounds, args.bursts, rng))
        # One fetch at a time: what a coalescing window costs when there is nothing to coalesce.
        sequential = asyncio.run(bench_concurrency(repo, args.rounds, args.bursts * 5, rng, concurrency=1))
    keys = list(client.scan_iter(match=b"*" + PROJECT.encode(), count=5000))
    if keys:
        client.delete(*keys)

    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "redis_version": redis_version,
        "feast_version": feast.__version__,
        "rounds": args.rounds,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "materialize_s": materialize_s,
        "ranking": ranking,
        "on_demand": on_demand,
        "concurrency": concurrency,
        "sequential": sequential,
        "ratio_feast_sync_over_direct_reader_1_100_p50": ranking["1_user_100_items"]["speedup_p50_vs_direct_reader"]["feast_sync"],
        "ratio_feast_sync_over_fetch_layer_1_100_on_demand_p50": {
            service: summary["p50_over_fetch_layer_direct"]["feast_sync"] for service, summary in on_demand.items()
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "features.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = _markdown(report)
    (RESULTS / "features.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
