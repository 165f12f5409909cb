"""The lean inference transport: Triton's HTTP/1.1 endpoint, keep-alive, binary tensors both ways.

Measured on the demo fraud model at concurrency 1 (benchmarks/results/e2e.md, "the hop to the model
alone"): `TritonClient.infer` over gRPC costs ~0.35-0.4 ms from Python, most of it grpc.aio's own
machinery; over this transport (one prebuilt HTTP/1.1 request on a kept-alive connection, inputs and
outputs in Triton's binary tensor extension: a JSON header, then raw bytes) about half of that.
Triton itself answers both in about the same time (from h2load, benchmarks/results/peers.md).

One request is in flight per connection (HTTP/1.1 without pipelining); the pool opens connections
as concurrency needs them, up to `max_connections`, and a call beyond that waits for one to free.
Triton's HTTP endpoint has no TLS: this transport is plaintext, for a server on the same host or
network segment (a sidecar); TLS deployments keep gRPC. Errors come back as
InferenceServerException with Triton's message, so the client's retry and rejection rules
(client/triton.py) apply unchanged: a connection that cannot be opened or is lost is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

UNAVAILABLE = "StatusCode.UNAVAILABLE"


class _Connection(asyncio.Protocol):
    """One keep-alive connection: write a request, resolve the future with (status, headers, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.head: tuple[int, dict[bytes, bytes]] | None = None
        self.need = 0
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(InferenceServerException(f"connection to Triton lost: {exc or 'closed by the server'}", status=UNAVAILABLE))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            headers = dict(line.split(b": ", 1) for line in lines[1:] if b": " in line)
            headers = {k.lower(): v for k, v in headers.items()}
            self.head = (int(lines[0].split(b" ", 2)[1]), headers)
            self.need = int(headers.get(b"content-length", b"0"))
            del self.buffer[: end + 4]
        if len(self.buffer) >= self.need and self.waiter is not None and not self.waiter.done():
            body = bytes(self.buffer[: self.need])
            del self.buffer[: self.need]
            status, headers = self.head
            self.head = None
            self.waiter.set_result((status, headers, body))

    def send(self, request: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpWire:
    """A pool of keep-alive connections to Triton's HTTP endpoint at `address` (host:port)."""

    def __init__(self, address: str, *, max_connections: int = 64) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"http_url: {address!r} is not host:port (e.g. 127.0.0.1:8000, Triton's HTTP port)")
        self.address, self.host, self.port = address, host, int(port)
        self.max_connections = max_connections
        self._idle: list[_Connection] = []
        self._open = 0
        self._freed: asyncio.Condition | None = None  # created on the running loop when the pool is first full
        self._headers: dict[tuple, tuple[bytes, bytes, str]] = {}

    async def _acquire(self, timeout: float) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._open -= 1
        if self._open >= self.max_connections:
            if self._freed is None:
                self._freed = asyncio.Condition()
            async with self._freed:
                await asyncio.wait_for(self._freed.wait_for(lambda: bool(self._idle) or self._open < self.max_connections), timeout)
            return await self._acquire(timeout)
        self._open += 1
        try:
            _, conn = await asyncio.wait_for(asyncio.get_running_loop().create_connection(_Connection, self.host, self.port), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self._open -= 1
            raise InferenceServerException(f"failed to connect to Triton's HTTP endpoint at {self.address}: {exc}", status=UNAVAILABLE) from None
        return conn

    async def _release(self, conn: _Connection, reuse: bool) -> None:
        if reuse and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
            self._open -= 1
        if self._freed is not None:
            async with self._freed:
                self._freed.notify()

    async def infer(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str], timeout: float) -> dict[str, np.ndarray]:
        """Run `model` on (name, Triton datatype, C-ordered array) inputs; the named outputs as arrays. `timeout` (s)
        bounds the whole call and goes to Triton as the request's queue timeout, as on gRPC."""
        key = (model, tuple((n, d, a.shape) for n, d, a in inputs), tuple(outputs))
        parts = self._headers.get(key)
        if parts is None:
            # The JSON header, split where the per-call timeout goes: encoded once per model, shapes and outputs.
            text = json.dumps({
                "inputs": [{"name": n, "shape": list(a.shape), "datatype": d, "parameters": {"binary_data_size": a.nbytes}} for n, d, a in inputs],
                "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs],
                "parameters": {"timeout": 0},
            }, separators=(",", ":"))
            cut = text.rindex("0}}")
            parts = self._headers[key] = (text[:cut].encode(), text[cut + 1:].encode(),
                                          f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/octet-stream\r\n")
        header = b"%b%d%b" % (parts[0], max(int(timeout * 1e6), 1), parts[1])
        body = [header, *(a.tobytes() for _, _, a in inputs)]
        request = b"".join([(f"{parts[2]}Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {sum(map(len, body))}\r\n\r\n").encode(), *body])
        loop = asyncio.get_running_loop()
        conn = await self._acquire(timeout)
        waiter = conn.send(request)
        timer = loop.call_later(timeout, lambda: waiter.done() or waiter.set_exception(
            InferenceServerException(f"Deadline Exceeded: no answer from Triton's HTTP endpoint at {self.address}", status="DEADLINE_EXCEEDED")))
        reuse = False
        try:
            status, headers, data = await waiter
            reuse = headers.get(b"connection", b"").lower() != b"close"
        finally:
            timer.cancel()
            await self._release(conn, reuse)  # a call that failed or timed out closes its connection: its answer may still come
        if status != 200:
            try:
                message = json.loads(data).get("error", data.decode(errors="replace"))
            except ValueError:
                message = data.decode(errors="replace")
            raise InferenceServerException(message, status=f"HTTP {status}")
        split = int(headers.get(b"inference-header-content-length", len(data)))
        meta = json.loads(data[:split])
        out, offset = {}, split
        for tensor in meta.get("outputs", []):
            size = int((tensor.get("parameters") or {}).get("binary_data_size", 0))
            dtype = np.dtype(triton_to_np_dtype(tensor["datatype"]))
            if size:
                out[tensor["name"]] = np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=offset).reshape(tensor["shape"])
                offset += size
            else:
                out[tensor["name"]] = np.asarray(tensor["data"], dtype=dtype).reshape(tensor["shape"])
        return out

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        self._open = 0
