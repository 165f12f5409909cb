"""gRPC inference for the fraud and ranking services, with a per-phase latency breakdown."""

from scorestack.client.triton import InferResult, ModelInfo, TritonClient

__all__ = ["InferResult", "ModelInfo", "TritonClient"]
