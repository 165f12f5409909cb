"""End-to-end check of the TensorRT path for image models, for a machine with an NVIDIA GPU and TensorRT 10.

Needs: `tensorrt` (10.x) and torch with CUDA in this environment. Steps, each recorded:
1. train the vision demo models (or use --models), export the fp32 ONNX graph (uint8 images in,
   preprocessing folded in) exactly as the compiler does;
2. build FP16 and INT8 (entropy-calibrated on the spec's calibration images) engines with the
   compiler's builder (compile/convert_tensorrt.py), optimization profile 1/8/max_batch_size;
3. run each engine through the model runtime's TensorRT runner (serve/runtime/scorestack_runtime.py,
   the one runtime Triton's Python backend uses) at batch 1 and 32 and compare with ONNX Runtime
   fp32: max |Δ| of the probabilities, top-class agreement, accuracy;
4. write the Triton model folder (config.pbtxt with platform "tensorrt_plan", 1/model.plan) with the
   compiler's emitter, validated against Triton's schema; with --triton-url, query a Triton that
   serves that repository (e.g. the official container with `--model-repository` pointing at it)
   over gRPC with raw uint8 images and compare its classes with the engine's.
Writes benchmarks/results/gpu_check_vision.{json,md}. Without TensorRT or a GPU it exits 2 and says which.

    python scripts/gpu_check_vision.py [--models DIR] [--repository DIR] [--triton-url HOST:8001]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _requirements() -> str | None:
    try:
        import tensorrt  # noqa: F401 - importing it is the check
    except Exception as exc:  # stub wheels fail with OSError/ImportError alike
        return f"tensorrt is not importable ({type(exc).__name__}: {exc})"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _time(fn, x: np.ndarray, seconds: float = 0.5) -> float:
    fn(x)
    samples = []
    deadline = time.perf_counter() + seconds
    while len(samples) < 10 or time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        fn(x)
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return float(np.median(samples))


def check_model(spec_path: Path, work: Path, repository: Path, triton_url: str | None) -> dict:
    import onnxruntime as ort
    import tensorrt as trt

    from scorestack.compile import emit
    from scorestack.compile.convert_tensorrt import build_vision_engine
    from scorestack.compile.convert_torch import export_fp32
    from scorestack.compile.loaders import load_holdout, load_source
    from scorestack.compile.registry import Artifact
    from scorestack.compile.report import TritonSettings
    from scorestack.compile.spec import load_spec
    from scorestack.compile.vision import load_images
    from scorestack.serve.runtime.scorestack_runtime import TensorRTRunner, write_manifest

    spec = load_spec(spec_path)
    source = load_source(spec, spec_path.name)
    holdout = load_holdout(spec.holdout, spec, spec_path.name)
    calibration = load_images(spec.calibration, spec, spec_path.name, "calibration", need_labels=False).X
    max_batch = spec.serving.max_batch
    onnx_path, _ = export_fp32(source, work / "onnx")
    fp32 = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    X, y = holdout.X, holdout.y
    ref = np.concatenate([fp32.run(None, {"images": X[i : i + max_batch]})[0] for i in range(0, len(X), max_batch)])
    result: dict = {"model": spec.name, "tensorrt": trt.__version__, "fp32_accuracy": float(np.mean(ref.argmax(1) == y)), "engines": {}}
    for precision in ("fp16", "int8"):
        plan = work / precision / "model.plan"
        plan.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        notes = build_vision_engine(onnx_path, plan, precision=precision, image_shape=tuple(spec.inputs.image.shape), max_batch=max_batch, calibration=calibration)
        build_s = time.perf_counter() - t0
        runner = TensorRTRunner(str(plan), 1, {}, ["probabilities"])
        run = lambda x, runner=runner: runner.run([("images", np.ascontiguousarray(x))])[0]
        out = np.concatenate([run(X[i : i + max_batch]) for i in range(0, len(X), max_batch)])
        one = np.concatenate([run(X[i : i + 1]) for i in range(min(64, len(X)))])
        entry = {
            "notes": notes,
            "build_s": round(build_s, 2),
            "plan_bytes": plan.stat().st_size,
            "max_abs_diff_vs_fp32": float(np.abs(out - ref).max()),
            "argmax_agreement_vs_fp32": float(np.mean(out.argmax(1) == ref.argmax(1))),
            "batch1_matches_batched_top_class": float(np.mean(one.argmax(1) == out[: len(one)].argmax(1))),
            "accuracy": float(np.mean(out.argmax(1) == y)),
            "latency_us": {"1": round(_time(run, X[:1]), 2), "32": round(_time(run, np.resize(X, (32, *X.shape[1:]))), 2)},
        }
        # The model folder Triton's TensorRT backend serves: config validated against Triton's schema.
        folder = repository / f"{spec.name}_trt_{precision}"
        version = folder / "1"
        version.mkdir(parents=True, exist_ok=True)
        (version / "model.plan").write_bytes(plan.read_bytes())
        write_manifest(str(version))
        art = Artifact("tensorrt", "tensorrt", "tensorrt", "model.plan", version / "model.plan", exact=False)
        settings = TritonSettings(max_batch_size=max_batch, max_queue_delay_us=100, default_timeout_us=20000, max_queue_size=4 * max_batch, instance_count=1, instance_kind="KIND_GPU", threads=1, rules=[])
        cfg = emit.build_config(spec.model_copy(update={"name": folder.name}), art, settings, int(ref.shape[1]))
        emit.write_config(folder, cfg)
        entry["triton_folder"] = str(folder)
        if triton_url:
            entry["triton"] = _query_triton(triton_url, folder.name, X, out.argmax(1))
        result["engines"][precision] = entry
    return result


def _query_triton(url: str, model: str, X: np.ndarray, want: np.ndarray) -> dict:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        client.load_model(model, client_timeout=300)
        got = []
        for i in range(len(X)):
            inp = grpcclient.InferInput("images", [1, *X.shape[1:]], "UINT8")
            inp.set_data_from_numpy(X[i : i + 1])
            got.append(int(client.infer(model, [inp], client_timeout=30).as_numpy("probabilities").argmax(1)[0]))
        return {"images": len(X), "class_agreement_with_engine": float(np.mean(np.array(got) == want))}
    finally:
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, default=None)
    ap.add_argument("--repository", type=Path, default=None, help="Where to write the tensorrt_plan model folders (default: <workspace>/gpu_check_repository).")
    ap.add_argument("--triton-url", default=None, help="gRPC address of a Triton serving --repository (explicit model control): load and query each engine.")
    args = ap.parse_args()
    missing = _requirements()
    if missing is not None:
        print(f"gpu_check_vision: cannot check the TensorRT path here: {missing}. Run it on a machine with an NVIDIA GPU, TensorRT 10 and CUDA torch.", file=sys.stderr)
        return 2
    from scorestack import paths
    from scorestack.demo.train import train_vision_models

    models = args.models or paths.workspace() / "models"
    repository = args.repository or paths.workspace() / "gpu_check_repository"
    import torch

    result = {
        "benchmark": "gpu_check_vision",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "gpu": torch.cuda.get_device_name(0)},
        "loadavg_before": [round(v, 2) for v in os.getloadavg()],
        "models": [check_model(s, paths.workspace() / "gpu_check" / s.stem, repository, args.triton_url) for s in train_vision_models(models)],
    }
    result["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_check_vision.json").write_text(json.dumps(result, indent=2))
    lines = [f"# TensorRT path for image models on {result['machine']['gpu']}", ""]
    for m in result["models"]:
        lines.append(f"## {m['model']} (TensorRT {m['tensorrt']}; fp32 accuracy {100 * m['fp32_accuracy']:.2f}%)")
        lines += ["", "| engine | max abs diff vs fp32 | top-class agreement % | accuracy % | batch 1 µs | batch 32 µs | build s |", "|---|---|---|---|---|---|---|"]
        for p, e in m["engines"].items():
            lines.append(f"| {p} | {e['max_abs_diff_vs_fp32']:.2e} | {100 * e['argmax_agreement_vs_fp32']:.2f} | {100 * e['accuracy']:.2f} | {e['latency_us']['1']:.1f} | {e['latency_us']['32']:.1f} | {e['build_s']:.1f} |")
        lines.append("")
    (RESULTS / "gpu_check_vision.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
