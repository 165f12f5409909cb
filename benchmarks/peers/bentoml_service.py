"""The fraud model as a BentoML service, written the way its docs show: one `@bentoml.service` class
that loads the model once, an `async def` API running onnxruntime (1 thread) on the event loop, the
scorestack-compiled ONNX artifact (SCORESTACK_BENTO_MODEL), access log and metrics middleware off. Started by peers/servers.start_bentoml
with `bentoml serve` in BentoML's own virtual environment (peers/envs.py)."""

from __future__ import annotations

import os

import bentoml
import numpy as np
import onnxruntime as ort
from pydantic import BaseModel


class Score(BaseModel):
    probability: float


# The strongest honest configuration: no access log and no Prometheus middleware on the request path (both on
# by default), uvicorn on uvloop + httptools (installed beside BentoML: peers/envs.py).
@bentoml.service(workers=1, traffic={"timeout": 10}, logging={"access": {"enabled": False}}, metrics={"enabled": False})
class Fraud:
    def __init__(self) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
        self.sess = ort.InferenceSession(os.environ["SCORESTACK_BENTO_MODEL"], sess_options=opts, providers=["CPUExecutionProvider"])
        self.input = self.sess.get_inputs()[0].name
        outputs = [o.name for o in self.sess.get_outputs()]
        self.output = next((o for o in outputs if "prob" in o.lower()), outputs[-1])

    @bentoml.api
    async def predict(self, features: list[float]) -> Score:
        x = np.asarray([features], dtype=np.float32)
        return Score(probability=float(np.asarray(self.sess.run([self.output], {self.input: x})[0]).reshape(-1)[-1]))
