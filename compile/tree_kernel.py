"""scorestack's own tree kernel: complete-depth trees traversed without branches, tree-major over row blocks.

TL2cgen turns every split into an `if`: at batch 1 nothing is faster, but on rows the branch
predictor has not seen, a 300-tree depth-6 model mispredicts about every other of its ~1800
branches per row: on the demo fraud model (300 trees) TL2cgen takes 377 µs for 64 distinct rows,
5.9 µs a row, against 10 µs for one row (benchmarks/results/tree_kernel.md). This kernel pads every tree
to a complete tree of the ensemble's depth D (a leaf above depth D is copied into both children),
so a row's path is exactly D steps of `idx = 2*idx + 1 + (x[f] >= t)` with no branch to mispredict,
and walks each tree over a block of rows while the tree's arrays sit in L1 (tree-major).

The shared library speaks the ABI of the TL2cgen batch entry point (`scorestack_predict_batch`,
`scorestack_result_type`, `scorestack_output_shape`; compile/_tree_commons.py), so the runtime's
ctypes runner (TL2cgenRunner) serves it unchanged. It is a candidate like any other: verified
against the source in the serving environment and kept only where the measurements select it.

Exactness: splits are compared in float32 with thresholds rounded to the float32 that gives the same
decision as the source's comparison (`<` or `<=`, float32 or float64 thresholds); missing values
(NaN) take the split's default direction; leaves are summed in float32 in tree order, as TL2cgen
does, then the base score and the sigmoid (or nothing) are applied.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from .registry import Artifact, ConvertContext, Skip

TREE_KERNEL_ARTIFACT = "model-trees.so"  # like TL2CGEN_ARTIFACT: no `import` can resolve it
MAX_DEPTH = 10  # 2^10 leaves a tree after padding: deeper ensembles stay with the other formats
ROW_BLOCK = 64
TREE_GROUP = 8  # a lone row's walks through this many trees side by side (node layout)
INTERLEAVE = 8  # rows walked through a tree together (ad-hoc runs on a synthetic 300-tree model, against XGBoost in the same run: 3.5x vs 3.0x for 4 at 64 rows, 1.8x vs 1.4x at 1024)


_OPERATORS = {2: "<", 3: "<=", 4: ">", 5: ">="}  # treelite's Operator enum (kLT, kLE, kGT, kGE)


def model_dict(treelite_model: Any) -> dict[str, Any]:
    """A Treelite model's header and trees, read through its accessors (exact binary values; the
    JSON dump writes an empty threshold for an infinite one, as HistGradientBoosting has)."""
    head = treelite_model.get_header_accessor()

    def field(name: str) -> Any:
        return head.get_field(name)

    out: dict[str, Any] = {
        "num_feature": int(field("num_feature")[0]),
        "num_target": int(field("num_target")[0]),
        "num_class": [int(v) for v in field("num_class")],
        "leaf_vector_shape": [int(v) for v in field("leaf_vector_shape")],
        "average_tree_output": bool(field("average_tree_output")[0]),
        "postprocessor": str(field("postprocessor")),
        "sigmoid_alpha": float(field("sigmoid_alpha")[0]),
        "base_scores": [float(v) for v in field("base_scores")],
        "class_id": [int(v) for v in field("class_id")],
        "trees": [],
    }
    for k in range(treelite_model.num_tree):
        tree = treelite_model.get_tree_accessor(k)
        kind, left, right = tree.get_field("node_type"), tree.get_field("cleft"), tree.get_field("cright")
        feature, threshold, cmp, default_left = (tree.get_field(f) for f in ("split_index", "threshold", "cmp", "default_left"))
        leaf_value, leaf_vector = tree.get_field("leaf_value"), tree.get_field("leaf_vector")
        begin, end = (tree.get_field("leaf_vector_begin"), tree.get_field("leaf_vector_end")) if len(leaf_vector) else (None, None)
        nodes = []
        for i in range(int(tree.get_field("num_nodes")[0])):
            if kind[i] == 0 and begin is not None and end[i] > begin[i]:
                nodes.append({"node_id": i, "leaf_vector": [float(v) for v in leaf_vector[begin[i] : end[i]]]})
            elif kind[i] == 0:
                nodes.append({"node_id": i, "leaf_value": float(leaf_value[i])})
            else:
                nodes.append({
                    "node_id": i, "node_type": "numerical_test_node" if kind[i] == 1 else "categorical_test_node",
                    "split_feature_id": int(feature[i]), "threshold": float(threshold[i]), "comparison_op": _OPERATORS.get(int(cmp[i]), str(cmp[i])),
                    "default_left": bool(default_left[i]), "left_child": int(left[i]), "right_child": int(right[i]),
                })
        out["trees"].append({"nodes": nodes})
    return out


def _threshold32(t: float, op: str) -> np.float32:
    """The float32 `c` with: x goes right (x >= c) exactly when the source's `x op t` is false."""
    if np.isnan(t):
        raise Skip("a NaN split threshold")
    if op == "<=" and np.isposinf(t):  # every number goes left: compare with NaN, which is never >=
        return np.float32(np.nan)
    c = np.float32(t)
    if op == "<":  # right iff x >= t: the smallest float32 >= t
        if float(c) < t:
            c = np.nextafter(c, np.float32(np.inf))
    elif op == "<=":  # right iff x > t: the smallest float32 > t
        if float(c) <= t:
            c = np.nextafter(c, np.float32(np.inf))
    else:
        raise Skip(f"split comparison {op!r}: the tree kernel handles '<' and '<='")
    return np.float32(c)


def _tree_depth(nodes: dict[int, dict[str, Any]], root: int = 0) -> int:
    depth, stack = 0, [(root, 0)]
    while stack:
        nid, d = stack.pop()
        node = nodes[nid]
        if "leaf_value" in node or "leaf_vector" in node:
            depth = max(depth, d)
        else:
            stack += [(node["left_child"], d + 1), (node["right_child"], d + 1)]
    return depth


def tree_arrays(model: dict[str, Any]) -> dict[str, Any]:
    """The padded complete-tree arrays of a Treelite model (model_dict), or Skip with the reason."""
    if model.get("num_target") != 1 or list(model.get("num_class", [])) != [1] or list(model.get("leaf_vector_shape", [])) != [1, 1]:
        raise Skip("the tree kernel scores one output per row (binary, regression, ranking); this model has several")
    if model.get("average_tree_output"):
        raise Skip("averaged trees (random forests): the tree kernel sums boosted trees")
    post = model.get("postprocessor")
    if post not in ("sigmoid", "identity"):
        raise Skip(f"postprocessor {post!r}: the tree kernel applies sigmoid or identity")
    trees = [{n["node_id"]: n for n in tree["nodes"]} for tree in model["trees"]]
    depth = max(1, max(_tree_depth(t) for t in trees))
    if depth > MAX_DEPTH:
        raise Skip(f"trees of depth {depth} > {MAX_DEPTH}: padded to complete trees they would not fit the cache")
    n_inner, n_leaf = (1 << depth) - 1, 1 << depth
    feat = np.zeros((len(trees), n_inner), np.int32)
    thr = np.full((len(trees), n_inner), np.inf, np.float32)
    right_if_missing = np.zeros((len(trees), n_inner), np.uint8)
    leaf = np.zeros((len(trees), n_leaf), np.float32)
    for k, nodes in enumerate(trees):
        stack = [(0, 0, 0)]  # (source node, complete-tree index, depth)
        while stack:
            nid, idx, d = stack.pop()
            node = nodes[nid]
            if d == depth:
                leaf[k, idx - n_inner] = np.float32(node["leaf_value"])
            elif "leaf_value" in node:  # a leaf above the bottom: both children are copies of it
                stack += [(nid, 2 * idx + 1, d + 1), (nid, 2 * idx + 2, d + 1)]
            else:
                if node.get("node_type", "numerical_test_node") != "numerical_test_node":
                    raise Skip(f"node type {node.get('node_type')!r}: the tree kernel handles numerical splits")
                feat[k, idx] = int(node["split_feature_id"])
                thr[k, idx] = _threshold32(float(node["threshold"]), node["comparison_op"])
                right_if_missing[k, idx] = 0 if node["default_left"] else 1
                stack += [(node["left_child"], 2 * idx + 1, d + 1), (node["right_child"], 2 * idx + 2, d + 1)]
    base = model.get("base_scores") or [0.0]
    return {
        "depth": depth, "n_feature": int(model["num_feature"]), "feat": feat, "thr": thr, "right_if_missing": right_if_missing,
        "leaf": leaf, "base_score": float(base[0]), "sigmoid": post == "sigmoid", "alpha": float(model.get("sigmoid_alpha", 1.0)),
    }


def _c_float(v: float) -> str:
    """A C float literal that round-trips a float32 (%.9g); NAN and INFINITY for those."""
    if np.isnan(v):
        return "NAN"
    if np.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    text = f"{float(v):.9g}"
    return (text if any(c in text for c in ".en") else text + ".0") + "f"


def _c_floats(a: np.ndarray) -> str:
    return ",".join(_c_float(v) for v in a.ravel())


def kernel_source(arrays: dict[str, Any]) -> str:
    """The C source of the kernel for `arrays` (tree_arrays)."""
    feat, thr, rim, leaf = arrays["feat"], arrays["thr"], arrays["right_if_missing"], arrays["leaf"]
    n_trees, depth = feat.shape[0], arrays["depth"]
    finish = f"1.0f / (1.0f + expf(-{_c_float(arrays['alpha'])} * m))" if arrays["sigmoid"] else "m"
    rows = range(INTERLEAVE)
    interleaved = "\n".join(
        [f"        const float* x{r} = xb + (b + {r}) * N_FEATURE;" for r in rows]
        + ["        " + " ".join(f"uint32_t i{r} = 0;" for r in rows)]
        + ["        for (int d = 0; d < DEPTH; ++d) {"]
        + [f"          const float v{r} = x{r}[f[i{r}]];" for r in rows]
        + [f"          i{r} = 2u * i{r} + 1u + (uint32_t)((v{r} >= th[i{r}]) | ((v{r} != v{r}) & rm[i{r}]));" for r in rows]
        + ["        }"]
        + [f"        acc[b + {r}] += lf[i{r} - N_INNER];" for r in rows]
    )
    return f"""/* Generated by scorestack (compile/tree_kernel.py): {n_trees} trees padded to depth {depth}. */
#include <math.h>
#include <stdint.h>

#define N_TREES {n_trees}
#define DEPTH {depth}
#define N_INNER {(1 << depth) - 1}
#define N_LEAF {1 << depth}
#define N_FEATURE {arrays['n_feature']}
#define ROW_BLOCK {ROW_BLOCK}
#define INTERLEAVE {INTERLEAVE}

static const int32_t FEAT[N_TREES * N_INNER] = {{{",".join(str(int(v)) for v in feat.ravel())}}};
static const float THR[N_TREES * N_INNER] = {{{_c_floats(thr)}}};
static const uint8_t RIGHT_IF_MISSING[N_TREES * N_INNER] = {{{",".join(str(int(v)) for v in rim.ravel())}}};
static const float LEAF[N_TREES * N_LEAF] = {{{_c_floats(leaf)}}};

const char* scorestack_result_type(void) {{ return "float"; }}
void scorestack_output_shape(int64_t* shape) {{ shape[0] = 1; shape[1] = 1; }}

int scorestack_predict_batch(const float* X, int64_t n_rows, int32_t n_cols, int pred_margin, float* out) {{
  if (n_cols != N_FEATURE) return -1;
  float acc[ROW_BLOCK];
  for (int64_t i0 = 0; i0 < n_rows; i0 += ROW_BLOCK) {{
    const int64_t nb = (n_rows - i0) < ROW_BLOCK ? (n_rows - i0) : ROW_BLOCK;
    const float* xb = X + i0 * N_FEATURE;
    for (int64_t b = 0; b < nb; ++b) acc[b] = 0.0f;
    for (int t = 0; t < N_TREES; ++t) {{
      const int32_t* f = FEAT + t * N_INNER;
      const float* th = THR + t * N_INNER;
      const uint8_t* rm = RIGHT_IF_MISSING + t * N_INNER;
      const float* lf = LEAF + t * N_LEAF;
      int64_t b = 0;
      for (; b + INTERLEAVE <= nb; b += INTERLEAVE) {{  /* independent row paths interleaved: one's loads overlap the others' */
{interleaved}
      }}
      for (; b < nb; ++b) {{
        const float* x = xb + b * N_FEATURE;
        uint32_t idx = 0;
        for (int d = 0; d < DEPTH; ++d) {{
          const float v = x[f[idx]];
          idx = 2u * idx + 1u + (uint32_t)((v >= th[idx]) | ((v != v) & rm[idx]));
        }}
        acc[b] += lf[idx - N_INNER];
      }}
    }}
    for (int64_t b = 0; b < nb; ++b) {{
      const float m = (float)((double)acc[b] + {arrays['base_score']:.17g});  /* in double, as TL2cgen's `result += base` */
      out[i0 + b] = pred_margin ? m : {finish};
    }}
  }}
  return 0;
}}
"""


NODE_DTYPE = np.dtype([("thr", "<f4"), ("fm", "<i4"), ("ch", "<i4"), ("leaf", "<i4")])  # the C kernel's `Node`
LEAF_FM = -(1 << 31)  # a leaf: the sign bit set, feature 0, no missing-value bit
LONE_MAX_FEATURES = 8192  # a lone row's two copies (NaN going left, NaN going right) sit on the stack up to this width
MAX_OUTPUTS = 256
_NODE_POST = {"identity", "identity_multiclass", "sigmoid", "softmax", "multiclass_ova"}


def node_arrays(model: dict[str, Any]) -> dict[str, Any]:
    """The node layout of a Treelite model (model_dict): trees of any depth, unpadded, and several outputs a row.

    Every node is one 16-byte record (float32 threshold, feature << 1 | missing-goes-right, first
    child, leaf offset); a node's two children are adjacent, so the right one is `ch + 1`. A leaf has
    the sign bit set in `fm`, a NaN threshold and itself as child, so a walk that goes on past it stays
    there (the interleaved walk takes each tree's depth in steps); its value (added to the tree's
    class) or its vector (one value per class: a random forest's class probabilities) is at `leaf`
    in `leafv`.
    """
    if model.get("num_target") != 1:
        raise Skip(f"{model.get('num_target')} targets: the tree kernel scores models with one target")
    k = max(model.get("num_class") or [1])
    shape = list(model.get("leaf_vector_shape") or [1, 1])
    vectors = shape != [1, 1]
    if vectors and shape != [1, k]:
        raise Skip(f"leaf vectors of shape {shape}: the tree kernel takes one value or one per class ({k}) a leaf")
    if k > MAX_OUTPUTS:
        raise Skip(f"{k} classes: the tree kernel scores up to {MAX_OUTPUTS} outputs a row")
    post = model.get("postprocessor")
    if post not in _NODE_POST:
        raise Skip(f"postprocessor {post!r}: the tree kernel applies {', '.join(sorted(_NODE_POST))}")
    n_trees = len(model["trees"])
    classes = list(model.get("class_id") or [0] * n_trees)
    if vectors:
        classes = [-1] * n_trees  # every leaf adds to every class
    elif any(c < 0 for c in classes):
        if k != 1:
            raise Skip("scalar leaves shared by every class: the tree kernel adds a scalar leaf to its tree's class")
        classes = [0] * n_trees
    records: list[tuple[float, int, int, int]] = []
    depths: list[int] = []
    leafv: list[float] = []
    roots: list[int] = []
    for tree in model["trees"]:
        nodes = {n["node_id"]: n for n in tree["nodes"]}
        depths.append(_tree_depth(nodes))
        roots.append(len(records))
        records.append((0.0, LEAF_FM, 0, 0))
        queue = [(0, roots[-1])]
        while queue:
            nid, slot = queue.pop()
            node = nodes[nid]
            if "leaf_vector" in node:
                if len(node["leaf_vector"]) != k:
                    raise Skip(f"a leaf vector of {len(node['leaf_vector'])} values for {k} classes")
                records[slot] = (np.nan, LEAF_FM, slot, len(leafv))
                leafv += node["leaf_vector"]
            elif "leaf_value" in node:
                if vectors:
                    raise Skip("a scalar leaf in a model of leaf vectors")
                records[slot] = (np.nan, LEAF_FM, slot, len(leafv))
                leafv.append(float(np.float32(node["leaf_value"])))
            else:
                if node.get("node_type", "numerical_test_node") != "numerical_test_node":
                    raise Skip(f"node type {node.get('node_type')!r}: the tree kernel handles numerical splits")
                feature = int(node["split_feature_id"])
                if not 0 <= feature < (1 << 30):
                    raise Skip(f"split feature {feature}: out of the kernel's range")
                left = len(records)
                records += [(0.0, LEAF_FM, 0, 0), (0.0, LEAF_FM, 0, 0)]
                records[slot] = (float(_threshold32(float(node["threshold"]), node["comparison_op"])), feature << 1 | (0 if node["default_left"] else 1), left, 0)
                queue += [(node["left_child"], left), (node["right_child"], left + 1)]
    per_class = [sum(1 for c in classes if c in (-1, j)) for j in range(k)]
    base = list(model.get("base_scores") or [0.0]) + [0.0] * k
    return {
        "nodes": np.array(records, dtype=NODE_DTYPE), "leafv": np.array(leafv or [0.0], np.float32), "roots": roots, "depths": depths, "classes": classes,
        "k": k, "vectors": vectors, "depth": max(depths, default=0), "n_feature": int(model["num_feature"]), "post": post, "alpha": float(model.get("sigmoid_alpha", 1.0)),
        "average": [float(n) if model.get("average_tree_output") else 1.0 for n in per_class], "base": base[:k],
    }  # fmt: skip


def node_kernel_source(arrays: dict[str, Any], nodes_bin: Path, leafv_bin: Path) -> str:
    """The C source of the node-layout kernel: its node records and leaf vectors are assembled from
    `nodes_bin` / `leafv_bin` with .incbin (gcc does not parse megabytes of literals)."""
    for path in (nodes_bin, leafv_bin):
        if any(c in str(path) for c in '"\\\n'):
            raise Skip(f"the build folder {path.parent} has a quote, backslash or newline in its name")
    k, n_trees = arrays["k"], len(arrays["roots"])
    add = "{{ const float* lv = SS_LEAFV + SS_NODES[{i}].leaf; double* a = acc + ({b}) * K; for (int j = 0; j < K; ++j) a[j] += lv[j]; }}" if arrays["vectors"] else "acc[({b}) * K + {c}] += SS_LEAFV[SS_NODES[{i}].leaf];"
    rows = range(INTERLEAVE)
    step = "i{r} = SS_NODES[i{r}].ch + (int32_t)((v{r} >= SS_NODES[i{r}].thr) | ((v{r} != v{r}) & (SS_NODES[i{r}].fm & 1)));"
    interleaved = "\n".join(
        ["        " + " ".join(f"const float* x{r} = xb + (b + {r}) * N_FEATURE; int32_t i{r} = root;" for r in rows)]
        + ["        for (int32_t s = 0; s < steps; ++s) {"]
        + [f"          const float v{r} = x{r}[(SS_NODES[i{r}].fm >> 1) & 0x3fffffff];" for r in rows]
        + ["          " + step.format(r=r) for r in rows]
        + ["        }"]
        + ["        " + add.format(i=f"i{r}", b=f"b + {r}", c="c") for r in rows]
    )
    # The rows left over (a lone row, or the last few of a batch): TREE_GROUP trees' walks side by side
    # for the row, until all of them stand on a leaf (a leaf's record has the sign bit and loops on
    # itself), so the loads of several walks overlap instead of one tree's chain of loads at a time.
    # A row of up to LONE_MAX_FEATURES features is first copied twice, interleaved: xs[2f] = x[f] and
    # xs[2f + 1] = x[f] with NaN made +inf, so a split (feature << 1 | missing-goes-right) reads
    # xs[fm] and `>=` sends NaN its default way (NaN >= t is false; +inf >= t true, t is never NaN).
    lone = arrays["n_feature"] <= LONE_MAX_FEATURES
    if lone:
        choose = "{ch} + (int32_t)(xs[{f} & 0x7fffffff] >= {thr})"
        prepare = ("float xs[2 * N_FEATURE + 1];\n"
                   "      for (int f = 0; f < N_FEATURE; ++f) { const float v = x[f]; xs[2 * f] = v; xs[2 * f + 1] = v != v ? INFINITY : v; }")
    else:
        choose = "{ch} + (int32_t)((v{r} >= {thr}) | ((v{r} != v{r}) & ({f} & 1)))"
        prepare = ""
    trees = range(TREE_GROUP)
    grouped = "\n".join(
        ["          " + " ".join(f"int32_t j{r} = ROOT[t + {r}];" for r in trees)]
        + ["          for (;;) {"]
        + ["            " + " ".join(f"const int32_t f{r} = SS_NODES[j{r}].fm;" for r in trees)]
        + [f"            if (({' & '.join(f'f{r}' for r in trees)}) < 0) break;"]
        + ([] if lone else [f"            const float v{r} = x[(f{r} >> 1) & 0x3fffffff];" for r in trees])
        + [f"            j{r} = " + choose.format(ch=f"SS_NODES[j{r}].ch", f=f"f{r}", thr=f"SS_NODES[j{r}].thr", r=r) + ";" for r in trees]
        + ["          }"]
        + ["          " + add.format(i=f"j{r}", b="b", c=f"CLS[t + {r}]") for r in trees]
    )
    single = ("" if lone else "const float v = x[fm >> 1]; ") + "i = " + choose.format(ch="SS_NODES[i].ch", f="fm", thr="SS_NODES[i].thr", r="") + ";"
    post = arrays["post"]
    sigmoid = "for (int j = 0; j < K; ++j) r[j] = (float)(1.0 / (1.0 + exp(-ALPHA * m[j])));"  # one per class for multiclass_ova
    finish = {
        "sigmoid": sigmoid,
        "multiclass_ova": sigmoid,
        "softmax": "double mx = m[0]; for (int j = 1; j < K; ++j) mx = m[j] > mx ? m[j] : mx; double z = 0; "
        "for (int j = 0; j < K; ++j) z += exp(m[j] - mx); for (int j = 0; j < K; ++j) r[j] = (float)(exp(m[j] - mx) / z);",
    }.get(post, "for (int j = 0; j < K; ++j) r[j] = (float)m[j];")
    return f"""/* Generated by scorestack (compile/tree_kernel.py): {n_trees} trees in the node layout (depth up to {arrays['depth']}, {k} output(s)). */
#include <math.h>
#include <stdint.h>

#define N_TREES {n_trees}
#define K {k}
#define N_FEATURE {arrays['n_feature']}
#define ROW_BLOCK {ROW_BLOCK}
#define ALPHA {arrays['alpha']!r}
#define INTERLEAVE {INTERLEAVE}
#define TREE_GROUP {TREE_GROUP}

typedef struct {{ float thr; int32_t fm; int32_t ch; int32_t leaf; }} Node;
__asm__(".section .rodata\\n.balign 16\\nSS_NODES:\\n.incbin \\"{nodes_bin}\\"\\n.balign 16\\nSS_LEAFV:\\n.incbin \\"{leafv_bin}\\"\\n.previous\\n");
extern const Node SS_NODES[] __attribute__((visibility("hidden")));
extern const float SS_LEAFV[] __attribute__((visibility("hidden")));
static const int32_t ROOT[N_TREES] = {{{",".join(str(r) for r in arrays["roots"])}}};
static const int32_t CLS[N_TREES] = {{{",".join(str(max(c, 0)) for c in arrays["classes"])}}};
static const int32_t STEPS[N_TREES] = {{{",".join(str(d) for d in arrays["depths"])}}};
static const double AVERAGE[K] = {{{",".join(repr(v) for v in arrays["average"])}}};
static const double BASE[K] = {{{",".join(repr(v) for v in arrays["base"])}}};

const char* scorestack_result_type(void) {{ return "float"; }}
void scorestack_output_shape(int64_t* shape) {{ shape[0] = 1; shape[1] = K; }}

int scorestack_predict_batch(const float* X, int64_t n_rows, int32_t n_cols, int pred_margin, float* out) {{
  if (n_cols != N_FEATURE) return -1;
  double acc[ROW_BLOCK * K];
  for (int64_t i0 = 0; i0 < n_rows; i0 += ROW_BLOCK) {{
    const int64_t nb = (n_rows - i0) < ROW_BLOCK ? (n_rows - i0) : ROW_BLOCK;
    const float* xb = X + i0 * N_FEATURE;
    for (int64_t j = 0; j < nb * K; ++j) acc[j] = 0.0;
    for (int t = 0; t < N_TREES; ++t) {{
      const int32_t root = ROOT[t], steps = STEPS[t];
      const int c = CLS[t];
      (void)c;
      int64_t b = 0;
      for (; b + INTERLEAVE <= nb; b += INTERLEAVE) {{  /* rows' walks interleaved, each the tree's depth in steps (a leaf loops on itself) */
{interleaved}
      }}
    }}
    for (int64_t b = nb - nb % INTERLEAVE; b < nb; ++b) {{  /* the rest (a lone row): trees in groups, then one by one */
      const float* x = xb + b * N_FEATURE;
      {prepare}
      int t = 0;
      for (; t + TREE_GROUP <= N_TREES; t += TREE_GROUP) {{
{grouped}
      }}
      for (; t < N_TREES; ++t) {{
        const int c = CLS[t];
        (void)c;
        int32_t i = ROOT[t], fm;
        while ((fm = SS_NODES[i].fm) >= 0) {{  /* the child is chosen without a branch; only the walk's end is one */
          {single}
        }}
        {add.format(i="i", b="b", c="c")}
      }}
    }}
    for (int64_t b = 0; b < nb; ++b) {{
      double m[K];
      float* r = out + (i0 + b) * K;
      for (int j = 0; j < K; ++j) m[j] = acc[b * K + j] / AVERAGE[j] + BASE[j];
      if (pred_margin) {{ for (int j = 0; j < K; ++j) r[j] = (float)m[j]; continue; }}
      {finish}
    }}
  }}
  return 0;
}}
"""


def _gcc(source: Path, out: Path) -> None:
    cmd = ["gcc", "-O3", "-fPIC", "-shared", "-std=c99", "-o", str(out), str(source), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise Skip(f"gcc failed to build the tree kernel: {done.stderr.strip()[:500]}")


def build_kernel(model: dict[str, Any], out: Path) -> tuple[Path, str]:
    """Generate and compile the kernel of a Treelite model (model_dict) into the shared library `out`;
    also which layout it took and why (for the compile report).

    Shallow single-output ensembles get the complete-tree layout (branch-free, fastest at large
    batches); every other numerical ensemble (deep or unbalanced trees, several classes, leaf
    vectors, averaged forests) the node layout."""
    if shutil.which("gcc") is None:
        raise Skip("gcc not found: the tree kernel needs a C compiler")
    source = out.with_suffix(".c")
    try:
        arrays = tree_arrays(model)
        source.write_text(kernel_source(arrays))
        how = f"tree kernel, complete-tree layout: {len(arrays['feat'])} trees padded to depth {arrays['depth']}"
        files = [source]
    except Skip as why:
        nodes = node_arrays(model)
        nodes_bin, leafv_bin = out.with_suffix(".nodes"), out.with_suffix(".leafv")
        nodes["nodes"].tofile(nodes_bin)
        nodes["leafv"].tofile(leafv_bin)
        source.write_text(node_kernel_source(nodes, nodes_bin.resolve(), leafv_bin.resolve()))
        how = (f"tree kernel, node layout: {len(nodes['roots'])} trees up to depth {nodes['depth']}, {len(nodes['nodes'])} nodes, "
               f"{nodes['k']} output(s){' from leaf vectors' if nodes['vectors'] else ''}{', averaged' if nodes['average'][0] != 1.0 else ''} "
               f"(not the complete-tree layout: {why})")  # fmt: skip
        files = [source, nodes_bin, leafv_bin]
    try:
        _gcc(source, out)
    finally:
        for f in files:
            f.unlink(missing_ok=True)
    return out, how


def compile_tree_kernel(treelite_model: Any, workdir: Path, ctx: ConvertContext, notes: list[str] | None = None) -> Artifact:
    """The tree-kernel candidate of a Treelite model (its format `trees`, served by the runtime's ctypes batch runner)."""
    from ._tree_commons import batch_library_artifact

    path, how = build_kernel(model_dict(treelite_model), workdir / TREE_KERNEL_ARTIFACT)
    return batch_library_artifact("trees", path, ctx, [*(notes or []), how])
