"""Hot-swap: ask a running Triton (local or production) to load a model's new version, and wait until it serves it."""

from __future__ import annotations

import time

from scorestack.errors import AdminKeyError, ServerError, TlsError
from scorestack.serve.security import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, ADMIN_KEY_HEADER, AdminKey, ClientTls, diagnose_tls, load_admin_key


def _refused(message: str) -> bool:
    # Triton's answer to a restricted call without the right header names the header it expects.
    text = message.lower()
    return "restricted" in text or ADMIN_KEY_HEADER in text


def admin_refusal(url: str, key: AdminKey | None, what: str, message: str) -> AdminKeyError:
    """The error for an admin call Triton refused: says whether the key was missing or wrong, and how to pass it."""
    if key is None:
        why = f"no admin key was sent; set {ADMIN_KEY_ENV} or {ADMIN_KEY_FILE_ENV} to the server's key"
    else:
        why = f"the admin key from {key.source} is not the server's"
    return AdminKeyError(f"Triton at {url} refused {what}: {why} (header {ADMIN_KEY_HEADER!r}; Triton said: {message})")


def load_version(
    url: str,
    name: str,
    version: int,
    timeout_s: float = 120.0,
    *,
    admin_key: AdminKey | str | None = None,
    tls: ClientTls | None = None,
) -> float:
    """Load `name` through Triton's repository API at gRPC `url` and wait until `version` is ready.

    Works for a production Triton in explicit model-control mode reading the same repository, and for
    `scorestack serve` (which also picks new versions up itself). Triton keeps the old version serving
    until the new one is loaded; requests in flight finish where they started. The admin key is
    `admin_key`, else $SCORESTACK_ADMIN_KEY / $SCORESTACK_ADMIN_KEY_FILE (the repository API is
    restricted on a server started with one); TLS is `tls`, else $SCORESTACK_TLS_DIR. Returns the seconds it took; raises AdminKeyError when
    Triton refuses the key, ServerError with Triton's reason when the new version does not become
    ready in time.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = load_admin_key(admin_key)
    tls = tls or ClientTls.from_env()
    headers = key.grpc_headers if key else None
    start = time.monotonic()
    client = grpcclient.InferenceServerClient(url, **(tls.grpc_kwargs() if tls else {}))
    try:
        try:
            client.load_model(name, headers=headers, client_timeout=timeout_s)
        except InferenceServerException as exc:
            load_error = exc.message() or str(exc)
            if _refused(load_error):
                raise admin_refusal(url, key, f"loading model {name!r}", load_error) from exc
            problem = diagnose_tls(url, tls, timeout_s=2.0)
            if problem:
                raise TlsError(f"hot-swap of model {name!r}: {problem} (Triton's client said: {load_error})") from exc
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
            index = client.get_model_repository_index(headers=headers, as_json=True, client_timeout=5).get("models", [])
            reason = "; ".join(f"version {m.get('version')}: {m.get('state')} {m.get('reason', '')}".strip() for m in index if m.get("name") == name) or reason
        except InferenceServerException:
            pass
        raise ServerError(f"model {name}: version {version} did not become ready on {url} within {timeout_s:.0f} s: {reason or 'no reason given'}")
    finally:
        client.close()


def unload_model(url: str, name: str, timeout_s: float = 30.0, *, admin_key: AdminKey | str | None = None, tls: ClientTls | None = None) -> None:
    """Unload `name` through Triton's repository API (admin key as in `load_version`)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = load_admin_key(admin_key)
    tls = tls or ClientTls.from_env()
    client = grpcclient.InferenceServerClient(url, **(tls.grpc_kwargs() if tls else {}))
    try:
        client.unload_model(name, headers=key.grpc_headers if key else None, client_timeout=timeout_s)
    except InferenceServerException as exc:
        message = exc.message() or str(exc)
        if _refused(message):
            raise admin_refusal(url, key, f"unloading model {name!r}", message) from exc
        raise ServerError(f"model {name}: unload on {url} failed: {message}") from exc
    finally:
        client.close()
