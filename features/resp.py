"""A lean Redis connection for the direct reader: pre-packed commands, replies parsed by hiredis.

redis-py's asyncio client costs ~75 µs of CPU per round trip here (pool checkout, health and
readiness checks, a StreamReader, an event-loop turn per reply); on 2 cores shared with Triton and
Redis that CPU is latency. This connection is an `asyncio.Protocol`: a read writes its pre-packed
pipeline and awaits one future, which `data_received` resolves once hiredis has parsed that
read's replies. Reads pipeline on one connection (Redis answers in order), so no pool is needed. A
read whose caller gave up drops the connection (a stalled server or a dead link must not hold the
reads queued behind it); the next read connects again.

Only what the direct reader needs: plain TCP, AUTH and SELECT at connect. Anything else in the
connection string (TLS among it: redis-py's TLS options are the tested ones, tests/test_features_tls.py)
makes `lean_params` refuse and the reader keeps redis-py.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Any

import hiredis

# Connection-string parameters (Feast's `host:port,key=value,...`) this connection implements.
LEAN_PARAMS = frozenset({"db", "password", "username", "socket_connect_timeout", "socket_keepalive"})


def lean_params(params: dict[str, Any]) -> str | None:
    """None when `params` are all ones this connection implements, else why redis-py is kept."""
    other = sorted(set(params) - LEAN_PARAMS)
    return f"connection parameters {other} are not implemented by the lean reader" if other else None


def bulk(value: bytes) -> bytes:
    """One argument of a command in RESP framing."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP framing."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a if isinstance(a, bytes) else str(a).encode()) for a in args)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future, int, list]] = deque()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting, gets = self.waiting, self.reader.gets
        try:
            while waiting:
                future, n, replies = waiting[0]
                reply = gets()
                if reply is False:
                    return
                replies.append(reply)
                if len(replies) == n:
                    waiting.popleft()
                    if not future.done():
                        future.set_result(replies)
        except hiredis.ProtocolError as exc:
            self.drop(ConnectionError(f"redis: unreadable reply ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"redis: connection lost ({exc or 'closed by the server'})"))

    def drop(self, exc: BaseException) -> None:
        """Fail every waiting read now and close the connection (it is not used again)."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        while self.waiting:
            future, _, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)


class RespConnection:
    """One pipelined connection, opened on first use and again after it is lost."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        password: str | None = None,
        username: str | None = None,
        socket_connect_timeout: float | None = None,
        socket_keepalive: bool = False,
    ) -> None:
        self.host, self.port = host, port
        self._connect_timeout = float(socket_connect_timeout) if socket_connect_timeout else None
        self._keepalive = bool(socket_keepalive)
        self._setup = []
        if password is not None:
            self._setup.append(pack("AUTH", *([username] if username else []), password))
        if int(db or 0):
            self._setup.append(pack("SELECT", int(db)))
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            transport, protocol = await loop.create_connection(_Protocol, self.host, self.port)
        try:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._setup:
                replies = await self._send(protocol, b"".join(self._setup), len(self._setup))
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise ConnectionError(f"redis: connection setup refused: {reply}")
        except BaseException:
            transport.abort()
            raise
        return protocol

    async def _reconnected(self) -> _Protocol:
        # One connect at a time; concurrent reads wait for it (each still bounded by its caller).
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, future: asyncio.Future) -> None:
        self._connecting = None
        if not future.cancelled() and future.exception() is None:
            self._protocol = future.result()

    @staticmethod
    def _send(protocol: _Protocol, packed: bytes, n: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        protocol.waiting.append((future, n, []))
        protocol.transport.write(packed)
        return future

    async def request(self, packed: bytes, n_replies: int) -> list:
        """Send pre-packed commands and return their `n_replies` replies (errors as exceptions in the list)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._reconnected()
        future = self._send(protocol, packed, n_replies)
        try:
            return await future
        except asyncio.CancelledError:
            # The caller gave up (its budget): the server may be stalled or the link dead, so the
            # connection is dropped (the reads still on it fail at once) and the next read opens a
            # new one, as redis-py's clients do. A pipeline never waits behind a hung connection.
            if future.cancelled():  # its replies have not come (else they were read: nothing is owed)
                protocol.drop(ConnectionError("redis: connection dropped after a read was given up"))
            raise

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
