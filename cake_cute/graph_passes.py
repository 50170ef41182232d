"""A torch.compile pass that folds the gradient adds in front of the norm's backward into its kernel.

The norm's output feeds two or three projections, so its gradient is ``add(add(dq, dk), dv)``, which
inductor would store as one tensor for the norm's backward to read again. ``fold_gradient_sums``
rewrites ``rmsnorm_bwd(add(add(a, b), c), ...)`` into ``rmsnorm_bwd_parts([a, b, c], ...)`` (and the
memory-efficient backward likewise), whose kernel reads the summands itself: one write, one read and
one launch less per norm.

Bits: inductor's fused add sums in FP32 and rounds once (with ``emulate_precision_casts`` it rounds
each add, and nothing is folded); the kernel does the same. That holds when each summand is a value
inductor stores anyway, so only left-nested chains of plain adds of up to three summands, each a graph
input or a matrix product's output (possibly viewed), with x's shape, dtype and device, are folded.

Use: ``torch.compile(model, options={"post_grad_custom_post_pass": gradient_sum_pass})``.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .validation import MAX_GRADIENT_PARTS

_aten = torch.ops.aten
_ADD = _aten.add.Tensor
_MATRIX_PRODUCTS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _like(arg, x) -> bool:
    val = _value(arg)
    facts = (x.shape, x.dtype, x.device)
    return isinstance(val, torch.Tensor) and (val.shape, val.dtype, val.device) == facts


def _foldable_add(node, x) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is _ADD
        and not node.kwargs
        and len(node.args) == 2
        and len(node.users) == 1
        and all(_like(arg, x) for arg in node.args)
    )


def _materialized(node) -> bool:
    """A graph input or a matrix product's output (possibly viewed): stored whatever inductor fuses."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node.op == "placeholder" or (node.op == "call_function" and node.target in _MATRIX_PRODUCTS)


def _summands(g, x) -> list:
    """The summands of the left-nested add chain ``g``, in order (``[g]`` when it is no such chain)."""
    if not _foldable_add(g, x):
        return [g]
    left, right = g.args
    return [*_summands(left, x), right]


def fold_gradient_sums(graph: torch.fx.Graph) -> int:
    """Fold each foldable gradient sum of a post-grad ``graph`` into its backward; return the count."""
    if torch._inductor.config.emulate_precision_casts:
        return 0
    ops = torch.ops.cake_cute
    folded_ops = {
        ops.rmsnorm_bwd.default: ops.rmsnorm_bwd_parts.default,
        ops.rmsnorm_bwd_from_output.default: ops.rmsnorm_bwd_from_output_parts.default,
    }
    backward_calls = [node for op in folded_ops for node in graph.find_nodes(op="call_function", target=op)]
    folded = 0
    for node in backward_calls:
        g, x = node.args[0], _value(node.args[1])
        parts = _summands(g, x)
        if not 2 <= len(parts) <= MAX_GRADIENT_PARTS or not all(map(_materialized, parts)):
            continue
        with graph.inserting_before(node):
            folded_call = graph.call_function(
                folded_ops[node.target], (parts, *node.args[1:]), dict(node.kwargs)
            )
        folded_call.meta.update(node.meta)
        if "eager_input_vals" in node.meta:  # the traced argument values inductor lays outputs out by
            args, kwargs = node.meta["eager_input_vals"]
            folded_call.meta["eager_input_vals"] = (([_value(p) for p in parts], *args[1:]), kwargs)
        node.replace_all_uses_with(folded_call)
        graph.erase_node(node)
        while g.op == "call_function" and g.target is _ADD and not g.users:  # the chain, now unused
            left = g.args[0]
            graph.erase_node(g)
            g = left
        folded += 1
    return folded


class GradientSumPass(CustomGraphPass):
    """``fold_gradient_sums`` as an inductor post-grad pass (its uuid keys inductor's caches)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fold_gradient_sums(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


gradient_sum_pass = GradientSumPass()
