"""Async inference against Triton: one gRPC channel (plaintext or TLS), or the lean HTTP transport for inference;
deadlines, retries on UNAVAILABLE, checked inputs."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import grpc
import numpy as np
import tritonclient.grpc.aio as aiogrpc
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import get_error_grpc
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from scorestack import limits
from scorestack.client.admission import AdaptiveLimit, Gate, gate_for, policy_of
from scorestack.client.grpc_wire import SERIALIZED_TYPES as _SERIALIZED_TYPES
from scorestack.client.grpc_wire import GrpcWire, response_arrays
from scorestack.client.http_wire import HttpWire
from scorestack.errors import InferenceError, OverloadedError, RequestValidationError, TlsError
from scorestack.serve.security import AdminKey, ClientTls, diagnose_tls

if TYPE_CHECKING:
    from scorestack.serve.embedded import EmbeddedModels
    from scorestack.serve.inprocess import InProcessTriton

DEFAULT_DEADLINE_S = 1.0
_CHANNEL_ARGS = [
    # The request-size bound of scorestack.limits: larger messages are refused by the channel itself.
    ("grpc.max_send_message_length", limits.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str  # Triton's name: FP32, INT64, ...
    shape: tuple[int, ...]  # as the server reports it, batch dimension first when batching

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(triton_to_np_dtype(self.datatype))


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    max_batch_size: int
    parameters: dict[str, str] = field(default_factory=dict)  # config.pbtxt `parameters` (string values)
    instances: int = 1  # model instances the config declares (instance_group counts summed): executions run at once
    queue_timeout_us: int = 0  # dynamic batching's default queue timeout (0: none; a queued request is never rejected for time)


@dataclass
class InferResult:
    outputs: dict[str, np.ndarray]
    client_ms: float  # request sent -> response decoded, including retries
    attempts: int = 1


@dataclass(frozen=True)
class _Wire:
    """What `infer`'s lean path needs of a model, worked out once from its metadata."""

    inputs: tuple[tuple[str, str], ...]  # name, datatype
    outputs: dict[str, tuple[str, np.dtype]]  # name -> (datatype, dtype)
    output_names: tuple[str, ...]
    lean: bool  # every input's wire form is its raw bytes

    @classmethod
    def of(cls, info: "ModelInfo") -> "_Wire":
        return cls(
            inputs=tuple((t.name, t.datatype) for t in info.inputs),
            outputs={t.name: (t.datatype, t.dtype) for t in info.outputs if t.datatype not in _SERIALIZED_TYPES},
            output_names=tuple(t.name for t in info.outputs),
            lean=not any(t.datatype in _SERIALIZED_TYPES for t in info.inputs),
        )


def _status(exc: InferenceServerException) -> str:
    return (exc.status() or "").upper()


# Triton answers UNAVAILABLE both when it cannot be reached and when its queue policy rejects a
# request (timeout_action REJECT, max_queue_size): only the first is worth a retry.
_QUEUE_REJECTIONS = ("request timeout expired", "exceeds maximum queue size", "maximum queue size")


def _is_rejection(exc: InferenceServerException) -> bool:
    text = (exc.message() or str(exc)).lower()
    return any(s in text for s in _QUEUE_REJECTIONS)


def _mentions_tls(exc: InferenceServerException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("ssl", "tls", "handshake", "certificate"))


def _is_unavailable(exc: InferenceServerException) -> bool:
    """Triton could not be reached (callers test `_is_rejection` first: it is UNAVAILABLE too)."""
    status = _status(exc)
    text = str(exc)
    return "UNAVAILABLE" in status or "StatusCode.UNAVAILABLE" in text or "failed to connect" in text.lower()


class TritonClient:
    """One gRPC channel to Triton per process, reused by every request.

    `infer` checks names, shapes, dtypes and the size limits (scorestack.limits) against the
    model's metadata (fetched once) before sending, applies a deadline to every call, retries only
    UNAVAILABLE with jittered backoff inside that deadline, and raises InferenceError naming the model.

    With `tls` the channel is TLS (mutual when `tls` has a client certificate). A connection that
    fails at the TLS layer (plaintext against TLS or the reverse, wrong CA, expired certificate,
    missing client certificate) raises TlsError saying which, at once instead of being retried.
    `admin_key` is sent only on admin calls (`admin_headers`, e.g. statistics for diagnosis), never
    on inference.

    `max_in_flight` is admission control (client/admission.py): None (the default) sends every call;
    an int N refuses a call to a model while N of this client's calls to it are in flight; "adaptive"
    (or an AdaptiveLimit) finds the limit from the latency it observes. A refused call raises
    OverloadedError with `local` true at once and never reaches Triton. `admission(model)` reports the
    limit and counts.

    `http_url` (Triton's HTTP address, host:port) sends `infer` over the lean HTTP transport
    (client/http_wire.py: keep-alive HTTP/1.1, binary tensors; about a third of the gRPC call's cost
    from Python at concurrency 1) while metadata, readiness and admin calls stay on gRPC. Plaintext
    only: Triton's HTTP endpoint has no TLS, so it cannot be combined with `tls`.

    `lean_grpc` (the default) sends `infer` over the same gRPC protocol to the same port through
    scorestack's own HTTP/2 framing (client/grpc_wire.py: the request built once per model and
    input shapes, one connection, no grpc.aio call objects); False keeps grpc.aio for every call. TLS
    channels always use grpc.aio. Metadata, readiness and admin calls use grpc.aio in every case.

    `in_process` (a started scorestack.serve.InProcessTriton) sends `infer` and the metadata reads to
    Triton running inside this process through its C API: no network hop at all. `url` may then be
    None; with a `url`, admin and readiness calls still go there. A started
    scorestack.serve.EmbeddedModels goes there too: the compiled artifact run on the caller's thread by
    the model runtime, without Triton (checked against its reference rows in this process first).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        max_retries: int = 20,
        backoff_s: float = 0.01,
        tls: ClientTls | None = None,
        admin_key: AdminKey | None = None,
        max_in_flight: int | str | AdaptiveLimit | None = None,
        http_url: str | None = None,
        in_process: "InProcessTriton | EmbeddedModels | None" = None,
        lean_grpc: bool = True,
    ) -> None:
        if url is None and in_process is None:
            raise ValueError("url: give Triton's gRPC address (host:port), or in_process=InProcessTriton(...)")
        if http_url and in_process is not None:
            raise ValueError("http_url and in_process are two transports for the same calls: give one")
        if http_url and tls is not None:
            raise ValueError("http_url: Triton's HTTP endpoint has no TLS; with tls, inference stays on gRPC (leave http_url unset)")
        self.url = url or "in-process"
        self.http_url = http_url
        self._in_process = in_process
        self._http = HttpWire(http_url) if http_url else None
        self._wire = GrpcWire(url) if url and lean_grpc and tls is None and not http_url and in_process is None else None
        # infer's lean transport: (model, [(name, datatype, array)], outputs, timeout_s) -> {output: array}
        if self._http is not None:
            self._lean_call = self._http.infer
        elif in_process is not None:
            self._lean_call = in_process.infer_within
        else:
            self._lean_call = self._wire.infer if self._wire is not None else None
        self.transport = "http" if self._http else ("in-process" if in_process is not None else ("lean-grpc" if self._wire else "grpcio"))
        self.max_in_flight = policy_of(max_in_flight)
        self._gates: dict[str, Gate] = {}
        self.tls = tls
        self.admin_key = admin_key
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # Short reconnect backoff: after a Triton restart the channel comes back within ~0.1-1 s
        # instead of gRPC's default (1 s growing to 120 s), without rebuilding the client.
        self._client = aiogrpc.InferenceServerClient(url, channel_args=_CHANNEL_ARGS, **(tls.grpc_kwargs() if tls else {})) if url else None
        # tritonclient's gRPC stub on that channel, for `infer`'s lean path (None: a tritonclient
        # without it; `infer` then goes through tritonclient's own infer).
        self._stub = getattr(self._client, "_client_stub", None)
        self._models: dict[str, ModelInfo] = {}
        self._wires: dict[str, _Wire] = {}

    async def __aenter__(self) -> "TritonClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._wire is not None:
            await self._wire.close()
        if self._client is not None:
            await self._client.close()

    @property
    def grpc(self) -> aiogrpc.InferenceServerClient:
        if self._client is None:
            raise ValueError("this client has no gRPC address (in_process only): give url= for gRPC calls")
        return self._client

    @property
    def admin_headers(self) -> dict[str, str] | None:
        """Headers for Triton's restricted APIs (statistics, repository, ...): the admin key, if given."""
        return self.admin_key.grpc_headers if self.admin_key else None

    async def is_ready(self, timeout_s: float = 1.0) -> bool:
        if self._in_process is not None:
            return self._in_process.is_ready()
        try:
            return bool(await asyncio.wait_for(self._client.is_server_ready(client_timeout=timeout_s), timeout_s))
        except (InferenceServerException, asyncio.TimeoutError, OSError):
            return False

    async def model_info(self, model: str, *, deadline_s: float | None = None) -> ModelInfo:
        """Metadata and config of `model`, fetched once and cached."""
        if model in self._models:
            return self._models[model]
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        try:
            if self._in_process is not None:
                server = self._in_process
                meta = await self._retrying(model, deadline, lambda t: asyncio.to_thread(server.model_metadata, model))
                config = await self._retrying(model, deadline, lambda t: asyncio.to_thread(server.model_config, model))
            else:
                meta = await self._retrying(model, deadline, lambda t: self._client.get_model_metadata(model, as_json=True, client_timeout=t))
                config = await self._retrying(model, deadline, lambda t: self._client.get_model_config(model, as_json=True, client_timeout=t))
        except InferenceError as exc:
            if "unknown model" in str(exc).lower() or "not found" in str(exc).lower():
                raise InferenceError(f"model {model!r}: not served by Triton at {self.url} ({exc.__cause__ or exc})") from exc
            raise
        cfg = config.get("config", config)
        info = ModelInfo(
            name=model,
            version=str((meta.get("versions") or ["1"])[-1]),
            inputs=tuple(TensorInfo(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in meta["inputs"]),
            outputs=tuple(TensorInfo(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in meta["outputs"]),
            max_batch_size=int(cfg.get("max_batch_size", 0) or 0),
            parameters={k: str(v.get("string_value", "")) for k, v in (cfg.get("parameters") or {}).items()},
            instances=max(1, sum(int(g.get("count", 1) or 1) * max(1, len(g.get("gpus") or [])) for g in (cfg.get("instance_group") or [{}]))),
            queue_timeout_us=int(((cfg.get("dynamic_batching") or {}).get("default_queue_policy") or {}).get("default_timeout_microseconds", 0) or 0),
        )
        self._models[model] = info
        return info

    def admission(self, model: str) -> dict | None:
        """The admission state of `model` in this client (limit, in flight, admitted, refused, congestion
        seen, limit cuts), or None when no limit is set or the model was not called yet."""
        gate = self._gates.get(model)
        return gate.snapshot() if gate else None

    def _gate(self, info: ModelInfo) -> Gate | None:
        gate = self._gates.get(info.name)
        if gate is None and self.max_in_flight is not None:
            gate = self._gates[info.name] = gate_for(self.max_in_flight, queue_timeout_us=info.queue_timeout_us, instances=info.instances,
                                                     max_batch_size=info.max_batch_size, deadline_s=self.deadline_s)
        return gate

    def check_inputs(self, info: ModelInfo, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise RequestValidationError naming the tensor when inputs do not match the model."""
        expected = {t.name: t for t in info.inputs}
        for name in inputs:
            if name not in expected:
                raise RequestValidationError(name, f"model {info.name!r} has no input {name!r}; inputs are {sorted(expected)}")
        for name, tensor in expected.items():
            if name not in inputs:
                raise RequestValidationError(name, f"model {info.name!r} needs input {name!r} ({tensor.datatype} {list(tensor.shape)})")
            array = inputs[name]
            if not isinstance(array, np.ndarray):
                raise RequestValidationError(name, f"must be a numpy array, got {type(array).__name__}")
            if array.dtype != tensor.dtype:
                raise RequestValidationError(name, f"dtype {array.dtype} does not match model {info.name!r} ({tensor.datatype}); cast with .astype({tensor.dtype.name})")
            if array.ndim != len(tensor.shape) or any(w not in (-1, g) for w, g in zip(tensor.shape, array.shape)):
                raise RequestValidationError(name, f"shape {list(array.shape)} does not match model {info.name!r} ({list(tensor.shape)}, -1 = any)")
            if info.max_batch_size and array.shape[0] > info.max_batch_size:
                raise RequestValidationError(name, f"batch of {array.shape[0]} exceeds model {info.name!r} max_batch_size {info.max_batch_size}; split it")
            if info.max_batch_size and array.ndim:
                limits.check_rows(int(array.shape[0]), what=name)
            limits.check_tensor_bytes(name, int(array.nbytes))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> InferResult:
        """Run `model` on `inputs` (name -> array) within the deadline.

        The remaining deadline also goes to Triton as the request's queue timeout: Triton takes it
        only when it is shorter than the model's own (`allow_timeout_override` can tighten, never
        extend), so the server drops requests whose caller has already given up instead of
        computing them.
        """
        start = time.perf_counter()
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        info = self._models.get(model) or await self.model_info(model, deadline_s=deadline_s)
        wire = self._wires.get(model)
        if wire is None:
            wire = self._wires[model] = _Wire.of(info)
        self.check_inputs(info, inputs)
        gate = self._gate(info)
        if gate is None:
            return await self._infer(model, info, wire, inputs, outputs, deadline, start)
        if not gate.try_acquire():
            raise OverloadedError(
                f"model {model!r}: refused by this client's admission control before sending: {gate.in_flight} of its calls "
                f"to the model are in flight (limit {int(gate.limit)}, {'adaptive' if gate.adaptive else 'max_in_flight'}); "
                "the server is at its capacity for this client: send less load, add instances or replicas, or raise max_in_flight",
                local=True,
            )
        in_flight, admitted = gate.in_flight, time.monotonic()
        outcome = "other"
        try:
            result = await self._infer(model, info, wire, inputs, outputs, deadline, start)
            outcome = "ok"
            return result
        except OverloadedError:
            outcome = "shed"
            raise
        except InferenceError as exc:
            if "deadline exceeded" in str(exc) or "within the deadline" in str(exc):
                outcome = "shed"
            raise
        finally:
            gate.release(time.monotonic() - admitted, outcome, in_flight)

    async def _infer(self, model: str, info: ModelInfo, wire: _Wire, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None,
                     deadline: float, start: float) -> InferResult:
        wanted = list(outputs) if outputs is not None else list(wire.output_names)
        attempts = 0
        if self._lean_call is not None and wire.lean:
            # The lean gRPC wire, Triton's HTTP endpoint or the in-process server: one call signature,
            # each bounding the call by itself.
            arrays = [(name, datatype, np.ascontiguousarray(inputs[name])) for name, datatype in wire.inputs]

            async def call(timeout: float):
                nonlocal attempts
                attempts += 1
                return await self._lean_call(model, arrays, wanted, timeout)

            out = await self._retrying(model, deadline, call, guard=False)
        elif self._stub is not None and wire.lean:
            # The lean path: the request message built here in one pass, sent on tritonclient's own
            # stub and channel (tritonclient's InferInput + set_data_from_numpy and its request
            # builder cost 15 + 11 µs of client CPU per call, measured in-process).
            request = service_pb2.ModelInferRequest(model_name=model)
            for name, datatype in wire.inputs:
                array = inputs[name]
                request.inputs.add(name=name, datatype=datatype, shape=array.shape)
                request.raw_input_contents.append(array.tobytes())  # tobytes copies C-ordered
            for n in wanted:
                request.outputs.add(name=n)
            metadata = self._client._get_metadata(None)

            async def call(timeout: float):
                nonlocal attempts
                attempts += 1
                request.parameters["timeout"].int64_param = max(int(timeout * 1e6), 1)
                try:
                    return await self._stub.ModelInfer(request=request, metadata=metadata, timeout=timeout)
                except grpc.RpcError as rpc_error:
                    raise get_error_grpc(rpc_error) from None

            # gRPC's own deadline bounds the call, connecting included (test_triton_paused_...):
            # no asyncio timeout around it (one per call cost ~35 µs at concurrency 1).
            response = await self._retrying(model, deadline, call, guard=False)
            out = response_arrays(response, wanted, wire.outputs)
        else:
            request_inputs = []
            for t in info.inputs:
                array = inputs[t.name]
                inp = aiogrpc.InferInput(t.name, list(array.shape), t.datatype)
                inp.set_data_from_numpy(array)
                request_inputs.append(inp)
            request_outputs = [aiogrpc.InferRequestedOutput(n) for n in wanted]

            async def call(timeout: float):
                nonlocal attempts
                attempts += 1
                return await self._client.infer(
                    model, request_inputs, outputs=request_outputs, client_timeout=timeout, timeout=max(int(timeout * 1e6), 1)
                )

            result = await self._retrying(model, deadline, call)
            out = {n: result.as_numpy(n) for n in wanted}
        for n, value in out.items():
            if value is None:
                raise InferenceError(f"model {model!r}: response has no output {n!r}")
        return InferResult(out, (time.perf_counter() - start) * 1e3, attempts)

    async def _tls_problem(self, deadline: float) -> str | None:
        """After a connection failure: is it TLS (and which), or a server that is down? Bounded by the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0.01 or self._client is None:
            return None
        return await asyncio.to_thread(diagnose_tls, self.url, self.tls, min(remaining, 1.0))

    async def _retrying(self, model: str, deadline: float, call, *, guard: bool = True):
        """`call(remaining_s)` until it answers, retrying UNAVAILABLE within the deadline. `guard`
        also bounds each call with an asyncio timeout (for calls whose own timeout is not gRPC's)."""
        attempt = 0
        last: str = ""
        probed = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceError(
                    f"model {model!r}: deadline exceeded before a response from Triton at {self.url}"
                    + (f" (after {attempt} retries; last error: {last})" if last else "")
                )
            try:
                if not guard:
                    return await call(remaining)
                # The timeout bounds the call even if the channel is stuck connecting. asyncio.timeout
                # runs the call in this task; wait_for wrapped each call in a new task (~25 µs a call).
                async with asyncio.timeout(remaining + 0.05):
                    return await call(remaining)
            except TimeoutError as exc:
                raise InferenceError(f"model {model!r}: no response from Triton at {self.url} within the deadline") from exc
            except InferenceServerException as exc:
                if _is_rejection(exc):
                    raise OverloadedError(
                        f"model {model!r}: rejected by Triton's queue policy ({exc.message()}): the request "
                        "waited past the model's queue timeout or the queue was full; add instances, raise "
                        "the spec's latency budget, or send less load"
                    ) from exc
                if not probed and (_is_unavailable(exc) or _mentions_tls(exc)):
                    # Once per call: a TLS mismatch never heals by retrying; a restarting server does.
                    probed = True
                    problem = await self._tls_problem(deadline)
                    if problem:
                        raise TlsError(f"model {model!r}: {problem}") from exc
                if _is_unavailable(exc) and attempt < self.max_retries:
                    attempt += 1
                    last = exc.message() or str(exc)
                    # Jittered exponential backoff, capped, and never past the deadline.
                    backoff = min(self.backoff_s * (2 ** (attempt - 1)), 0.2) * (0.5 + random.random())
                    sleep = min(backoff, max(0.0, deadline - time.monotonic()))
                    await asyncio.sleep(sleep)
                    continue
                if "DEADLINE_EXCEEDED" in _status(exc) or "Deadline Exceeded" in str(exc):
                    raise InferenceError(f"model {model!r}: deadline exceeded waiting for Triton at {self.url}") from exc
                if _is_unavailable(exc):
                    raise InferenceError(f"model {model!r}: Triton at {self.url} unavailable after {attempt + 1} attempts: {exc.message()}") from exc
                raise InferenceError(f"model {model!r}: {exc.message()}") from exc
