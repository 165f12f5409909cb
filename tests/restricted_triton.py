"""Checks shared by the tests that start a real tritonserver restricted by an admin key
(test_security: `scorestack serve`'s key handoff; test_deploy: the Triton image's entry point)."""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scorestack.errors import ServerError
from scorestack.serve.readiness import all_of, http_ok, port_open, process_exit, wait_until


def cmdlines() -> dict[int, bytes]:
    """Every process's command line, by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                pass
    return out


def wait_ready(http_port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0, *, grpc_port: int | None = None, metrics_port: int | None = None) -> None:
    """Wait (bounded) until every endpoint Triton was asked to open answers; fail with the log's tail
    if it exits or never gets ready."""
    probes = [lambda: http_ok(f"http://127.0.0.1:{http_port}/v2/health/ready")]
    if grpc_port:
        probes.append(lambda: port_open("127.0.0.1", grpc_port))
    if metrics_port:
        probes.append(lambda: http_ok(f"http://127.0.0.1:{metrics_port}/metrics"))
    try:
        wait_until(all_of(*probes), timeout_s=timeout_s, what="tritonserver", died=process_exit(proc))
    except ServerError as exc:
        pytest.fail(f"{exc}: {log.read_text(errors='replace')[-2000:]}")


def repository_index_status(http_port: int, headers: dict[str, str]) -> int:
    """HTTP status of the repository index (a restricted API) with these headers."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def assert_restricted_to(key, placeholder: str, http_port: int, grpc_port: int) -> None:
    """The repository API refuses no key and the placeholder `ps` shows, opens to the key (HTTP and
    gRPC), and health stays open."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from scorestack.serve.security import ADMIN_KEY_HEADER

    statuses = [repository_index_status(http_port, h) for h in ({}, {ADMIN_KEY_HEADER: placeholder}, key.http_headers)]
    assert statuses == [403, 403, 200], statuses
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index(client_timeout=5)
        assert list(client.get_model_repository_index(headers=key.grpc_headers, client_timeout=5).models) == []
        assert client.is_server_live(client_timeout=5)  # health stays open
    finally:
        client.close()
