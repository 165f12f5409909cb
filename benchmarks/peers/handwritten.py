"""The fraud and ranking services a user would write without scorestack: one Python process, Feast's
SDK on the same online store, the model in-process with onnxruntime (1 thread).

    svc = HandWrittenFraud(feature_repo, "model.onnx")
    p = svc.score(transaction)                 # feast.FeatureStore.get_online_features
    p = await svc.score_async(transaction)     # get_online_features_async, where the store offers it

The feature vector is built in the model's order (scorestack.schema.FRAUD_FEATURES: the user's profile
and velocity views from Feast, then the request's fields), exactly what scorestack's FraudService
sends; a feature Feast returns as None (unknown user) is 0.0, the declared default of the demo views.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from scorestack import schema


def _session(model: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])


def _output(sess, prefer: str) -> str:
    names = [o.name for o in sess.get_outputs()]
    return next((n for n in names if prefer in n.lower()), names[-1])


class HandWrittenFraud:
    """Feast `get_online_features` (or its async twin) for the user, the request's fields, onnxruntime."""

    def __init__(self, feature_repo: str | Path, onnx_model: str | Path) -> None:
        import feast

        self.store = feast.FeatureStore(repo_path=str(feature_repo))
        self.refs = [f"user_fraud_profile:{f}" for f in schema.FRAUD_USER_PROFILE] + [f"user_txn_velocity:{f}" for f in schema.FRAUD_USER_VELOCITY]
        self.store_features = (*schema.FRAUD_USER_PROFILE, *schema.FRAUD_USER_VELOCITY)
        self.sess = _session(Path(onnx_model))
        self.input = self.sess.get_inputs()[0].name
        self.output = _output(self.sess, "prob")
        self._async_ready = False

    def _vector(self, online: Mapping[str, list], transaction: Mapping[str, Any]) -> np.ndarray:
        values = [online[f][0] for f in self.store_features]
        row = [0.0 if v is None else float(v) for v in values] + [float(transaction[f]) for f in schema.FRAUD_REQUEST]
        return np.asarray([row], dtype=np.float32)

    def _predict(self, x: np.ndarray) -> float:
        return float(np.asarray(self.sess.run([self.output], {self.input: x})[0]).reshape(-1)[-1])

    def features(self, transaction: Mapping[str, Any]) -> np.ndarray:
        online = self.store.get_online_features(features=self.refs, entity_rows=[{"user_id": transaction["user_id"]}]).to_dict()
        return self._vector(online, transaction)

    def score(self, transaction: Mapping[str, Any]) -> float:
        return self._predict(self.features(transaction))

    async def score_async(self, transaction: Mapping[str, Any]) -> float:
        if not self._async_ready:
            await self.store.initialize()
            self._async_ready = True
        resp = await self.store.get_online_features_async(features=self.refs, entity_rows=[{"user_id": transaction["user_id"]}])
        return self._predict(self._vector(resp.to_dict(), transaction))

    async def close(self) -> None:
        if self._async_ready:
            await self.store.close()
            self._async_ready = False


class HandWrittenRanking:
    """One user and N items: Feast `get_online_features` for the user's view and the items' view in
    two calls (the user's row, the items' rows), the rows assembled in the model's order, one
    onnxruntime call on all N rows."""

    def __init__(self, feature_repo: str | Path, onnx_model: str | Path) -> None:
        import feast

        self.store = feast.FeatureStore(repo_path=str(feature_repo))
        self.user_refs = [f"user_ranking_profile:{f}" for f in schema.RANKING_USER]
        self.item_refs = [f"item_stats:{f}" for f in schema.RANKING_ITEM]
        self.sess = _session(Path(onnx_model))
        self.input = self.sess.get_inputs()[0].name
        self.output = self.sess.get_outputs()[0].name

    def scores(self, user_id: int, item_ids: Sequence[int], context: Mapping[str, Any]) -> np.ndarray:
        """One score per item, in `item_ids`' order; `context` holds the request's fields (every item shares them)."""
        user = self.store.get_online_features(features=self.user_refs, entity_rows=[{"user_id": user_id}]).to_dict()
        items = self.store.get_online_features(features=self.item_refs, entity_rows=[{"item_id": i} for i in item_ids]).to_dict()
        n = len(item_ids)
        cols = [np.full(n, 0.0 if user[f][0] is None else float(user[f][0])) for f in schema.RANKING_USER]
        cols += [np.asarray([0.0 if v is None else float(v) for v in items[f]]) for f in schema.RANKING_ITEM]
        cols += [np.full(n, float(context[f])) for f in schema.RANKING_REQUEST]
        x = np.stack(cols, axis=1).astype(np.float32)
        return np.asarray(self.sess.run([self.output], {self.input: x})[0]).reshape(-1)
