"""The service a user would write by hand: FastAPI + uvicorn (1 worker), one JSON request per score.

    python benchmarks/peers/fastapi_app.py --runtime xgboost --model fraud_xgb.json --port 8000
    python benchmarks/peers/fastapi_app.py --runtime onnxruntime --model model.onnx --port 8001

POST /predict {"features": [30 floats]} -> {"probability": p}. XGBoost runs `predict_proba` on
each request; onnxruntime runs an InferenceSession. Both with `--threads` threads per call (default
1, as scorestack's compiled model: the libraries' multi-threaded defaults burn CPU on one row and
leave less for the server on a 2-core machine).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel


class ScoreRequest(BaseModel):
    features: list[float]


class ScoreResponse(BaseModel):
    probability: float


def build_app(runtime: str, model: Path, n_features: int, threads: int = 1) -> FastAPI:
    if runtime == "xgboost":
        import xgboost as xgb

        clf = xgb.XGBClassifier()
        clf.load_model(str(model))
        clf.set_params(n_jobs=threads)

        def score(x: np.ndarray) -> float:
            return float(clf.predict_proba(x)[0, 1])
    elif runtime == "onnxruntime":
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
    else:
        raise ValueError(f"--runtime must be xgboost or onnxruntime, got {runtime!r}")

    app = FastAPI(title=f"fraud scorer ({runtime})")

    @app.post("/predict", response_model=ScoreResponse)
    def predict(req: ScoreRequest) -> ScoreResponse:
        if len(req.features) != n_features:
            from fastapi import HTTPException

            raise HTTPException(422, f"features: expected {n_features} values, got {len(req.features)}")
        return ScoreResponse(probability=score(np.asarray([req.features], dtype=np.float32)))

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", required=True, choices=["xgboost", "onnxruntime"])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="threads per model call (XGBoost n_jobs, onnxruntime intra_op_num_threads)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    import uvicorn

    # Access logging off: a log line per request would measure the terminal, not the service.
    uvicorn.run(build_app(args.runtime, args.model, args.features, args.threads), host=args.host, port=args.port, workers=1,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
