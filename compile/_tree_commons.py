"""Tree-ensemble logic shared by every framework's converters: TL2cgen builds and hummingbird exports."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.shape_inference

from .onnx_graph import to_contract
from .registry import Artifact, ConvertContext, Skip, output_column

ONNX_OPSET = 17
# hummingbird's perf_tree_trav strategy (chosen for deep trees) writes 2^depth nodes per tree:
# a depth-18 model came out at 819 MB (docs/platform-notes.md); refuse before wasting the time.
HUMMINGBIRD_MAX_DEPTH = 12
TL2CGEN_ARTIFACT = "model-tl2cgen.so"  # a name no `import` can resolve (see emit.check_artifact_name)


# Scores a whole row-major float32 batch in one call (TL2cgen's own entry point scores one row of
# its `union Entry`, and tl2cgen.Predictor's DMatrix + thread pool cost ~18 µs a call: more than
# the trees of a fraud model at batch 1). NaN becomes TL2cgen's "missing" (-1), as in its DMatrix.
TL2CGEN_BATCH_SHIM = """
#include "header.h"

const char* scorestack_result_type(void) {{ return "{ctype}"; }}
void scorestack_output_shape(int64_t* shape) {{ shape[0] = N_TARGET; shape[1] = MAX_N_CLASS; }}

int scorestack_predict_batch(const float* X, int64_t n_rows, int32_t n_cols, int pred_margin, {ctype}* out) {{
  if (n_cols != get_num_feature()) return -1;
  union Entry* row = (union Entry*)malloc(sizeof(union Entry) * (size_t)n_cols);
  if (row == NULL) return -2;
  const int64_t n_out = (int64_t)N_TARGET * MAX_N_CLASS;
  for (int64_t i = 0; i < n_rows; ++i) {{
    const float* x = X + i * n_cols;
    for (int32_t j = 0; j < n_cols; ++j) {{
      if (isnan(x[j])) {{ row[j].missing = -1; }} else {{ row[j].fvalue = x[j]; }}
    }}
    {ctype}* r = out + i * n_out;
    for (int64_t k = 0; k < n_out; ++k) {{ r[k] = 0; }}
    predict(row, pred_margin, r);
  }}
  free(row);
  return 0;
}}
"""


def compile_tl2cgen(treelite_model: Any, workdir: Path, ctx: ConvertContext, notes: list[str] | None = None) -> Artifact:
    """Compile a Treelite model to a shared library with the machine's gcc.

    TL2cgen generates the C code; scorestack adds one function (TL2CGEN_BATCH_SHIM) that scores a
    whole float32 batch per call, which the model runtime calls through ctypes.
    """
    if shutil.which("gcc") is None:
        raise Skip("gcc not found: TL2cgen needs a C compiler")
    import json
    import re

    import tl2cgen

    src = workdir / "tl2cgen-src"
    # Enough source files that the first one compiled tells how long the rest will take (build_c_library).
    units = max(1, min(int(getattr(treelite_model, "num_tree", 32) or 32), 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl2cgen.generate_c_code(treelite_model, dirpath=str(src), params={"parallel_comp": units})
    header = (src / "header.h").read_text()
    match = re.search(r"void predict\(union Entry\* data, int pred_margin, (float|double)\* result\);", header)
    if match is None:
        raise Skip("TL2cgen generated an entry point this compiler does not know (no `predict(union Entry*, int, float|double*)` in header.h)")
    shim = TL2CGEN_BATCH_SHIM.format(ctype=match.group(1))
    (src / "scorestack_batch.c").write_text(shim)
    recipe = json.loads((src / "recipe.json").read_text())
    sources = [s["name"] for s in recipe["sources"]] + ["scorestack_batch"]
    # Not `model.so`: beside the runtime's model.py, Python would import the library as the model.
    path = workdir / TL2CGEN_ARTIFACT
    build_c_library(src, sources, path, ctx.compile_threads, ctx.build_budget_s, "TL2cgen")
    shutil.rmtree(src, ignore_errors=True)
    return batch_library_artifact("tl2cgen", path, ctx, notes)


GCC_OBJECT = ["gcc", "-c", "-O3", "-fPIC", "-std=c99"]  # TL2cgen's own gcc recipe (tl2cgen.create_shared)
# An optimistic gcc -O3 rate on TL2cgen's C, per core: about 3x the fastest seen here (0.13-0.19 MB/s, the
# driver's own extrapolations for the 11-35 MB of a 5-class XGBoost model and an unbounded random forest).
# A build that would take longer than the budget even at this rate is not started.
GCC_FASTEST_BYTES_PER_S = 0.5e6


def build_c_library(src: Path, sources: list[str], out: Path, threads: int, budget_s: float, what: str) -> None:
    """Compile `src/<name>.c` for each name with gcc in `threads` parallel processes and link them into `out`.

    Bounded by `budget_s` (the spec's `build_budget_s`): a build that would overrun it even at an
    optimistic gcc rate (GCC_FASTEST_BYTES_PER_S) is not started; otherwise the largest files go
    first, and as each file finishes its bytes per second say how long the rest will take on
    `threads` cores; as soon as that estimate, or the clock, passes the budget every gcc is stopped
    and the candidate skipped (registry.Skip) with the estimate, so a model whose generated C would
    take minutes to build costs the compile one file's time, not the whole build.
    """
    size = {name: (src / f"{name}.c").stat().st_size for name in sources}
    pending = sorted(sources, key=lambda n: -size[n])
    total = sum(size.values())
    fastest = total / (GCC_FASTEST_BYTES_PER_S * threads)

    def over(need: str, outcome: str, rate: str = "") -> Skip:
        return Skip(
            f"{what}: gcc would need {need} for {total / 1e6:.1f} MB of generated C on {threads} core(s){rate}, over the spec's "
            f"`build_budget_s: {budget_s:g}`; {outcome}. Raise build_budget_s to build this candidate"
        )

    if fastest > budget_s:
        raise over(f"more than {fastest:.0f} s", "not started", f" (at {GCC_FASTEST_BYTES_PER_S / 1e6:g} MB/s a core, faster than measured)")
    running: dict[subprocess.Popen, tuple[str, float]] = {}
    done_bytes, done_s = 0, 0.0  # compiled so far, and the seconds one gcc process spent on them
    t0 = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < threads:
                name = pending.pop(0)
                proc = subprocess.Popen([*GCC_OBJECT, "-o", f"{name}.o", f"{name}.c"], cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                running[proc] = (name, time.monotonic())
            time.sleep(0.02)
            for proc in [p for p in running if p.poll() is not None]:
                name, started = running.pop(proc)
                if proc.returncode != 0:
                    raise RuntimeError(f"gcc failed on {name}.c: {proc.stderr.read().decode(errors='replace').strip()[:500]}")
                proc.stderr.close()
                done_bytes += size[name]
                done_s += time.monotonic() - started
            elapsed = time.monotonic() - t0
            estimate = None
            if done_bytes:
                left = sum(size[n] for n in pending) + sum(size[n] for n, _ in running.values())
                estimate = elapsed + left / (done_bytes / max(done_s, 1e-3) * threads)
            if elapsed > budget_s or (estimate is not None and estimate > budget_s):
                need = f"about {estimate:.0f} s" if estimate is not None else f"more than {max(budget_s, fastest):.0f} s"
                raise over(need, f"stopped after {elapsed:.1f} s")
    finally:
        for proc in running:
            proc.kill()
            proc.wait()
            proc.stderr.close()
    objects = [f"{name}.o" for name in sources]
    linked = subprocess.run(["gcc", "-shared", "-O3", "-o", str(out.resolve()), *objects, "-std=c99", "-lm"], cwd=src, capture_output=True, text=True)
    if linked.returncode != 0:
        raise RuntimeError(f"linking {what} failed: {linked.stderr.strip()[:500]}")


def batch_library_artifact(fmt: str, path: Path, ctx: ConvertContext, notes: list[str] | None = None) -> Artifact:
    """The Artifact of a shared library with the batch entry point (TL2cgen's, or the tree kernel's),
    served by the runtime's ctypes runner; its output column read from a run on sample rows."""
    from scorestack.serve.runtime.scorestack_runtime import TL2cgenRunner

    raw = np.asarray(TL2cgenRunner(str(path), 1, {}, ["y"]).run([("x", np.ascontiguousarray(ctx.sample[:4], dtype=np.float32))])[0])
    return Artifact(fmt, "tl2cgen", "python", path.name, path, output_column=output_column(ctx.task, raw), notes=list(notes or []))


def hummingbird_available() -> bool:
    return importlib.util.find_spec("hummingbird") is not None and importlib.util.find_spec("torch") is not None


def hummingbird_onnx(model: Any, workdir: Path, ctx: ConvertContext, extra_config: dict[str, Any], max_depth: int | None, notes: list[str] | None = None) -> Artifact:
    """Tensorize trees with hummingbird (torch backend) and export them to ONNX under the tensor contract.

    The ONNX export goes through torch's TorchScript exporter (`dynamo=False`): hummingbird's own ONNX
    path fails under torch 2.13.
    """
    if not hummingbird_available():
        raise Skip("hummingbird not installed (pip install 'scorestack[hummingbird]')")
    if max_depth is not None and max_depth > HUMMINGBIRD_MAX_DEPTH:
        raise Skip(f"trees of depth {max_depth} > {HUMMINGBIRD_MAX_DEPTH}: hummingbird's tensorized form would be too large")
    import hummingbird.ml as hb
    import torch

    sample = np.ascontiguousarray(ctx.sample[:8], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        container = hb.convert(model, "torch", sample, extra_config=dict(extra_config))
        module = container.model
        classifier = ctx.task in ("binary", "multiclass")
        out_names = ["label", "probabilities"] if classifier else ["prediction"]
        path = workdir / "model.onnx"
        raw_path = workdir / "hummingbird_raw.onnx"
        torch.onnx.export(
            module,
            (torch.from_numpy(sample),),
            str(raw_path),
            dynamo=False,
            input_names=["input"],
            output_names=out_names,
            dynamic_axes={n: {0: "batch"} for n in ["input", *out_names]},
            opset_version=ONNX_OPSET,
        )
    raw = pin_squeeze_axes(onnx.load(str(raw_path)), sample)
    raw_path.unlink()
    if classifier:
        probs = np.asarray(container.predict_proba(sample))
        column = 1 if ctx.task == "binary" else None
        width = 1 if ctx.task == "binary" else probs.shape[1]
        src = "probabilities"
    else:
        column, width, src = None, 1, "prediction"
    contract = to_contract(raw, ctx.task, ctx.n_features, src, column=column, n_outputs=width)
    onnx.save(contract, str(path))
    return Artifact("hummingbird", "onnxruntime", "onnxruntime", "model.onnx", path, notes=list(notes or []))


def pin_squeeze_axes(model: onnx.ModelProto, sample: np.ndarray) -> onnx.ModelProto:
    """Give every `Squeeze` without axes the axes it squeezed when traced.

    torch's `x.squeeze()` exports as a Squeeze of every size-1 dimension: traced on several rows it
    removes only the trees' own size-1 axes, but on one row it removes the batch axis too, and the
    next op fails (hummingbird's GEMM strategy on a GradientBoostingRegressor: "Transpose ... perm size
    2 does not match input rank 1" at batch 1). The axes are read from the tensors' shapes on the
    sample's rows (at least 2, so the batch axis is never 1), and written as the op's `axes` input.
    """
    import onnxruntime as ort

    bare = [n for n in model.graph.node if n.op_type == "Squeeze" and len([i for i in n.input if i]) == 1]
    if not bare:
        return model
    rows = np.ascontiguousarray(sample if len(sample) >= 2 else np.repeat(sample, 2, axis=0), dtype=np.float32)
    probe = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in [*probe.graph.value_info, *probe.graph.input, *probe.graph.output]}
    names = [n.input[0] for n in bare]
    outputs = {o.name for o in probe.graph.output}
    probe.graph.output.extend(types[name] for name in dict.fromkeys(names) if name not in outputs)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    shapes = dict(zip(names, (np.shape(v) for v in session.run(names, {session.get_inputs()[0].name: rows}))))
    for k, n in enumerate(bare):
        axes = [i for i, d in enumerate(shapes[n.input[0]]) if d == 1]
        name = f"scorestack_squeeze_axes_{k}"
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(axes, dtype=np.int64), name))
        n.input.append(name)
    return model


def save_onnx_contract(raw: onnx.ModelProto, workdir: Path, ctx: ConvertContext, source_output: str | int, n_classes: int | None, fmt: str = "onnx", notes: list[str] | None = None) -> Artifact:
    """Rewrite a converter's graph to the tensor contract and save it as model.onnx."""
    if ctx.task == "binary":
        column, width = 1, 1
    elif ctx.task == "multiclass":
        column, width = None, int(n_classes or 0)
    else:
        column, width = None, 1
    contract = to_contract(raw, ctx.task, ctx.n_features, source_output, column=column, n_outputs=width)
    path = workdir / "model.onnx"
    onnx.save(contract, str(path))
    return Artifact(fmt, "onnxruntime", "onnxruntime", "model.onnx", path, notes=list(notes or []))


def tree_depth(node: dict[str, Any]) -> int:
    """Depth of a tree given as XGBoost's JSON dump (nested `children`)."""
    kids = node.get("children")
    return 0 if not kids else 1 + max(tree_depth(k) for k in kids)
