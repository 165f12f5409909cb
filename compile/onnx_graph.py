"""Rewrite a converted ONNX graph to the Triton tensor contract: input `features`, one named output.

Converters name their tensors as they like (`input`, `label`/`probabilities`, `variable`); serving
needs exactly `features` FP32 [batch, n] in and the task's tensor out (binary: positive-class
probability [batch, 1]) with a dynamic batch dimension.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from scorestack import schema

BATCH_DIM = "batch"
DEFAULT_OPSET = 15


def _rename_everywhere(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    for coll in (graph.input, graph.output, graph.value_info):
        for vi in coll:
            if vi.name == old:
                vi.name = new


def _set_dims(vi: onnx.ValueInfoProto, dims: list[int | str]) -> None:
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        else:
            dim.dim_value = d


def to_contract(
    model: onnx.ModelProto,
    task: str,
    n_features: int,
    source_output: str | int,
    column: int | None = None,
    n_outputs: int = 1,
) -> onnx.ModelProto:
    """Return a copy of `model` with input `features` and the task's output tensor.

    `source_output` names (or indexes) the converted graph's output holding the scores;
    `column` selects one column of it (binary: 1 for the positive class); `n_outputs` is the
    output width (1, or the class count for multiclass).
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if not any(op.domain in ("", "ai.onnx") for op in model.opset_import):
        # Tree-only graphs (onnxmltools) import just ai.onnx.ml; the added Slice/Reshape need the default domain.
        model.opset_import.append(helper.make_opsetid("", DEFAULT_OPSET))
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in initializers]
    if len(real_inputs) != 1:
        raise ValueError(f"expected one graph input, found {[i.name for i in real_inputs]}")
    inp = real_inputs[0]
    if inp.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise ValueError(f"graph input {inp.name!r} is not float32")
    if inp.name != schema.INPUT_TENSOR:
        _rename_everywhere(graph, inp.name, schema.INPUT_TENSOR)
    _set_dims(inp, [BATCH_DIM, n_features])

    out_name = schema.OUTPUT_TENSORS[task]
    src = graph.output[source_output].name if isinstance(source_output, int) else source_output
    if src not in {o.name for o in graph.output}:
        raise ValueError(f"converted graph has no output {src!r} (has {[o.name for o in graph.output]})")
    raw = f"{out_name}__raw"
    _rename_everywhere(graph, src, raw)
    src_elem = next(o for o in graph.output if o.name == raw).type.tensor_type.elem_type

    nodes = []
    cur = raw
    if column is not None:
        consts = {
            f"{out_name}__starts": [column],
            f"{out_name}__ends": [column + 1],
            f"{out_name}__axes": [1],
        }
        for name, vals in consts.items():
            graph.initializer.append(helper.make_tensor(name, TensorProto.INT64, [1], vals))
        nodes.append(helper.make_node("Slice", [cur, *consts], [f"{out_name}__col"], name=f"{out_name}_select_column"))
        cur = f"{out_name}__col"
    shape_name = f"{out_name}__shape"
    graph.initializer.append(helper.make_tensor(shape_name, TensorProto.INT64, [2], [-1, n_outputs]))
    if src_elem != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [cur], [f"{out_name}__f32"], to=TensorProto.FLOAT, name=f"{out_name}_cast"))
        cur = f"{out_name}__f32"
    nodes.append(helper.make_node("Reshape", [cur, shape_name], [out_name], name=f"{out_name}_reshape"))
    graph.node.extend(nodes)

    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [BATCH_DIM, n_outputs]))
    # Value infos of renamed/removed tensors can contradict the new shapes; ORT re-infers them.
    del graph.value_info[:]
    _drop_dead_nodes(graph)
    onnx.checker.check_model(model)
    return model


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes no graph output depends on (e.g. a dropped `label` branch)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    used = needed
    live_inits = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live_inits)
