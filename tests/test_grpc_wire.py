"""The lean gRPC transport (client/grpc_wire.py) against a real Triton: the bytes it sends are the
message tritonclient builds, answers equal grpc.aio's, large bodies cross HTTP/2's flow control both
ways, many calls share one connection, and errors come back with gRPC's status and Triton's message."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import hpack
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from conftest import LocalTriton
from scorestack.client import grpc_wire
from scorestack.client.grpc_wire import GrpcWire
from scorestack.client.triton import TritonClient
from scorestack.errors import InferenceError
from scorestack.serve.ports import free_port

WIDE = 65_536  # floats per row: 256 KiB a row, so 24 rows are 6 MiB, past the 4 MiB window Triton's gRPC server grants
CONFIG = f"""
name: "echo"
backend: "onnxruntime"
max_batch_size: 32
input [{{ name: "x" data_type: TYPE_FP32 dims: [{WIDE}] }}]
output [{{ name: "y" data_type: TYPE_FP32 dims: [{WIDE}] }}]
instance_group [{{ count: 1 kind: KIND_CPU }}]
"""
SMALL = """
name: "affine"
backend: "onnxruntime"
max_batch_size: 64
input [{ name: "x" data_type: TYPE_FP32 dims: [4] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [4] }]
dynamic_batching { }
instance_group [{ count: 2 kind: KIND_CPU }]
"""


def _model(width: int, scale: float) -> bytes:
    """y = x * scale + 1: an answer that differs from its input and from any other row's."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, width])
    nodes = [helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Add", ["m", "one"], ["y"])]
    init = [helper.make_tensor("s", TensorProto.FLOAT, [1], [scale]), helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])]
    graph = helper.make_graph(nodes, "affine", [x], [y], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wire_repo")
    for name, config, width, scale in (("echo", CONFIG, WIDE, 2.0), ("affine", SMALL, 4, 3.0)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.onnx").write_bytes(_model(width, scale))
        (root / name / "config.pbtxt").write_text(config)
        onnx.checker.check_model(onnx.load(str(root / name / "1" / "model.onnx")))
    return root


@pytest.fixture(scope="module")
def server(repo, server_environment):
    with LocalTriton(repo, server_env=server_environment) as s:
        yield s


def test_the_request_is_the_message_tritonclient_builds():
    """Head, queue timeout and raw tensors, concatenated field by field, parse as the message built with protobuf."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([[7], [8], [9]], dtype=np.int64)
    inputs = [("x", "FP32", a), ("ids", "INT64", b)]
    for timeout_s in (0.000_000_1, 0.25, 3600.0):
        data = grpc_wire.request_head("m", [(n, d, x.shape) for n, d, x in inputs], ["y", "z"])
        data += grpc_wire.timeout_parameter(timeout_s) + b"".join(grpc_wire.raw_contents(x.tobytes()) for _, _, x in inputs)
        want = service_pb2.ModelInferRequest(model_name="m")
        for n, d, x in inputs:
            want.inputs.add(name=n, datatype=d, shape=x.shape)
            want.raw_input_contents.append(x.tobytes())
        want.outputs.add(name="y")
        want.outputs.add(name="z")
        want.parameters["timeout"].int64_param = max(int(timeout_s * 1e6), 1)
        assert service_pb2.ModelInferRequest.FromString(data) == want


def test_the_header_block_is_a_grpc_call():
    authority = b"10.0.0.7:8001"
    for timeout_s, value in ((0.5, b"500000u"), (99.0, b"99000000u"), (1000.0, b"1000000m")):
        assert grpc_wire.grpc_timeout(timeout_s) == value
        block = grpc_wire.request_headers(authority) + grpc_wire._literal(b"grpc-timeout", value)
        assert hpack.Decoder().decode(block) == [
            (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", authority.decode()), ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-timeout", value.decode()),
        ]
    long = b"a" * 300  # lengths past HPACK's 7-bit prefix
    assert hpack.Decoder().decode(grpc_wire._literal(1, long)) == [(":authority", long.decode())]


def test_answers_equal_grpc_aio_and_the_model(loop, server):
    """Same server, both clients: equal outputs for lone rows and batches, and y = 3x + 1."""
    rng = np.random.default_rng(3)

    async def run():
        lean, aio = TritonClient(server.grpc_url), TritonClient(server.grpc_url, lean_grpc=False)
        assert (lean.transport, aio.transport) == ("lean-grpc", "grpcio")
        try:
            for n in (1, 5, 64):
                x = rng.normal(size=(n, 4)).astype(np.float32)
                got = (await lean.infer("affine", {"x": x})).outputs["y"]
                np.testing.assert_array_equal(got, (await aio.infer("affine", {"x": x})).outputs["y"])
                np.testing.assert_allclose(got, x * 3 + 1, rtol=1e-6)
        finally:
            await lean.close()
            await aio.close()

    loop.run_until_complete(run())


def test_many_calls_share_one_connection_and_each_gets_its_own_answer(loop, server):
    """300 calls at once on one HTTP/2 connection (Triton batches them): every answer is its own row's;
    the server's header blocks were decoded once each and then read from the cache."""
    x = np.arange(300 * 4, dtype=np.float32).reshape(300, 1, 4)

    async def run():
        wire = GrpcWire(server.grpc_url)
        try:
            answers = await asyncio.gather(*(wire.infer("affine", [("x", "FP32", row)], ["y"], 10.0) for row in x))
            conn = wire._conn
            assert conn.next_id == 1 + 2 * 300 and not conn.streams
            assert conn.decoder.header_table.maxsize == 0 and 1 <= len(conn.blocks) <= 3
            return answers
        finally:
            await wire.close()

    answers = loop.run_until_complete(run())
    for row, answer in zip(x, answers):
        np.testing.assert_allclose(answer["y"], row * 3 + 1, rtol=1e-6)


def test_bodies_past_the_flow_control_windows_arrive_whole(loop, server):
    """A 6 MiB request as the first call (before Triton's SETTINGS raise the 64 KiB default window) and
    again after (past the 4 MiB window it grants), then 3 at once, all in frames of at most the server's
    size; each 6 MiB answer (many DATA frames) is exactly 2x + 1."""
    rng = np.random.default_rng(4)
    x = rng.integers(-1000, 1000, size=(3, 24, WIDE)).astype(np.float32)  # integers: 2x + 1 is exact in float32

    async def run():
        wire = GrpcWire(server.grpc_url)
        try:
            first = await wire.infer("echo", [("x", "FP32", x[0])], ["y"], 30.0)
            again = await wire.infer("echo", [("x", "FP32", x[1])], ["y"], 30.0)
            many = await asyncio.gather(*(wire.infer("echo", [("x", "FP32", rows)], ["y"], 60.0) for rows in x))
            assert wire._conn.initial_window > 65_535 and not wire._conn.streams
            return [first, again, *many]
        finally:
            await wire.close()

    first, again, *many = loop.run_until_complete(run())
    np.testing.assert_array_equal(first["y"], x[0] * 2 + 1)
    np.testing.assert_array_equal(again["y"], x[1] * 2 + 1)
    for rows, answer in zip(x, many):
        np.testing.assert_array_equal(answer["y"], rows * 2 + 1)


def test_triton_errors_keep_their_grpc_status_and_message(loop, server):
    x = np.zeros((1, 4), dtype=np.float32)

    async def run():
        wire = GrpcWire(server.grpc_url)
        try:
            cases = [("nope", "x", x, "NOT_FOUND", "unknown model"), ("affine", "nope", x, "INVALID_ARGUMENT", "unexpected inference input 'nope'"),
                     ("affine", "x", np.zeros((1, 3), np.float32), "INVALID_ARGUMENT", "unexpected shape for input 'x'")]
            for model, name, array, status, text in cases:
                with pytest.raises(InferenceServerException, match=text) as err:
                    await wire.infer(model, [(name, "FP32", array)], ["y"], 5.0)
                assert err.value.status() == f"StatusCode.{status}"
            # The connection survives a failed call.
            ok = await wire.infer("affine", [("x", "FP32", x)], ["y"], 5.0)
            np.testing.assert_array_equal(ok["y"], x + 1)
        finally:
            await wire.close()
        client = TritonClient(server.grpc_url)
        try:
            with pytest.raises(InferenceError, match="model 'nope'"):
                await client.infer("nope", {"x": x})
        finally:
            await client.close()

    loop.run_until_complete(run())


def test_no_server_and_a_server_that_is_not_grpc_end_within_the_deadline(loop):
    """Nothing listening: UNAVAILABLE (the client retries it within the deadline, then names it). A peer
    that accepts and answers HTTP/1.1 garbage: the call ends at its deadline or when the peer hangs up."""
    x = np.zeros((1, 4), dtype=np.float32)

    async def junk(reader, writer):
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    async def run():
        dead = GrpcWire(f"127.0.0.1:{free_port()}")
        with pytest.raises(InferenceServerException, match="failed to connect") as err:
            await dead.infer("affine", [("x", "FP32", x)], ["y"], 1.0)
        assert err.value.status() == "StatusCode.UNAVAILABLE"
        client = TritonClient(dead.address, deadline_s=0.3)
        start = time.monotonic()
        with pytest.raises(InferenceError, match="model 'affine'.*(unavailable|deadline)"):
            await _infer_unchecked(client, x)
        assert time.monotonic() - start < 5.0  # generous: the point is no hang
        await client.close()

        srv = await asyncio.start_server(junk, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        wire = GrpcWire(f"127.0.0.1:{port}")
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as err:
            await wire.infer("affine", [("x", "FP32", x)], ["y"], 0.5)
        assert err.value.status() in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.INTERNAL", "StatusCode.UNAVAILABLE")
        assert time.monotonic() - start < 5.0
        await wire.close()
        srv.close()
        await srv.wait_closed()
        await asyncio.sleep(0.05)  # the handler sees the hang-up and ends

    loop.run_until_complete(run())


async def _infer_unchecked(client: TritonClient, x: np.ndarray):
    """`infer` without a server to read the model's metadata from: the lean call itself, through the client's retries."""
    arrays = [("x", "FP32", x)]
    return await client._retrying("affine", time.monotonic() + client.deadline_s, lambda t: client._wire.infer("affine", arrays, ["y"], t), guard=False)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
