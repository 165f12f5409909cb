"""Triton in the service's own process, through Triton's C API (libtritonserver), for the shortest hop.

The managed server environment's wheel ships `libtritonserver` (the core `tritonserver` links) but no
Python bindings for it, so this module binds the few C functions it needs with ctypes: server
options and lifetime, model metadata and config, and asynchronous inference with a response
allocator. What Triton does stays Triton's: the dynamic batcher, the queue policy, instances,
backends, model loading. Only the network hop and its serialization go away: a request is handed to
Triton's scheduler as a pointer to the caller's array. Triton's callbacks are C
(serve/inprocess_shim.c, built at first use with the system C compiler): they never take Python's
GIL, which a busy event loop holds (with Python callbacks, every response waited for the GIL and the
rate under 16 callers fell to a third of the HTTP transport's). A completed response is queued and
an eventfd wakes the asyncio loop, which reads the outputs and resolves the caller's future.

    with InProcessTriton(repository, models=["fraud_xgb"]) as server:
        async with TritonClient(in_process=server) as triton:
            await triton.infer("fraud_xgb", {"features": x})

When it fits: one service process on a host that owns its model (no sharing across services), for
the lowest latency at any load; the model then shares that process's CPU and memory, and a model
reload or crash is the service's. Models on Triton's Python backend are refused (its stub processes
need the server environment's variables, which a service process does not carry): the native
backend (serving.native_backend, the default for the formats it runs) serves in-process.
"""

from __future__ import annotations

import asyncio
import ctypes as C
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Collection, Sequence

import numpy as np
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from scorestack.errors import ServerError
from scorestack.serve.cbuild import build_library
from scorestack.serve.environment import ServerEnvironment, ensure_server_environment
from scorestack.serve.view import build_local_view
from scorestack.triton_config import load_config

log = logging.getLogger(__name__)
P = C.c_void_p
_MODEL_CONTROL_EXPLICIT = 2
_CPU = 0
_CODES = {0: "UNKNOWN", 1: "INTERNAL", 2: "NOT_FOUND", 3: "INVALID_ARG", 4: "UNAVAILABLE", 5: "UNSUPPORTED", 6: "ALREADY_EXISTS"}
_DRAIN_MAX = 256


class _Api:
    """libtritonserver and the libraries it needs, loaded once per process."""

    _lock = threading.Lock()
    _loaded: "_Api | None" = None

    def __init__(self, env: ServerEnvironment) -> None:
        # The wheel's libraries find each other through RUNPATH $ORIGIN only one level deep: load them in
        # dependency order first (what fails now loads on a later pass, once its dependencies are in).
        pending = [p for p in sorted(env.libs_dir.iterdir()) if ".so" in p.name and not p.name.startswith("libtritonserver")]
        for _ in range(len(pending)):
            left = []
            for path in pending:
                try:
                    C.CDLL(str(path), mode=C.RTLD_GLOBAL)
                except OSError:
                    left.append(path)
            if not left or len(left) == len(pending):
                break
            pending = left
        lib = next(env.libs_dir.glob("libtritonserver*.so*"), None)
        if lib is None:
            raise ServerError(f"no libtritonserver in {env.libs_dir}: the server environment's wheel does not ship Triton's C API")
        self.lib = C.CDLL(str(lib), mode=C.RTLD_GLOBAL)
        self._functions: dict[str, C._CFuncPtr] = {}
        self.shim = C.CDLL(str(_build_shim()), mode=C.RTLD_GLOBAL)  # its Triton symbols resolve against the library above
        self.shim.scorestack_drain.restype = C.c_size_t
        self.shim.scorestack_drain.argtypes = [C.POINTER(P), C.POINTER(C.c_uint64), C.c_size_t]
        self.wake_fd = self.shim.scorestack_wake_fd()
        if self.wake_fd < 0:
            raise ServerError("in-process Triton: eventfd() failed")
        self.callbacks = {name: C.cast(getattr(self.shim, f"scorestack_{name}"), P)
                          for name in ("alloc", "release", "request_release", "response_complete")}
        self.lib.TRITONSERVER_ErrorMessage.restype = C.c_char_p
        self.lib.TRITONSERVER_ErrorCode.restype = C.c_int
        self.lib.TRITONSERVER_DataTypeString.restype = C.c_char_p
        self.lib.TRITONSERVER_StringToDataType.restype = C.c_int
        self.lib.TRITONSERVER_InferenceResponseError.restype = P

    @classmethod
    def get(cls, env: ServerEnvironment) -> "_Api":
        with cls._lock:
            if cls._loaded is None:
                cls._loaded = cls(env)
            return cls._loaded

    def call(self, name: str, *args) -> None:
        """Call TRITONSERVER_<name>; a returned error becomes InferenceServerException with Triton's message and code."""
        fn = self._functions.get(name)
        if fn is None:  # looked up once: a ctypes lookup and restype per call cost ~4 µs, ten calls a request
            fn = self._functions[name] = getattr(self.lib, f"TRITONSERVER_{name}")
            fn.restype = P
        err = fn(*args)
        if err:
            raise self.error(err)

    def error(self, err: int) -> InferenceServerException:
        message = self.lib.TRITONSERVER_ErrorMessage(P(err)).decode(errors="replace")
        code = _CODES.get(self.lib.TRITONSERVER_ErrorCode(P(err)), "UNKNOWN")
        self.lib.TRITONSERVER_ErrorDelete(P(err))
        return InferenceServerException(message, status=f"StatusCode.{code}")

    def message_json(self, message: P) -> dict:
        base, size = C.c_char_p(), C.c_size_t()
        self.call("MessageSerializeToJson", message, C.byref(base), C.byref(size))
        try:
            return json.loads(C.string_at(base, size.value))
        finally:
            self.lib.TRITONSERVER_MessageDelete(message)


class InProcessTriton:
    """A Triton server inside this process serving `models` of `repository` (a compiled model repository)."""

    def __init__(self, repository: str | Path, *, models: Collection[str] | None = None, strict: bool = True,
                 server_env: ServerEnvironment | None = None) -> None:
        self.repository = Path(repository).resolve()
        self.models = list(models) if models is not None else None
        self.strict = strict
        self._env = server_env
        self._server: P | None = None
        self._run_dir: Path | None = None

    def __enter__(self) -> "InProcessTriton":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> "InProcessTriton":
        env = self._env or ensure_server_environment()
        self.api = api = _Api.get(env)
        self._run_dir = Path(tempfile.mkdtemp(prefix="scorestack-inprocess-"))
        view = build_local_view(self.repository, self._run_dir / "models", strict=self.strict)
        names = self.models if self.models is not None else list(view.models)
        unknown = sorted(set(names) - set(view.models))
        if unknown:
            self._cleanup()
            raise ServerError(f"models {unknown} are not served from {self.repository} (has {sorted(view.models)}; skipped: {view.skipped})")
        for name in names:
            if load_config(view.root / name / "config.pbtxt").backend == "python":
                self._cleanup()
                raise ServerError(f"model {name!r} runs on Triton's Python backend, which is not served in-process (its stub processes need the "
                                  "server environment's variables): compile it for scorestack's native backend (serving.native_backend: true), "
                                  "or serve it with `scorestack serve` and call it over gRPC or HTTP")
        opts = P()
        api.call("ServerOptionsNew", C.byref(opts))
        try:
            api.call("ServerOptionsSetModelRepositoryPath", opts, str(view.root).encode())
            api.call("ServerOptionsSetBackendDirectory", opts, str(env.backend_directory(self._run_dir / "backends")).encode())
            api.call("ServerOptionsSetModelControlMode", opts, _MODEL_CONTROL_EXPLICIT)
            for name in names:
                api.call("ServerOptionsSetStartupModel", opts, name.encode())
            api.call("ServerOptionsSetStrictReadiness", opts, C.c_bool(True))
            api.call("ServerOptionsSetExitOnError", opts, C.c_bool(self.strict))
            api.call("ServerOptionsSetLogVerbose", opts, 0)
            api.call("ServerOptionsSetLogInfo", opts, C.c_bool(False))  # the startup tables would land in the service's stderr
            api.call("ServerOptionsSetMetrics", opts, C.c_bool(False))  # no metrics endpoint in-process (and no GPU probe)
            server = P()
            api.call("ServerNew", C.byref(server), opts)
        except InferenceServerException as exc:
            self._cleanup()
            raise ServerError(f"in-process Triton did not start on {self.repository}: {exc.message()}") from None
        finally:
            api.lib.TRITONSERVER_ServerOptionsDelete(opts)
        self._server = server
        for name in names:
            ready = C.c_bool()
            api.call("ServerModelIsReady", server, name.encode(), C.c_int64(-1), C.byref(ready))
            if not ready.value:
                self.stop()
                raise ServerError(f"model {name!r} did not load in the in-process Triton")
        self._allocator = P()
        api.call("ResponseAllocatorNew", C.byref(self._allocator), api.callbacks["alloc"], api.callbacks["release"], None)
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            try:
                self.api.call("ServerStop", server)
            except InferenceServerException as exc:
                log.warning("in-process Triton stop: %s", exc.message())
            self.api.lib.TRITONSERVER_ServerDelete(server)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    # -- metadata ------------------------------------------------------------------------------------------
    def _server_or_raise(self) -> P:
        if self._server is None:
            raise InferenceServerException("the in-process Triton is not running (start() it, or it was stopped)", status="StatusCode.UNAVAILABLE")
        return self._server

    def model_metadata(self, model: str) -> dict:
        message = P()
        self.api.call("ServerModelMetadata", self._server_or_raise(), model.encode(), C.c_int64(-1), C.byref(message))
        return self.api.message_json(message)

    def model_config(self, model: str) -> dict:
        message = P()
        self.api.call("ServerModelConfig", self._server_or_raise(), model.encode(), C.c_int64(-1), C.c_uint32(1), C.byref(message))
        return self.api.message_json(message)

    def is_ready(self) -> bool:
        if self._server is None:
            return False
        ready = C.c_bool()
        self.api.call("ServerIsReady", self._server, C.byref(ready))
        return ready.value

    # -- inference -------------------------------------------------------------------------------------------
    def infer(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str], timeout_us: int) -> asyncio.Future:
        """Hand one request to Triton's scheduler; the future resolves with {output name: array} on the running loop.
        Inputs are (name, Triton datatype, C-ordered array); the arrays stay referenced until Triton releases the request."""
        api, server = self.api, self._server_or_raise()
        loop = asyncio.get_running_loop()
        if _READER["loop"] is not loop:
            _watch(api, loop)
        future = loop.create_future()
        request = P()
        api.call("InferenceRequestNew", C.byref(request), server, model.encode(), C.c_int64(-1))
        key = next(_IDS)
        try:
            for name, datatype, array in inputs:
                shape = (C.c_int64 * array.ndim)(*array.shape)
                kind = api.lib.TRITONSERVER_StringToDataType(datatype.encode())
                api.call("InferenceRequestAddInput", request, name.encode(), kind, shape, C.c_uint64(array.ndim))
                api.call("InferenceRequestAppendInputData", request, name.encode(), P(array.ctypes.data), C.c_size_t(array.nbytes), _CPU, C.c_int64(0))
            for name in outputs:
                api.call("InferenceRequestAddRequestedOutput", request, name.encode())
            api.call("InferenceRequestSetTimeoutMicroseconds", request, C.c_uint64(max(int(timeout_us), 1)))
            _PENDING[key] = (loop, future, inputs)
            api.call("InferenceRequestSetReleaseCallback", request, api.callbacks["request_release"], None)
            api.call("InferenceRequestSetResponseCallback", request, self._allocator, None, api.callbacks["response_complete"], P(key))
            api.call("ServerInferAsync", server, request, None)
        except InferenceServerException:
            _PENDING.pop(key, None)
            api.lib.TRITONSERVER_InferenceRequestDelete(request)
            raise
        return future

    async def infer_within(self, model: str, inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str],
                           timeout_s: float) -> dict[str, np.ndarray]:
        """`infer`, awaited, failing with DEADLINE_EXCEEDED after `timeout_s` (also Triton's queue timeout): the call
        signature TritonClient gives every transport besides gRPC (client/http_wire.HttpWire.infer is the other)."""
        future = self.infer(model, inputs, outputs, int(timeout_s * 1e6))
        timer = asyncio.get_running_loop().call_later(timeout_s, lambda: future.done() or future.set_exception(
            InferenceServerException("Deadline Exceeded: no answer from the in-process Triton", status="DEADLINE_EXCEEDED")))
        try:
            return await future
        finally:
            timer.cancel()

    @staticmethod
    def _outputs(api: _Api, response) -> dict[str, np.ndarray]:
        lib = api.lib
        err = lib.TRITONSERVER_InferenceResponseError(P(response))
        if err:
            raise api.error(err)
        count = C.c_uint32()
        api.call("InferenceResponseOutputCount", P(response), C.byref(count))
        out = {}
        for i in range(count.value):
            name, kind, shape, dims = C.c_char_p(), C.c_int(), C.POINTER(C.c_int64)(), C.c_uint64()
            base, size, memory_type, memory_id, userp = P(), C.c_size_t(), C.c_int(), C.c_int64(), P()
            api.call("InferenceResponseOutput", P(response), C.c_uint32(i), C.byref(name), C.byref(kind), C.byref(shape), C.byref(dims),
                          C.byref(base), C.byref(size), C.byref(memory_type), C.byref(memory_id), C.byref(userp))
            dtype = np.dtype(triton_to_np_dtype(lib.TRITONSERVER_DataTypeString(kind.value).decode()))
            data = C.string_at(base, size.value) if size.value else b""
            out[name.value.decode()] = np.frombuffer(data, dtype=dtype).reshape([shape[d] for d in range(dims.value)])
        return out


# Every in-process server of this process shares the shim's one queue and eventfd: request ids are
# process-wide, and one event loop at a time drains the queue.
_PENDING: dict[int, tuple] = {}  # request id -> (loop, future, inputs kept alive until the answer)
_IDS = itertools.count(1)
_READER: dict[str, asyncio.AbstractEventLoop | None] = {"loop": None}


def _watch(api: _Api, loop: asyncio.AbstractEventLoop) -> None:
    """Drain completed responses on `loop` from now on (a loop that closed stops watching with it)."""
    old = _READER["loop"]
    if old is not None and not old.is_closed():
        try:
            old.remove_reader(api.wake_fd)
        except RuntimeError:  # that loop runs in another thread: it keeps watching too, harmlessly
            pass
    loop.add_reader(api.wake_fd, _drain, api)
    _READER["loop"] = loop


def _drain(api: _Api) -> None:
    responses, keys = (P * _DRAIN_MAX)(), (C.c_uint64 * _DRAIN_MAX)()
    n = api.shim.scorestack_drain(responses, keys, _DRAIN_MAX)
    for i in range(n):
        response, entry = responses[i], _PENDING.pop(keys[i], None)
        try:
            result: object = InProcessTriton._outputs(api, response)
        except InferenceServerException as exc:
            result = exc
        finally:
            api.lib.TRITONSERVER_InferenceResponseDelete(P(response))
        if entry is None:  # already settled, or nobody waits
            continue
        loop, future, _ = entry
        if loop is _READER["loop"]:
            _settle(future, result)
        else:
            try:
                loop.call_soon_threadsafe(_settle, future, result)
            except RuntimeError:  # that caller's loop is closed: nobody is waiting
                pass


def _build_shim() -> Path:
    """serve/inprocess_shim.c compiled once per source into the user's cache (needs gcc, as TL2cgen does)."""
    from importlib import resources

    source = (resources.files("scorestack.serve") / "inprocess_shim.c").read_text(encoding="utf-8")
    from scorestack.paths import home

    cache = home() / "inprocess"
    lib = cache / f"shim-{hashlib.sha256(source.encode()).hexdigest()[:12]}.so"
    return build_library(source, lib, error=ServerError, what="the in-process Triton's callbacks", libs=("-lpthread",))


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():  # the caller gave up (deadline) before Triton answered
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
