"""Triton settings measured, not only derived (serving.batching: auto).

The derived dynamic batching and no batching, each in a model folder of its own, loaded side by side in
one local Triton and measured in interleaved rounds: one caller sending requests of one row back to back,
the alternatives taking turns request by request (the quiet hour's latency), then `serving.concurrency`
callers (the peak). Requests are
prebuilt ModelInferRequest bytes on one gRPC channel, so the client costs the same for both and little.
No batching is emitted only when it is faster at one caller and costs the server no more CPU per request
at the peak (within NO_LOSS), without errors: the batcher's hand-off costs every lone request, and what
its batches save shows only under load (on a fast model, often not even there). The peak is judged by
the server's CPU per request (tritonserver's own CPU time over the window / requests), not by the rate:
from a Python client on the same cores the rate is mostly the client's, and choices made on it flipped
between compiles of the same model.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .report import TritonSettings

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
ROUNDS = 3
LONE_REQUESTS = 1000  # per round and alternative, after WARMUP, the alternatives taking turns call by call
WARMUP = 30
PEAK_SECONDS = 2.0  # per round, after PEAK_WARMUP_S
PEAK_WARMUP_S = 0.2
# No batching must serve at least this share of the batching's peak rate: within run-to-run noise on a shared
# machine, a smaller rate is not a loss worth the lone request's extra latency; below it, batching stays.
NO_LOSS = 0.97


def choose(dynamic: dict, none: dict) -> bool:
    """True when no batching is faster for a lone request and costs no more server CPU per request at the peak
    (within NO_LOSS), without errors."""
    return (none["errors"] == 0 and none["c1_p50_ms"] < dynamic["c1_p50_ms"]
            and none["server_cpu_us"] * NO_LOSS <= dynamic["server_cpu_us"])


def measure_batching(
    version_dir: Path,
    name: str,
    configs: dict[str, mc.ModelConfig],
    rows: np.ndarray,
    concurrency: int,
    *,
    rounds: int = ROUNDS,
    ready_timeout_s: float = 120.0,
) -> dict[str, dict]:
    """Each alternative of `configs` (label -> model config) served from a copy of `version_dir` in one local
    Triton; medians over `rounds` interleaved rounds of the lone-request latency and the peak rate."""
    from scorestack.serve import LocalTriton
    from scorestack.triton_config import format_config

    with tempfile.TemporaryDirectory(prefix=f"scorestack-tune-{name}-") as tmp:
        repo = Path(tmp)
        models = {}
        for i, (label, cfg) in enumerate(configs.items()):
            model = f"{name}__alt{i}"
            folder = repo / model
            shutil.copytree(version_dir, folder / version_dir.name)
            c = mc.ModelConfig()
            c.CopyFrom(cfg)
            c.name = model
            c.ClearField("version_policy")  # the one version copied here
            (folder / "config.pbtxt").write_text(format_config(c))
            models[label] = (model, c)
        with LocalTriton(repo, models=[m for m, _ in models.values()], ready_timeout_s=ready_timeout_s, exit_timeout_s=0) as server:
            runs = asyncio.run(_rounds(server.grpc_url, models, rows, concurrency, rounds, server.process.pid))
    out = {}
    for label, (_, cfg) in models.items():
        got = runs[label]
        out[label] = {
            "name": label, "instances": sum(g.count for g in cfg.instance_group), "concurrency": concurrency, "rounds": rounds,
            "c1_p50_ms": statistics.median(r["c1_p50_ms"] for r in got), "c1_p99_ms": statistics.median(r["c1_p99_ms"] for r in got),
            "rate": statistics.median(r["rate"] for r in got), "p99_ms": statistics.median(r["p99_ms"] for r in got),
            "server_cpu_us": statistics.median(r["server_cpu_us"] for r in got), "errors": sum(r["errors"] for r in got), "chosen": False,
        }
    return out


def _cpu_s(pid: int) -> float:
    """tritonserver's CPU time so far (user + system, its threads; /proc/<pid>/stat fields 14 and 15)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _rounds(url: str, models: dict[str, tuple[str, mc.ModelConfig]], rows: np.ndarray, concurrency: int, rounds: int,
                  pid: int) -> dict[str, list[dict]]:
    import grpc

    out: dict[str, list[dict]] = {label: [] for label in models}
    async with grpc.aio.insecure_channel(url) as channel:
        call = channel.unary_unary(GRPC_INFER)
        payloads = {label: [_request(model, cfg, row) for row in rows[:64]] for label, (model, cfg) in models.items()}
        for r in range(rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            lone = await _lone(call, {label: payloads[label] for label in order})
            for label in order:
                out[label].append({**lone[label], **await _peak(call, payloads[label], concurrency, pid)})
    return out


def _request(model: str, cfg: mc.ModelConfig, row: np.ndarray) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    from tritonclient.utils import triton_to_np_dtype

    inp = cfg.input[0]
    datatype = mc.DataType.Name(inp.data_type).removeprefix("TYPE_")
    x = np.ascontiguousarray(row, dtype=triton_to_np_dtype(datatype))[None, ...]
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=inp.name, datatype=datatype, shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


async def _lone(call: Callable, payloads: dict[str, list[bytes]]) -> dict[str, dict]:
    """One caller, the alternatives taking turns request by request: each pair shares the moment, so the
    machine's drift and another process's bursts hit both alike (a ~0.04 ms difference stays visible)."""
    lone: dict[str, list[float]] = {label: [] for label in payloads}
    for i in range(-WARMUP, LONE_REQUESTS):
        for label, ps in payloads.items():
            t = time.perf_counter()
            await call(ps[i % len(ps)], timeout=10.0)
            if i >= 0:
                lone[label].append((time.perf_counter() - t) * 1e3)
    return {label: {"c1_p50_ms": float(np.percentile(v, 50)), "c1_p99_ms": float(np.percentile(v, 99))} for label, v in lone.items()}


async def _peak(call: Callable, payloads: list[bytes], concurrency: int, pid: int) -> dict:
    lat: list[float] = []
    errors = 0
    cpu: list[float] = []
    start = time.monotonic()
    w0, w1 = start + PEAK_WARMUP_S, start + PEAK_WARMUP_S + PEAK_SECONDS

    async def caller(k: int) -> None:
        nonlocal errors
        i = k
        while (t0 := time.monotonic()) < w1:
            if t0 >= w0 and not cpu:
                cpu.append(_cpu_s(pid))
            try:
                await call(payloads[i % len(payloads)], timeout=10.0)
            except Exception:  # a rejection or a deadline: counted, and the alternative is not chosen
                errors += t0 >= w0
                continue
            if t0 >= w0:
                lat.append((time.monotonic() - t0) * 1e3)
            i += concurrency

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    server_s = _cpu_s(pid) - cpu[0] if cpu else float("nan")
    return {"server_cpu_us": 1e6 * server_s / max(len(lat) + errors, 1), "rate": len(lat) / PEAK_SECONDS,
            "p99_ms": float(np.percentile(lat, 99)) if lat else float("nan"), "errors": errors}


def settle(settings: TritonSettings, without: TritonSettings, measured: dict[str, dict]) -> TritonSettings:
    """The settings to emit from the measurements of `settings` ("dynamic batching") and `without` ("no batching")."""
    dynamic, none = measured["dynamic batching"], measured["no batching"]
    pick_none = choose(dynamic, none)
    (none if pick_none else dynamic)["chosen"] = True
    chosen = without if pick_none else settings
    verdict = (
        f"measured in the local Triton ({dynamic['rounds']} interleaved rounds, medians): dynamic batching {dynamic['c1_p50_ms']:.3f} ms "
        f"for a lone request; {dynamic['rate']:,.0f} req/s and {dynamic['server_cpu_us']:.0f} µs of server CPU per request at {dynamic['concurrency']} "
        f"callers ({dynamic['errors']} errors); no batching {none['c1_p50_ms']:.3f} ms; {none['rate']:,.0f} req/s and {none['server_cpu_us']:.0f} µs "
        f"({none['errors']} errors): "
        + ("no batching is faster alone and costs the server no more per request at the peak, so it is emitted (serving.batching: auto)." if pick_none else
           "no batching is not both faster alone and as cheap per request at the peak (within "
           f"{1 / NO_LOSS - 1:.0%}) without errors, so the dynamic batching stays (serving.batching: auto).")
    )
    return chosen.model_copy(update={"rules": [*chosen.rules, verdict], "measured": [dynamic, none]})
