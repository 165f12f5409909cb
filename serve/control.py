"""Hot-swap: ask a running Triton (local or production) to load a model's new version, and wait until it serves it."""

from __future__ import annotations

import time

from scorestack.errors import ServerError


def load_version(url: str, name: str, version: int, timeout_s: float = 120.0) -> float:
    """Load `name` through Triton's repository API at gRPC `url` and wait until `version` is ready.

    Works for a production Triton in explicit model-control mode reading the same repository, and for
    `scorestack serve` (which also picks new versions up itself). Triton keeps the old version serving
    until the new one is loaded; requests in flight finish where they started. Returns the seconds it
    took; raises ServerError with Triton's reason when the new version does not become ready in time.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    start = time.monotonic()
    client = grpcclient.InferenceServerClient(url)
    try:
        try:
            client.load_model(name, client_timeout=timeout_s)
        except InferenceServerException as exc:
            load_error = exc.message() or str(exc)
        else:
            load_error = ""
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            try:
                if client.is_model_ready(name, str(version), client_timeout=5):
                    return time.monotonic() - start
            except InferenceServerException:
                pass
            time.sleep(0.2)
        reason = load_error
        try:
            index = client.get_model_repository_index(as_json=True, client_timeout=5).get("models", [])
            reason = "; ".join(f"version {m.get('version')}: {m.get('state')} {m.get('reason', '')}".strip() for m in index if m.get("name") == name) or reason
        except InferenceServerException:
            pass
        raise ServerError(f"model {name}: version {version} did not become ready on {url} within {timeout_s:.0f} s: {reason or 'no reason given'}")
    finally:
        client.close()
