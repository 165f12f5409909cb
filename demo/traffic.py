"""Demo traffic: fraud and ranking requests for the demo's users and items through the real request
paths (features from Feast, scores from Triton over gRPC), broken down by phase; digit images
through the vision path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from scorestack.client.breakdown import Breakdown, measure
from scorestack.client.triton import TritonClient
from scorestack.demo import data as demo_data
from scorestack.serve.security import AdminKey, ClientTls, load_admin_key

# What `scorestack demo diagnose` sends by default (the compose `demo` service).
DEFAULTS = {"fraud_requests": 200, "ranking_requests": 50, "candidates": 200, "users": 5000, "items": 2000}


async def run_diagnosis(
    grpc_url: str,
    feature_repo: Path,
    n_fraud: int = 300,
    n_ranking: int = 100,
    n_candidates: int = 200,
    *,
    fraud_model: str = "fraud_xgb",
    ranking_model: str = "ranking_xgb",
    n_users: int = 5000,
    n_items: int = 2000,
    tls: ClientTls | None = None,
    admin_key: AdminKey | None = None,
    registry: Any = None,
    velocity: bool = False,
) -> list[Breakdown]:
    """Send demo fraud and ranking traffic through the real services and break down where time went.

    Reading Triton's statistics needs the admin key on a restricted server: `admin_key`, else
    $SCORESTACK_ADMIN_KEY / $SCORESTACK_ADMIN_KEY_FILE. TLS: `tls`, else $SCORESTACK_TLS_DIR.
    With a prometheus `registry`, the requests' phases (client/metrics.py) and the fetch layer's
    metrics are recorded in it, for whoever serves it. With `velocity`, the fraud service reads the
    windowed velocity counters and adds each scored transaction to them (features/velocity.py), under a
    transaction id unique to this process, so several replicas sending at once count every one once.
    """
    import os
    import socket
    import uuid

    from scorestack.features.velocity import AsyncVelocityWriter
    from scorestack.client.fraud import FraudService
    from scorestack.client.metrics import RequestMetrics
    from scorestack.client.ranking import RankingService
    from scorestack.features.fetch import FeatureFetcher

    rng = np.random.default_rng(5)
    fraud_fields = demo_data.make_fraud_requests(n_fraud + 20, seed=99)
    context = demo_data.make_ranking_context(n_ranking + 20, seed=98)
    key = load_admin_key(admin_key)
    tls = tls or ClientTls.from_env()
    async with TritonClient(grpc_url, deadline_s=2.0, tls=tls, admin_key=key) as triton:
        options = {"registry": registry} if registry is not None else {}
        async with FeatureFetcher.from_repo(feature_repo, timeout_s=0.05, windows=velocity, **options) as fetcher:
            writer = AsyncVelocityWriter.for_store(fetcher.store, **options) if velocity else None
            fraud = FraudService(triton, fetcher, model=fraud_model, velocity=writer)
            sender = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            ranking = RankingService(triton, fetcher, model=ranking_model)
            fraud_metrics = RequestMetrics(registry, service="fraud", model=fraud_model) if registry is not None else None
            ranking_metrics = RequestMetrics(registry, service="ranking", model=ranking_model) if registry is not None else None

            def fraud_request(i: int) -> dict:
                row = {k: float(v) for k, v in fraud_fields.iloc[i].items()}
                return {"user_id": int(rng.integers(1, n_users + 1)), **row, **({"transaction_id": f"{sender}-{i}"} if velocity else {})}

            async def send_fraud(i: int):
                result = await fraud.score(fraud_request(i))
                if fraud_metrics is not None:
                    fraud_metrics.observe(result.timings_ms)
                return result

            async def send_ranking(i: int):
                items = rng.choice(np.arange(1, n_items + 1), n_candidates, replace=False).tolist()
                ctx = {k: float(v) for k, v in context.iloc[i].items()}
                result = await ranking.rank(int(rng.integers(1, n_users + 1)), items, ctx)
                if ranking_metrics is not None:
                    ranking_metrics.observe(result.timings_ms)
                return result

            b1 = await measure(triton, "fraud", fraud_model, send_fraud, n_fraud)
            b2 = await measure(triton, "ranking", ranking_model, send_ranking, n_ranking) if n_ranking else None
            if writer is not None:
                await writer.drain(10)
                await writer.close()
    return [b for b in (b1, b2) if b is not None]


async def vision_traffic(grpc_url: str, models_dir: Path, n: int, model: str = "digits_cnn") -> str:
    """Classify held-out digit images, one raw uint8 image per request, through the vision request path."""
    from scorestack.client.vision import VisionService

    data = np.load(models_dir / "digits_holdout.npz")
    X, y = data["X"], data["y"]
    correct, totals, infers = 0, [], []
    async with TritonClient(grpc_url, deadline_s=2.0) as triton:
        service = VisionService(triton, model=model)
        for i in range(n):
            result = await service.classify(X[i % len(X)])
            correct += int(result.classes[0] == y[i % len(X)])
            totals.append(result.timings_ms["total"])
            infers.append(result.timings_ms["infer"])
    return (
        f"[bold]vision[/bold] {model}: {n} images as raw uint8 [32, 32, 1] over gRPC, {100 * correct / n:.1f}% correct; "
        f"p50 total {np.median(totals):.2f} ms (infer {np.median(infers):.2f} ms), p99 {np.percentile(totals, 99):.2f} ms"
    )
