"""Emission: derive Triton settings from the budget and the measurements, and write the model folder."""

from __future__ import annotations

import importlib.machinery
import math
import shutil
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from scorestack import schema
from scorestack.serve import native, runtime_files
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.triton_config import format_config, parse_config

from .convert_tensorrt import ORT_TENSORRT_FORMAT, ORT_TENSORRT_PARAMETERS
from .dispatch import dispatch_parameter
from .profile import BatchProfile
from .registry import Artifact
from .report import TritonSettings
from .spec import ModelSpec

# gRPC round trip of the local Triton at batch 1 without model work (docs/platform-notes.md: 0.44-0.57 ms).
SERVER_OVERHEAD_US = 500
# Triton's dynamic batcher forms a batch from the requests already queued whenever an instance is
# free, so with no queue delay batches still form under load while a lone request runs at once.
# A delay is paid in full by every lone request: 200 µs cost +0.3-0.7 ms p50 at concurrency 1 and
# bought no measurable throughput at 64 concurrent on 2 cores (benchmarks/results/request_path.md).
MAX_QUEUE_DELAY_US = 0
MAX_INSTANCES = 4
# With a queue policy, Triton 2.51's batcher does not pre-fetch: it hands a batch only to an instance already
# waiting for one, and when none is, it waits on a condition variable that an instance going idle never
# signals (core: dynamic_batch_scheduler.cc WaitForPayloadSlotAvailable; the rate limiter notifies the
# batcher when a payload is dequeued, not when an instance becomes free), so only the next arrival or a
# 500 ms timer wakes it. Twice the instances that run at once keep one waiting. Measured with h2load's
# closed loop against the compiled fraud model (benchmarks/results/instances.md): 2 instances on 2 cores
# held requests ~500 ms in 5 of 6 points, 4 instances in none.
POLICY_INSTANCE_FACTOR = 2
MAX_QUEUE_SIZE = 65536


# A profile whose executions joined fewer requests than this on average shows the batcher rarely had
# two requests to join (reported with the settings; the delay is 0 either way).
MIN_JOINED_REQUESTS = 1.1


def derive_settings(spec: ModelSpec, latency_us: dict[int, float], threads: int, cpus: int, gpu: bool = False, profile: BatchProfile | None = None) -> TritonSettings:
    """Triton's batching, queue and instance settings from the spec's budget, the selected artifact's
    timings and, when given, the batch profile of the served model."""
    budget = spec.serving.latency_budget_ms * 1000.0
    max_batch = spec.serving.max_batch
    t_max = latency_us[max_batch]
    running = 1 if gpu else max(1, min(MAX_INSTANCES, cpus // threads))
    instances = running * POLICY_INSTANCE_FACTOR if spec.serving.queue_policy and not gpu else running
    slack = budget - SERVER_OVERHEAD_US - t_max
    delay = MAX_QUEUE_DELAY_US
    profile_rule = None
    if profile is not None:
        joined = profile.requests_per_execution
        if joined < MIN_JOINED_REQUESTS:
            profile_rule = (
                f"batch profile: {joined:.2f} requests per execution (< {MIN_JOINED_REQUESTS}): the batcher almost never had requests "
                f"to join; the queue delay stays {delay} µs (a lone request never waits for company)."
            )
        else:
            profile_rule = (
                f"batch profile: {joined:.2f} requests per execution: the batcher joins what queued while the instances were busy; "
                f"the queue delay stays {delay} µs."
            )
    timeout = int(max(delay + 100, slack))
    drains = max(1, math.floor(timeout / max(t_max, 1.0)))
    queue = int(min(MAX_QUEUE_SIZE, max(max_batch, running * drains * max_batch)))
    rules = [
        f"max_batch_size = serving.max_batch_size (default: the largest expected batch size) = {max_batch}.",
        f"instances that run at once = min({MAX_INSTANCES}, CPUs {cpus} // threads per instance {threads}) = {running}"
        + (" (GPU: one instance per device)" if gpu else "")
        + (f"; instance_group count = {POLICY_INSTANCE_FACTOR} × {running} = {instances}: with the queue policy Triton 2.51's "
           "batcher hands work only to an instance already waiting, and an instance going idle does not wake it (the next "
           "arrival or 500 ms does), so the extra instances keep one waiting (benchmarks/results/instances.md)"
           if instances != running else f"; instance_group count = {instances}")
        + "; threads per instance = the lowest weighted latency among the spec's thread counts whose capacity "
        "(instances × best rows/s) is within 90% of the best (compile/measure.choose_threads).",
        f"slack = budget {budget:.0f} µs − server overhead {SERVER_OVERHEAD_US} µs (gRPC floor, docs/platform-notes.md) − "
        f"model time at batch {max_batch} {t_max:.0f} µs = {slack:.0f} µs.",
        f"max_queue_delay_microseconds = {delay}: Triton forms a batch from the requests already queued whenever an instance "
        "is free, so batches form under load while a lone request runs at once; a delay is paid in full by every lone request "
        "(200 µs: +0.3-0.7 ms p50 at concurrency 1, no measurable gain at 64 concurrent; benchmarks/results/request_path.md).",
    ]
    policy_rules = [
        f"default_timeout_microseconds = max(queue delay + 100, slack) = {timeout}: a request queued longer cannot meet "
        "its budget, so it is rejected (timeout_action REJECT) instead of served late; clients may shorten it.",
        f"max_queue_size = instances that run at once × ⌊timeout / model time at max batch⌋ × max batch = {running} × {drains} × {max_batch}, "
        f"clamped to [{max_batch}, {MAX_QUEUE_SIZE}] = {queue}: no more than can drain within the timeout.",
    ]
    if spec.serving.queue_policy:
        rules += policy_rules
        rules.append(
            "queue policy on (serving.queue_policy: true, the default): Triton 2.51's batcher then does not pre-fetch, and when every "
            "instance is busy it is not woken by the one that frees up and holds requests until the next arrival or ~500 ms, which the "
            "timeout then rejects (hence the extra instances above; benchmarks/results/queue_policy.md, instances.md); without a policy, overload would queue until the callers' deadlines, "
            "and a burst of cancelled calls crashed Triton 2.51's gRPC frontend."
        )
    else:
        rules.append(
            f"no queue policy (serving.queue_policy: false; it would be a timeout of {timeout} µs and a queue of {queue}): the batcher "
            "pre-fetches and never holds requests for a missed wake-up, but nothing sheds overload in the server: requests queue until "
            "the callers' deadlines, and on Triton 2.51 a burst of cancelled calls crashed its gRPC frontend (benchmarks/results/queue_policy.md)."
        )
    if profile_rule is not None:
        rules.append(profile_rule)
    if slack <= 0:
        rules.append(f"WARNING: the model alone needs {t_max:.0f} µs at batch {max_batch}, over the budget of {budget:.0f} µs with server overhead.")
    settings = TritonSettings(
        max_batch_size=max_batch,
        max_queue_delay_us=delay,
        default_timeout_us=timeout,
        max_queue_size=queue,
        instance_count=instances,
        instance_kind="KIND_GPU" if gpu else "KIND_CPU",
        threads=threads,
        rules=rules,
        queue_policy=spec.serving.queue_policy,
    )
    if spec.serving.batching == "none":
        return without_batching(settings, running, "serving.batching: none")
    return settings


def without_batching(settings: TritonSettings, running: int, why: str) -> TritonSettings:
    """The same settings with no dynamic batcher: each request is its own execution, on the instances that run
    at once (no extra instances: they kept the queue policy's batcher awake, and there is no batcher)."""
    dropped = ("instances that run at once", "max_queue_delay_microseconds", "default_timeout_microseconds", "max_queue_size", "queue policy", "no queue policy", "batch profile")
    rules = [r for r in settings.rules if not r.startswith(dropped)]
    rules.append(
        f"instance_group count = the instances that run at once = {running} (threads per instance {settings.threads}: the lowest "
        "weighted latency among the spec's thread counts whose capacity is within 90% of the best, compile/measure.choose_threads)."
    )
    rules.append(
        f"no dynamic batching ({why}): each request is its own execution on one of {running} instances, without the batcher's "
        "hand-off; Triton 2.51's queue policy belongs to the dynamic batcher, so none is set: overload is bounded in the client "
        "(TritonClient(max_in_flight=...), docs/client.md#admission-control)."
    )
    return settings.model_copy(update={"dynamic_batching": False, "queue_policy": False, "instance_count": running, "rules": rules})


def input_contract(spec: ModelSpec) -> tuple[str, int, list[int]]:
    """The input tensor's name, Triton data type and per-row dims: FP32 `features` [n] or UINT8 `images` [H, W, C] / [C, H, W]."""
    image = spec.inputs.image
    if spec.is_vision and image is not None:
        return schema.IMAGE_INPUT_TENSOR, mc.TYPE_UINT8, list(image.shape)
    return schema.INPUT_TENSOR, mc.TYPE_FP32, [spec.n_features]


def native_backend(spec: ModelSpec, artifact: Artifact, settings: TritonSettings) -> tuple[str | None, str]:
    """`native.BACKEND` when scorestack's native backend can serve `artifact` (None when not), and
    the rule that says why.

    The native backend reads the same parameters as the Python runtime (build_config writes them
    once, the dispatch plan through dispatch.dispatch_parameter), so choosing it changes only the
    config's `backend`."""
    runtimes = [(b.runtime, b.format) for b in artifact.bands] if artifact.bands else [(artifact.runtime, artifact.format)]
    other = f"backend = {artifact.backend}"
    if not spec.serving.native_backend:
        return None, f"{other}: serving.native_backend is false."
    others = sorted({fmt for runtime, fmt in runtimes if runtime not in native.RUNTIMES})
    if others:
        return None, f"{other}: scorestack's native backend serves TL2cgen, tree-kernel and linear-kernel libraries only, and {', '.join(others)} is selected."
    if settings.instance_kind != "KIND_CPU":
        return None, f"{other}: scorestack's native backend runs on CPU instances ({settings.instance_kind})."
    try:
        native.library()
    except native.NativeBackendUnavailable as exc:
        return None, f"{other}: {exc}."
    return native.BACKEND, (
        f"backend = {native.BACKEND} (native, {native.LIBRARY} in the version folder): the selected libraries are called on "
        "Triton's instance threads, without the Python backend's round trip to a stub process; serving.native_backend: false "
        "serves them through the Python backend instead."
    )


def build_config(spec: ModelSpec, artifact: Artifact, settings: TritonSettings, n_outputs: int, native_plan: str | None = None) -> mc.ModelConfig:
    """The production config.pbtxt (the contract with the serving stage). `native_plan` is what
    native_backend returned: when not None, scorestack's native backend serves the artifact, from
    the same parameters the Python runtime reads."""
    cfg = mc.ModelConfig(name=spec.name, max_batch_size=settings.max_batch_size)
    if native_plan is not None:
        cfg.backend = native.BACKEND
    elif artifact.backend == "onnxruntime":
        cfg.backend = "onnxruntime"
        cfg.default_model_filename = artifact.artifact_name
    elif artifact.backend == "tensorrt":
        # A serialized engine is Triton's `tensorrt_plan` platform (the TensorRT backend serves it).
        cfg.platform = "tensorrt_plan"
        cfg.default_model_filename = "model.plan"
    else:
        cfg.backend = "python"
    in_name, in_type, in_dims = input_contract(spec)
    inp = cfg.input.add(name=in_name, data_type=in_type)
    inp.dims.extend(in_dims)
    out = cfg.output.add(name=spec.output_name, data_type=mc.TYPE_FP32)
    out.dims.append(n_outputs)

    if settings.dynamic_batching:
        db = cfg.dynamic_batching
        db.max_queue_delay_microseconds = settings.max_queue_delay_us
    if settings.dynamic_batching and settings.queue_policy:
        policy = db.default_queue_policy
        policy.timeout_action = mc.ModelQueuePolicy.REJECT
        policy.default_timeout_microseconds = settings.default_timeout_us
        policy.allow_timeout_override = True
        policy.max_queue_size = settings.max_queue_size

    # The last N versions are served (and kept on disk): a hot-swap loads the new one while the old
    # one finishes its requests, and a client may pin the previous version to compare or roll back.
    cfg.version_policy.latest.num_versions = spec.serving.keep_versions

    group = cfg.instance_group.add(count=settings.instance_count)
    group.kind = mc.ModelInstanceGroup.KIND_GPU if settings.instance_kind == "KIND_GPU" else mc.ModelInstanceGroup.KIND_CPU
    if artifact.format == ORT_TENSORRT_FORMAT:
        # ONNX Runtime with Triton's TensorRT execution accelerator (onnxruntime backend): the backend
        # builds the engines at load; the accelerator applies to GPU instances only.
        group.kind = mc.ModelInstanceGroup.KIND_GPU
        accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
        for k, v in ORT_TENSORRT_PARAMETERS.items():
            accel.parameters[k] = v

    warm = cfg.model_warmup.add(name="zero_batch1", batch_size=1)
    wi = warm.inputs[in_name]
    wi.data_type = in_type
    wi.dims.extend(in_dims)
    wi.zero_data = True

    params = {rt.PARAM_RUNTIME: artifact.runtime, rt.PARAM_THREADS: str(settings.threads), rt.PARAM_INTEGRITY: "sha256"}
    if artifact.bands:
        params[rt.PARAM_DISPATCH] = dispatch_parameter(artifact.bands)
    else:
        params[rt.PARAM_ARTIFACT] = artifact.artifact_name
        if artifact.output_column is not None:
            params[rt.PARAM_OUTPUT_COLUMN] = str(artifact.output_column)
        if artifact.method is not None:
            params[rt.PARAM_METHOD] = artifact.method
    if spec.task == "binary":
        threshold = spec.serving.decision_threshold
        params[rt.PARAM_DECISION_THRESHOLD] = repr(0.5 if threshold is None else float(threshold))
    if artifact.backend == "onnxruntime":  # the ONNX Runtime backend reads these itself
        params["intra_op_thread_count"] = str(settings.threads)
        params["inter_op_thread_count"] = "1"
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    return cfg


def config_dict(cfg: mc.ModelConfig) -> dict[str, Any]:
    """The config as Triton hands it to the Python backend (JSON field names, enums as strings)."""
    return json_format.MessageToDict(cfg, preserving_proto_field_name=True)


def check_artifact_name(name: str) -> None:
    """Refuse a file name that `import` could resolve: in a version folder it could shadow the
    runtime's model.py (a TL2cgen `model.so` did) or a library the runtime imports."""
    stem = name.split(".", 1)[0]
    suffix = name[len(stem):]
    if stem.isidentifier() and suffix in importlib.machinery.all_suffixes():
        raise ValueError(
            f"artifact name {name!r} is importable as Python module {stem!r} and would shadow the model runtime "
            "inside Triton's Python backend; use a name such as 'model-<format>.so'"
        )


def package_version(version_dir: Path, artifact: Artifact) -> dict[str, str]:
    """Write one servable version folder: the artifact, the model runtime, and SHA256SUMS; return the digests.

    Candidates are verified from exactly this folder, and the selected one is emitted as it is.
    """
    check_artifact_name(artifact.artifact_name)
    version_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(artifact.path, version_dir / artifact.artifact_name)
    for src in runtime_files():
        shutil.copy2(src, version_dir / src.name)
    return rt.write_manifest(str(version_dir))


def write_config(folder: Path, cfg: mc.ModelConfig) -> mc.ModelConfig:
    """Validate `cfg` against Triton's schema and write folder/config.pbtxt."""
    path = folder / "config.pbtxt"
    # REJECT is the enum's zero value, which protobuf's text format omits; spell it out for readers.
    text = format_config(cfg).replace("default_queue_policy {\n", "default_queue_policy {\n    timeout_action: REJECT\n", 1)
    parsed = parse_config(text, str(path))  # validated against Triton's schema before it is written
    if parsed != cfg:
        raise AssertionError(f"{path}: config text does not round-trip")
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return parsed
