"""The service a user would write by hand: FastAPI + uvicorn, POST /predict {"features": [30 floats]} -> {"probability": p}.

    python benchmarks/peers/fastapi_app.py --runtime onnxruntime --model model.onnx --port 8001 [--endpoint sync] [--workers 2]

`--endpoint async` (default, the strongest honest configuration): `async def`, `json.loads`, the model
called on the event loop, a plain dict returned, uvicorn on uvloop + httptools. `--endpoint sync`: a
`def` endpoint with pydantic models, run in Starlette's threadpool. `--threads` per model call (default
1, as scorestack's compiled model), `--workers` uvicorn processes. docs/benchmarks.md ("The peers").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

ENV = "SCORESTACK_PEER_FASTAPI"  # the app's settings, for uvicorn's worker processes (--workers > 1)


class ScoreRequest(BaseModel):
    features: list[float]


class ScoreResponse(BaseModel):
    probability: float


def load_scorer(runtime: str, model: Path, threads: int) -> Callable[[np.ndarray], float]:
    """The model call: one row of float32 features -> the positive class's probability."""
    if runtime == "xgboost":
        import xgboost as xgb

        booster = xgb.Booster(model_file=str(model))
        booster.set_param({"nthread": threads})

        def score(x: np.ndarray) -> float:
            # inplace_predict skips the DMatrix; binary:logistic returns the probability.
            return float(booster.inplace_predict(x)[0])

        return score
    if runtime == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        out = [o.name for o in sess.get_outputs()]
        # The probability output: the one named like it, else the last one.
        pick = next((o for o in out if "prob" in o.lower()), out[-1])

        def score(x: np.ndarray) -> float:
            y = np.asarray(sess.run([pick], {name: x})[0])
            return float(y.reshape(-1)[-1])

        return score
    raise ValueError(f"--runtime must be xgboost or onnxruntime, got {runtime!r}")


def build_app(runtime: str, model: Path, n_features: int, threads: int = 1, endpoint: str = "async") -> FastAPI:
    score = load_scorer(runtime, model, threads)
    app = FastAPI(title=f"fraud scorer ({runtime}, {endpoint} endpoint)")
    bad = f"features: expected a list of {n_features} numbers"

    if endpoint == "async":

        @app.post("/predict")
        async def predict(request: Request) -> dict:
            try:
                features = json.loads(await request.body())["features"]
                x = np.asarray([features], dtype=np.float32)
            except (ValueError, KeyError, TypeError):
                return JSONResponse({"detail": bad}, status_code=422)
            if x.shape != (1, n_features):
                return JSONResponse({"detail": f"{bad}, got shape {list(x.shape)}"}, status_code=422)
            return {"probability": score(x)}

    elif endpoint == "sync":

        @app.post("/predict", response_model=ScoreResponse)
        def predict_sync(req: ScoreRequest) -> ScoreResponse:
            if len(req.features) != n_features:
                raise HTTPException(422, f"{bad}, got {len(req.features)}")
            return ScoreResponse(probability=score(np.asarray([req.features], dtype=np.float32)))

    else:
        raise ValueError(f"--endpoint must be async or sync, got {endpoint!r}")

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    return app


def app_from_env() -> FastAPI:
    """uvicorn's factory for worker processes: the settings main() put in the environment."""
    s = json.loads(os.environ[ENV])
    return build_app(s["runtime"], Path(s["model"]), s["features"], s["threads"], s["endpoint"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", required=True, choices=["xgboost", "onnxruntime"])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="threads per model call (XGBoost nthread, onnxruntime intra_op_num_threads)")
    ap.add_argument("--endpoint", choices=["async", "sync"], default="async")
    ap.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    import uvicorn

    os.environ[ENV] = json.dumps({"runtime": args.runtime, "model": str(args.model.resolve()), "features": args.features,
                                  "threads": args.threads, "endpoint": args.endpoint})
    # Access logging off: a log line per request would measure the terminal, not the service.
    uvicorn.run("fastapi_app:app_from_env", factory=True, app_dir=str(Path(__file__).resolve().parent), host=args.host,
                port=args.port, workers=args.workers, loop="uvloop", http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
