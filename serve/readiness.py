"""Readiness: bounded polls of the thing being waited for, never a sleep that hopes it is done.

One module for every wait on a server (the local Triton, a peer in the benchmarks, a test's Redis):
`wait_until` polls a probe until it holds, the process it waits on dies, or the deadline passes, and
raises `ServerError` naming what was awaited and what the last probe saw. `triton_endpoints` is the
probe for Triton: it is ready only when every endpoint it was asked to open answers (gRPC, HTTP
readiness, metrics). Triton binds them in that order, so HTTP "ready" can come before the metrics
port is bound, and a metrics-port collision then kills Triton after HTTP answered.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from typing import Callable

from scorestack.errors import ServerError

#: What a probe returns: None when what it checks holds, else a short reason it does not (yet).
Probe = Callable[[], "str | None"]

DEFAULT_INTERVAL_S = 0.05


def port_open(host: str, port: int, timeout_s: float = 0.5) -> str | None:
    """None when something accepts TCP connections on host:port, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port} refuses connections ({exc.strerror or exc})"


def http_ok(url: str, timeout_s: float = 1.0) -> str | None:
    """None when GET `url` answers 200, else the status or error seen."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return None if r.status == 200 else f"{url} answered {r.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"


def all_of(*probes: Probe) -> Probe:
    """A probe that holds when every one of `probes` holds; reports the first that does not."""

    def probe() -> str | None:
        for p in probes:
            reason = p()
            if reason is not None:
                return reason
        return None

    return probe


def triton_endpoints(host: str, grpc_port: int, http_host: str, http_port: int, metrics_port: int | None) -> Probe:
    """Triton is ready when gRPC accepts connections, HTTP says ready and (when enabled) metrics answer."""
    probes: list[Probe] = [
        lambda: port_open(host, grpc_port),
        lambda: http_ok(f"http://{http_host}:{http_port}/v2/health/ready"),
    ]
    if metrics_port:
        probes.append(lambda: http_ok(f"http://{host}:{metrics_port}/metrics"))
    return all_of(*probes)


def wait_until(
    probe: Probe,
    *,
    timeout_s: float,
    what: str,
    died: Callable[[], "str | None"] | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> float:
    """Poll `probe` until it returns None; return the seconds waited.

    `died` is checked before each probe: when it returns a message (the process being waited on
    exited), the wait ends at once with that message. Raises ServerError naming `what`, the time
    waited and the last reason the probe gave.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        if died is not None:
            message = died()
            if message is not None:
                raise ServerError(f"{what}: {message}")
        reason = probe()
        if reason is None:
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            raise ServerError(f"{what}: not ready within {timeout_s:g} s (last seen: {reason})")
        time.sleep(interval_s)


def process_exit(proc) -> Callable[[], "str | None"]:
    """A `died` check for a subprocess: its exit code once it has exited."""

    def died() -> str | None:
        code = proc.poll()
        return None if code is None else f"exited with code {code}"

    return died
