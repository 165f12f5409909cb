"""Vision models side by side: torch eager, ONNX fp32, static INT8, pruned, distilled and pruned+INT8 at batch 1 and 32, with accuracy.

For each demo CNN (trained into the workspace when absent) the variants are built by the compiler's own
code (export, quantization, pruning and distillation passes) and run through the model runtime's
onnxruntime runner (serve/runtime/scorestack_runtime.py, 1 intra-op thread, all graph optimizations),
torch eager with 1 thread. Timings are medians of interleaved rounds in one process, so machine noise
hits every variant alike; the machine's load average is recorded before and after.
Writes benchmarks/results/vision.{json,md}.

    .venv/bin/python benchmarks/bench_vision.py [--rounds 5] [--models DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch

from scorestack import paths
from scorestack.compile.convert_torch import export_fp32, quantize_int8
from scorestack.demo.train import VISION_MODELS, train_vision_models
from scorestack.compile.loaders import load_holdout, load_source
from scorestack.compile.spec import load_spec
from scorestack.compile.vision import load_images, served_module
from scorestack.compile.vision_passes import distill_student, parameters, prune_channels
from scorestack.serve.runtime.scorestack_runtime import OnnxRuntimeRunner

RESULTS = Path(__file__).resolve().parent / "results"
BATCHES = (1, 32)


def _timer(fn, x: np.ndarray, budget_s: float) -> list[float]:
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 2000):
        t0 = time.perf_counter_ns()
        fn(x)
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return samples


def bench_model(spec_path: Path, work: Path, rounds: int) -> dict:
    spec = load_spec(spec_path)
    source = load_source(spec, spec_path.name)
    holdout = load_holdout(spec.holdout, spec, spec_path.name)
    train = load_images(spec.train_images, spec, spec_path.name, "train_images")
    calibration = load_images(spec.calibration, spec, spec_path.name, "calibration", need_labels=False).X
    budget = spec.verification.accuracy_budget
    opt = spec.optimization
    # The benchmark keeps the pruned and distilled models even outside the budget (the compile would
    # not): it measures what each move buys and costs. `within_budget` says what the compile decided.
    pruned_model, prune_report = prune_channels(source, holdout, train, opt.channel_pruning, budget, threads=2)
    student_model, distill_report = distill_student(source, holdout, train, opt.student, budget, threads=2)
    work.mkdir(parents=True, exist_ok=True)
    fp32, _ = export_fp32(source, work / "fp32")
    int8 = work / "int8" / "model-int8.onnx"
    int8.parent.mkdir(parents=True, exist_ok=True)
    int8_notes = quantize_int8(fp32, int8, calibration)
    pruned32, _ = export_fp32(pruned_model, work / "pruned")
    pruned8 = work / "pruned-int8" / "model-int8.onnx"
    pruned8.parent.mkdir(parents=True, exist_ok=True)
    quantize_int8(pruned32, pruned8, calibration)
    student32, _ = export_fp32(student_model, work / "distilled")

    torch.set_num_threads(1)
    eager = served_module(source.model, source.image)

    def run_eager(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return eager(torch.from_numpy(x)).numpy()

    def runner(path: Path):
        r = OnnxRuntimeRunner(str(path), 1, {}, ["probabilities"])
        return lambda x: r.run([("images", x)])[0]

    variants = {
        "torch eager": (run_eager, parameters(source.model), None),
        "onnx fp32": (runner(fp32), parameters(source.model), None),
        "onnx int8": (runner(int8), parameters(source.model), None),
        "pruned (onnx fp32)": (runner(pruned32), parameters(pruned_model.model), prune_report.accepted),
        "distilled (onnx fp32)": (runner(student32), parameters(student_model.model), distill_report.accepted),
        "pruned + int8": (runner(pruned8), parameters(pruned_model.model), prune_report.accepted),
    }
    X, y = holdout.X, holdout.y
    fp32_classes = variants["onnx fp32"][0](X).argmax(1)
    rows: dict[str, dict] = {}
    for name, (fn, n_params, accepted) in variants.items():
        out = np.concatenate([fn(X[i : i + 64]) for i in range(0, len(X), 64)])
        rows[name] = {
            "accuracy": float(np.mean(out.argmax(1) == y)),
            "argmax_agreement_vs_fp32": float(np.mean(out.argmax(1) == fp32_classes)),
            "parameters": n_params,
            "within_budget": accepted,
        }
    inputs = {b: np.ascontiguousarray(np.resize(X, (b, *X.shape[1:]))) for b in BATCHES}
    samples = {name: {b: [] for b in BATCHES} for name in variants}
    for fn, _, _ in variants.values():  # warm-up
        for b in BATCHES:
            fn(inputs[b])
    order = list(variants)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            for b in BATCHES:
                samples[name][b] += _timer(variants[name][0], inputs[b], 0.15)
    for name in variants:
        rows[name]["latency_us"] = {str(b): round(float(np.median(samples[name][b])), 2) for b in BATCHES}
        rows[name]["calls"] = {str(b): len(samples[name][b]) for b in BATCHES}
    base = rows["onnx fp32"]["latency_us"]
    eager_lat = rows["torch eager"]["latency_us"]
    for name in variants:
        lat = rows[name]["latency_us"]
        rows[name]["speedup_vs_onnx_fp32"] = {b: round(base[b] / lat[b], 3) for b in lat}
        rows[name]["speedup_vs_eager"] = {b: round(eager_lat[b] / lat[b], 3) for b in lat}
        rows[name]["accuracy_drop_points"] = round(100 * (rows["torch eager"]["accuracy"] - rows[name]["accuracy"]), 3)
    return {
        "model": spec.name,
        "source": source.description,
        "holdout_images": len(X),
        "accuracy_budget_points": 100 * budget,
        "int8": int8_notes,
        "passes": {"channel_pruning": prune_report.model_dump(), "distillation": distill_report.model_dump()},
        "variants": rows,
    }


def width_sweep(spec_path: Path, work: Path, rounds: int) -> list[dict]:
    """Speed only: fp32 vs INT8 of SmallCNN at 1x, 2x and 4x the demo's widths (weights as initialized; the
    calibration images set the INT8 scales). Shows where INT8 starts to pay on this CPU."""
    from scorestack.compile.model import SourceModel
    from scorestack.compile.vision_models import SmallCNN

    spec = load_spec(spec_path)
    X = load_holdout(spec.holdout, spec, spec_path.name).X
    calibration = load_images(spec.calibration, spec, spec_path.name, "calibration", need_labels=False).X
    out = []
    for factor in (1, 2, 4):
        torch.manual_seed(0)
        model = SmallCNN(10, 1, [16 * factor, 32 * factor, 64 * factor]).eval()
        sm = SourceModel(f"x{factor}", "image-classification", "torch-vision", model, spec.n_features, 10, image=spec.inputs.image)
        fp32, _ = export_fp32(sm, work / f"x{factor}")
        int8 = work / f"x{factor}" / "model-int8.onnx"
        quantize_int8(fp32, int8, calibration)
        runners = {k: OnnxRuntimeRunner(str(p), 1, {}, ["probabilities"]) for k, p in (("fp32", fp32), ("int8", int8))}
        samples: dict[str, dict[int, list[float]]] = {k: {b: [] for b in BATCHES} for k in runners}
        inputs = {b: np.ascontiguousarray(np.resize(X, (b, *X.shape[1:]))) for b in BATCHES}
        rng, order = random.Random(factor), list(runners)
        for _ in range(rounds):
            rng.shuffle(order)
            for k in order:
                for b in BATCHES:
                    samples[k][b] += _timer(lambda x, r=runners[k]: r.run([("images", x)]), inputs[b], 0.1)
        lat = {k: {str(b): round(float(np.median(v[b])), 2) for b in BATCHES} for k, v in samples.items()}
        out.append({"widths": model.widths, "parameters": parameters(model), "latency_us": lat,
                    "int8_speedup": {str(b): round(lat["fp32"][str(b)] / lat["int8"][str(b)], 3) for b in BATCHES}})
    return out


def render(result: dict) -> str:
    lines = [
        "# Vision models: eager, ONNX fp32, INT8, pruned, distilled, pruned+INT8",
        "",
        f"Machine: {result['machine']['cpus']} CPUs, load average before {result['loadavg_before']}, after {result['loadavg_after']} "
        "(shared machine: ratios measured side by side hold better than absolute times).",
        "Median µs per call, 1 thread, interleaved rounds in one process; ONNX variants through the model runtime's onnxruntime runner.",
        "",
    ]
    for m in result["models"]:
        lines += [
            f"## {m['model']} ({m['source']})",
            "",
            f"Accuracy on {m['holdout_images']} held-out images; budget {m['accuracy_budget_points']:.2f} points.",
            "",
            "| variant | accuracy % | drop (points) | agreement vs fp32 % | parameters | batch 1 µs | batch 32 µs | vs fp32 b1 | vs fp32 b32 | vs eager b1 | within budget |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in m["variants"].items():
            lat, sp, se = r["latency_us"], r["speedup_vs_onnx_fp32"], r["speedup_vs_eager"]
            wb = "–" if r["within_budget"] is None else ("yes" if r["within_budget"] else "no")
            lines.append(
                f"| {name} | {100 * r['accuracy']:.2f} | {r['accuracy_drop_points']:.2f} | {100 * r['argmax_agreement_vs_fp32']:.2f} | {r['parameters']:,} | "
                f"{lat['1']:.1f} | {lat['32']:.1f} | {sp['1']:.2f}x | {sp['32']:.2f}x | {se['1']:.2f}x | {wb} |"
            )
        lines += ["", f"INT8: {'; '.join(m['int8'])}.", ""]
        for name, p in m["passes"].items():
            lines.append(f"- {name}: {p['reason']}")
        lines.append("")
    if result.get("width_sweep"):
        lines += ["## INT8 against fp32 by width (SmallCNN, speed only)", "", "| widths | parameters | fp32 b1 µs | int8 b1 µs | fp32 b32 µs | int8 b32 µs | int8 speedup b1 | b32 |", "|---|---|---|---|---|---|---|---|"]
        for w in result["width_sweep"]:
            lat = w["latency_us"]
            lines.append(f"| {w['widths']} | {w['parameters']:,} | {lat['fp32']['1']:.1f} | {lat['int8']['1']:.1f} | {lat['fp32']['32']:.1f} | {lat['int8']['32']:.1f} | {w['int8_speedup']['1']:.2f}x | {w['int8_speedup']['32']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", type=Path, default=None, help="Folder of trained vision demo models (default: the workspace's, trained when absent).")
    args = ap.parse_args()
    models = args.models or paths.workspace() / "models"
    specs = train_vision_models(models)
    load_before = [round(v, 2) for v in os.getloadavg()]
    started = time.time()
    work = models.parent / "bench_vision"
    out = [bench_model(s, work / s.stem, args.rounds) for s in specs if s.stem in VISION_MODELS]
    result = {
        "benchmark": "vision",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "loadavg_before": load_before,
        "rounds": args.rounds,
        "models": out,
        "width_sweep": width_sweep(specs[0], work / "width_sweep", args.rounds),
    }
    result["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    result["duration_s"] = round(time.time() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vision.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "vision.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
