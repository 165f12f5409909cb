"""The lean gRPC transport: Triton's KServe-v2 `ModelInfer` over one HTTP/2 connection, framed here.

grpc.aio costs ~330 µs of client CPU per call at concurrency 1 (its call object, the completion
queue's poller thread handing the result to the event loop, metadata objects); the wire itself is a
few hundred bytes. This transport speaks the same protocol to the same gRPC port (h2c, plaintext)
from an `asyncio.Protocol`: the request's header block is built once (every call is ModelInfer to
the same authority) and the `ModelInferRequest` bytes once per model and input shapes, with only the queue timeout and the
tensors' bytes filled in per call; HEADERS and DATA go out in one write; the reply is parsed in
`data_received` and resolves one future.

What it does of HTTP/2: many calls in flight on one connection (streams), both directions' flow
control, the server's SETTINGS (frame size, window, concurrent streams), PING, GOAWAY and
RST_STREAM. It asks the server for a header table of size 0, so the server's header blocks carry no
state from one response to the next and a block seen before is decoded from a cache (hpack decodes
the others). Errors come back as InferenceServerException with gRPC's status name
(`StatusCode.UNAVAILABLE`, ...) and Triton's message, so the client's retry and rejection rules
(client/triton.py) apply unchanged. TLS deployments keep grpc.aio.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Mapping, Sequence
from urllib.parse import unquote

import numpy as np
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

INFER_PATH = b"/inference.GRPCInferenceService/ModelInfer"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_WINDOW = 2**31 - 1
_MAX_STREAM_ID = 2**31 - 1

# Frame types and flags (RFC 9113, section 6).
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
_FRAME_HEAD = struct.Struct(">HBBBI")  # length (24 bits, as 16 + 8), type, flags, stream id (with its reserved bit)

_GRPC_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)
# HTTP status -> gRPC code where a proxy or the server answered outside gRPC (gRPC's HTTP-to-gRPC mapping).
_HTTP_TO_GRPC = {400: "INTERNAL", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED",
                 429: "UNAVAILABLE", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE"}
# RST_STREAM error codes worth a retry: the server refused the stream before doing any work.
_REFUSED_STREAM = 0x7
_CANCEL = 0x8

# Tensor types whose wire form is not the array's raw bytes: these go through tritonclient's own path.
SERIALIZED_TYPES = ("BYTES", "BF16")
_DTYPES: dict[str, np.dtype] = {}


def response_arrays(response, wanted: Sequence[str], dtypes: Mapping[str, tuple[str, np.dtype]] | None = None) -> dict[str, np.ndarray | None]:
    """The wanted outputs of a ModelInferResponse as numpy arrays (None where absent), as
    tritonclient's InferResult.as_numpy reads them. `dtypes` (name -> (datatype, dtype), from the
    model's metadata) saves the per-call type lookup."""
    out: dict[str, np.ndarray | None] = dict.fromkeys(wanted)
    raw = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        name = tensor.name
        if name not in out:
            continue
        datatype = tensor.datatype
        if datatype in SERIALIZED_TYPES or index >= len(raw):
            out[name] = InferResult(response).as_numpy(name)
            continue
        known = dtypes.get(name) if dtypes else None
        if known is not None and known[0] == datatype:
            dtype = known[1]
        else:
            dtype = _DTYPES.get(datatype)
            if dtype is None:
                dtype = _DTYPES[datatype] = np.dtype(triton_to_np_dtype(datatype))
        out[name] = np.frombuffer(raw[index], dtype=dtype).reshape(tuple(tensor.shape))
    return out


# --- encoding -------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541, section 5.1); `first` holds the byte's other bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_str(value: bytes) -> bytes:
    return _hpack_int(len(value), 7) + value  # no Huffman: the block is built once, its size hardly matters


def _literal(name: bytes | int, value: bytes) -> bytes:
    """A header field 'without indexing': the server's table stays empty. `name` is a static-table index or a name."""
    if isinstance(name, int):
        return _hpack_int(name, 4) + _hpack_str(value)
    return b"\x00" + _hpack_str(name) + _hpack_str(value)


def request_headers(authority: bytes, path: bytes = INFER_PATH) -> bytes:
    """The header block of a gRPC call, but its grpc-timeout (static table: 3 is `:method POST`,
    6 `:scheme http`, 4 `:path`, 1 `:authority`, 31 `content-type`)."""
    return b"\x83\x86" + _literal(4, path) + _literal(1, authority) + _literal(31, b"application/grpc") + _literal(b"te", b"trailers")


def grpc_timeout(timeout_s: float) -> bytes:
    """gRPC's timeout header value: at most 8 digits and a unit."""
    us = max(int(timeout_s * 1e6), 1)
    if us < 100_000_000:
        return b"%du" % us
    return b"%dm" % min(us // 1000, 99_999_999)


def timeout_parameter(timeout_s: float) -> bytes:
    """ModelInferRequest.parameters["timeout"] = int64_param(µs): Triton's queue timeout for this request."""
    param = b"\x10" + _varint(max(int(timeout_s * 1e6), 1))  # InferParameter.int64_param = 2
    entry = b"\x0a\x07timeout\x12" + _varint(len(param)) + param  # map entry: key = 1, value = 2
    return b"\x22" + _varint(len(entry)) + entry  # ModelInferRequest.parameters = 4


def request_head(model: str, inputs: Sequence[tuple[str, str, tuple[int, ...]]], outputs: Sequence[str]) -> bytes:
    """The ModelInferRequest without its parameters and raw tensors, serialized once (fields may come in
    any order, and a message is the concatenation of its fields)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    for name in outputs:
        request.outputs.add(name=name)
    return request.SerializeToString()


def raw_contents(data: bytes) -> bytes:
    """One ModelInferRequest.raw_input_contents entry (field 7)."""
    return b"\x3a" + _varint(len(data)) + data


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME_HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload


def _error(code: str, message: str) -> InferenceServerException:
    return InferenceServerException(message, status=f"StatusCode.{code}")


# --- the connection -------------------------------------------------------------------------------


class _Stream:
    __slots__ = ("future", "status", "data", "send_window")

    def __init__(self, future: asyncio.Future, send_window: int) -> None:
        self.future = future
        self.status: int | None = None  # :status of the response headers, once they came
        self.data = bytearray()
        self.send_window = send_window


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: streams in flight, both directions' flow control, the server's settings."""

    def __init__(self, address: str) -> None:
        import hpack

        self.address = address
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1
        self.closed = False
        self.going_away = False
        self.buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.blocks: dict[bytes, list[tuple[bytes, bytes]]] = {}  # header blocks seen, decoded (table size 0: no state)
        self.pending_block: tuple[int, int, bytearray] | None = None  # stream, flags, fragments awaiting CONTINUATION
        # The server's settings (defaults until its SETTINGS frame comes).
        self.max_frame = 16_384
        self.initial_window = 65_535
        self.max_streams = 2**31
        self.send_window = 65_535  # connection-level, towards the server
        self.received = 0  # DATA bytes taken since our last connection WINDOW_UPDATE
        self.window_opened: asyncio.Event | None = None
        self.stream_freed: asyncio.Event | None = None
        self.last_rx = 0.0

    # asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        settings = struct.pack(">HIHIHI", 0x1, 0, 0x2, 0, 0x4, _MAX_WINDOW)  # header table 0, no push, largest window
        self.transport.write(_PREFACE + frame(_SETTINGS, 0, 0, settings)
                             + frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", _MAX_WINDOW - 65_535)))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail_all(_error("UNAVAILABLE", f"connection to Triton at {self.address} lost: {exc or 'closed by the server'}"))

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.loop.time()
        buffer = self.buffer
        buffer += data
        pos, end = 0, len(buffer)
        head = _FRAME_HEAD
        try:
            while end - pos >= 9:
                hi, lo, kind, flags, stream = head.unpack_from(buffer, pos)
                length = (hi << 8) | lo
                if end - pos - 9 < length:
                    break
                payload = bytes(buffer[pos + 9: pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream & 0x7FFFFFFF, payload)
        except Exception as exc:  # an unreadable frame: nothing after it can be trusted
            del buffer[:]
            self.abort(_error("INTERNAL", f"unreadable HTTP/2 frame from Triton at {self.address}: {type(exc).__name__}: {exc}"))
            return
        del buffer[:pos]

    # frames

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self.pending_block is not None and kind != _CONTINUATION:
            raise ValueError("header block interrupted by another frame")
        if kind == _DATA:
            self._data(flags, stream, payload)
        elif kind == _HEADERS:
            if flags & _PADDED:
                payload = payload[1: len(payload) - payload[0]]
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            if flags & _END_HEADERS:
                self._headers(stream, flags, payload)
            else:
                self.pending_block = (stream, flags, bytearray(payload))
        elif kind == _CONTINUATION:
            if self.pending_block is None or self.pending_block[0] != stream:
                raise ValueError("CONTINUATION without its HEADERS")
            self.pending_block[2].extend(payload)
            if flags & _END_HEADERS:
                s, f, block = self.pending_block
                self.pending_block = None
                self._headers(s, f, bytes(block))
        elif kind == _SETTINGS:
            if not flags & _ACK:
                self._settings(payload)
        elif kind == _WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.send_window += increment
            elif stream in self.streams:
                self.streams[stream].send_window += increment
            if self.window_opened is not None:
                self.window_opened.set()
        elif kind == _PING:
            if not flags & _ACK:
                self.transport.write(frame(_PING, _ACK, 0, payload))
        elif kind == _RST_STREAM:
            code = struct.unpack(">I", payload)[0]
            s = self.streams.pop(stream, None)
            if s is not None:
                name = "UNAVAILABLE" if code == _REFUSED_STREAM else ("CANCELLED" if code == _CANCEL else "INTERNAL")
                self._settle(s, exc=_error(name, f"Triton at {self.address} reset the call (HTTP/2 error {code})"))
        elif kind == _GOAWAY:
            last, code = struct.unpack(">II", payload[:8])
            last &= 0x7FFFFFFF
            self.going_away = True
            detail = payload[8:].decode(errors="replace")
            for sid in [sid for sid in self.streams if sid > last]:  # never processed: safe to retry
                self._settle(self.streams.pop(sid), exc=_error("UNAVAILABLE", f"Triton at {self.address} is going away (HTTP/2 error {code}{': ' + detail if detail else ''})"))
            self._close_if_idle()
        elif kind == _PUSH_PROMISE:
            raise ValueError("PUSH_PROMISE after push was disabled")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 requires.

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 0x3:
                self.max_streams = value
                if self.stream_freed is not None:
                    self.stream_freed.set()
            elif key == 0x4:
                delta = value - self.initial_window
                self.initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
                if self.window_opened is not None:
                    self.window_opened.set()
            elif key == 0x5:
                self.max_frame = value
        self.transport.write(frame(_SETTINGS, _ACK, 0))

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        n = len(payload)
        if flags & _PADDED:
            payload = payload[1: n - payload[0]]
        self.received += n
        if self.received > _MAX_WINDOW // 2:  # give the connection's window back (each stream's is 2^31-1)
            self.transport.write(frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
            self.received = 0
        s = self.streams.get(stream)
        if s is None:
            return  # a stream we gave up on
        s.data += payload
        if flags & _END_STREAM:
            del self.streams[stream]
            self._settle(s, exc=_error("INTERNAL", f"Triton at {self.address} ended the call without gRPC trailers"))

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers = self.blocks.get(block)
        if headers is None:
            headers = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]
            if self.decoder.header_table.maxsize == 0 and len(self.blocks) < 256:
                self.blocks[block] = headers  # stateless from now on: the same bytes decode the same
        return headers

    def _headers(self, stream: int, flags: int, block: bytes) -> None:
        headers = self._decode(block)  # decoded even for a stream given up on: the decoder's table must follow every block
        s = self.streams.get(stream)
        if s is None:
            return
        if s.status is None:
            for name, value in headers:
                if name == b":status":
                    s.status = int(value)
                    break
            else:
                s.status = 0
        if not flags & _END_STREAM:
            return  # the response's headers; the message and the trailers follow
        del self.streams[stream]
        # Trailers, or a trailers-only response (an error before any message).
        status = message = None
        for name, value in headers:
            if name == b"grpc-status":
                status = int(value)
            elif name == b"grpc-message":
                message = unquote(value.decode(errors="replace"))
        if status is None:
            http = s.status or 0
            code = _HTTP_TO_GRPC.get(http, "UNKNOWN") if http != 200 else "INTERNAL"
            self._settle(s, exc=_error(code, f"Triton at {self.address} answered HTTP {http} without a gRPC status"))
        elif status != 0:
            code = _GRPC_CODES[status] if status < len(_GRPC_CODES) else "UNKNOWN"
            self._settle(s, exc=_error(code, message or code))
        else:
            self._settle(s, result=bytes(s.data))

    # settling

    def _settle(self, s: _Stream, *, result: bytes | None = None, exc: BaseException | None = None) -> None:
        if not s.future.done():
            if exc is not None:
                s.future.set_exception(exc)
            else:
                s.future.set_result(result)
        if self.stream_freed is not None:
            self.stream_freed.set()
        self._close_if_idle()

    def _fail_all(self, exc: BaseException) -> None:
        streams, self.streams = self.streams, {}
        for s in streams.values():
            if not s.future.done():
                s.future.set_exception(exc)
        for event in (self.window_opened, self.stream_freed):
            if event is not None:
                event.set()

    def _close_if_idle(self) -> None:
        if self.going_away and not self.streams and not self.closed:
            self.close()

    def abort(self, exc: BaseException) -> None:
        self.closed = True
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and self.next_id < _MAX_STREAM_ID - 2

    # the calls

    def open_stream(self, future: asyncio.Future) -> tuple[int, _Stream]:
        sid = self.next_id
        self.next_id += 2
        s = self.streams[sid] = _Stream(future, self.initial_window)
        return sid, s

    def cancel(self, sid: int) -> None:
        """The caller gave up: tell the server, forget the stream."""
        if self.streams.pop(sid, None) is not None and not self.closed:
            self.transport.write(frame(_RST_STREAM, 0, sid, struct.pack(">I", _CANCEL)))
            self._close_if_idle()

    async def send(self, sid: int, s: _Stream, headers: bytes, message: bytes) -> None:
        """HEADERS then the message in DATA frames, within the server's frame size and both windows."""
        body = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC's length-prefixed message, uncompressed
        n = len(body)
        if len(headers) <= self.max_frame and n <= self.max_frame and n <= self.send_window and n <= s.send_window:
            self.send_window -= n
            s.send_window -= n
            self.transport.write(frame(_HEADERS, _END_HEADERS, sid, headers) + frame(_DATA, _END_STREAM, sid, body))
            return
        if len(headers) > self.max_frame:
            raise _error("INTERNAL", f"request headers of {len(headers)} bytes exceed the server's frame size {self.max_frame}")
        self.transport.write(frame(_HEADERS, _END_HEADERS, sid, headers))
        view, offset = memoryview(body), 0
        while offset < n:
            if self.closed or sid not in self.streams:
                return  # failed or given up meanwhile: the caller's future says why
            room = min(self.max_frame, self.send_window, s.send_window, n - offset)
            if room <= 0:
                if self.window_opened is None:
                    self.window_opened = asyncio.Event()
                self.window_opened.clear()
                await self.window_opened.wait()
                continue
            self.send_window -= room
            s.send_window -= room
            last = offset + room == n
            self.transport.write(frame(_DATA, _END_STREAM if last else 0, sid, bytes(view[offset: offset + room])))
            offset += room

    async def stream_slot(self) -> None:
        """Wait while the server's limit of concurrent streams is reached."""
        while len(self.streams) >= self.max_streams and not self.closed:
            if self.stream_freed is None:
                self.stream_freed = asyncio.Event()
            self.stream_freed.clear()
            await self.stream_freed.wait()


class GrpcWire:
    """Inference calls to Triton's gRPC endpoint at `address` (host:port) on one HTTP/2 connection."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"url: {address!r} is not host:port (e.g. 127.0.0.1:8001, Triton's gRPC port)")
        self.address, self.host, self.port = address, host.strip("[]"), int(port)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._headers = request_headers(address.encode())  # without grpc-timeout, the one field that changes
        self._heads: dict[tuple, bytes] = {}  # (model, input names/types/shapes, outputs) -> request head
        # grpc-timeout's bytes up to its value's length; the value (at most 9 bytes) is one length byte and itself.
        self._timeout_name = _literal(b"grpc-timeout", b"")[:-1]

    async def _connection(self, timeout: float) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            # A connect whose every caller timed out still ends; its error is then nobody's to report.
            self._connecting.add_done_callback(lambda f: f.cancelled() or f.exception())
        connecting = self._connecting
        try:
            return await asyncio.wait_for(asyncio.shield(connecting), timeout)
        except asyncio.TimeoutError:
            raise _error("UNAVAILABLE", f"failed to connect to Triton's gRPC endpoint at {self.address} within {timeout:.3f} s") from None

    async def _connect(self) -> _Connection:
        try:
            old = self._conn
            _, conn = await asyncio.get_running_loop().create_connection(lambda: _Connection(self.address), self.host, self.port)
            self._conn = conn
            if old is not None:
                old.going_away = True  # its calls in flight finish there; then it closes
                old._close_if_idle()
            return conn
        except OSError as exc:
            raise _error("UNAVAILABLE", f"failed to connect to Triton's gRPC endpoint at {self.address}: {exc}") from None
        finally:
            self._connecting = None

    async def infer(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str], timeout: float) -> dict[str, np.ndarray]:
        """Run `model` on (name, Triton datatype, C-ordered array) inputs; the named outputs as arrays.
        `timeout` (s) bounds the whole call (connecting included) and goes to Triton as the call's
        deadline and the request's queue timeout, as tritonclient sends them."""
        key = (model, tuple((n, d, a.shape) for n, d, a in inputs), tuple(outputs))
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = request_head(model, [(n, d, a.shape) for n, d, a in inputs], outputs)
        value = grpc_timeout(timeout)
        headers = self._headers + self._timeout_name + bytes([len(value)]) + value
        message = b"".join([head, timeout_parameter(timeout), *(raw_contents(a.tobytes()) for _, _, a in inputs)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = self._conn
        if conn is None or not conn.usable:
            conn = await self._connection(timeout)
        if len(conn.streams) >= conn.max_streams:
            await asyncio.wait_for(conn.stream_slot(), max(deadline - loop.time(), 1e-4))
        if conn.closed:
            raise _error("UNAVAILABLE", f"connection to Triton at {self.address} closed before the call was sent")
        future = loop.create_future()
        sid, stream = conn.open_stream(future)
        timer = loop.call_later(max(deadline - loop.time(), 1e-4), self._expire, conn, sid, future, timeout)
        try:
            await conn.send(sid, stream, headers, message)
            payload = await future
        except asyncio.CancelledError:
            conn.cancel(sid)
            raise
        finally:
            timer.cancel()
        response = service_pb2.ModelInferResponse.FromString(payload[5:])
        return response_arrays(response, outputs)

    def _expire(self, conn: _Connection, sid: int, future: asyncio.Future, timeout: float) -> None:
        if future.done():
            return
        silent = asyncio.get_running_loop().time() - conn.last_rx >= timeout
        future.set_exception(_error("DEADLINE_EXCEEDED", f"Deadline Exceeded: no answer from Triton at {self.address} within {timeout:.3f} s"))
        conn.cancel(sid)
        if silent and conn is self._conn:
            # Nothing at all came from the server for the whole call: a dead link or a stopped
            # server; the next call connects afresh instead of waiting on this connection.
            conn.abort(_error("UNAVAILABLE", f"connection to Triton at {self.address} stopped answering"))

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
