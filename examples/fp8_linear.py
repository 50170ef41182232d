#!/usr/bin/env python
"""``python examples/fp8_linear.py [--device cuda] [--recipe mxfp8|1x128]``

A pre-norm block ``h = x + residual; out = Linear(RMSNorm(h))`` whose linear consumes the norm's
e4m3 output directly: ``cake_rmsnorm_fp8`` writes the FP8 data and scales in one pass, and the
linear's autograd function takes them together with the differentiable ``y`` handle, whose gradient
(the linear's dgrad) flows back through the normal RMSNorm backward into x, residual and w.

The GEMM here dequantizes and multiplies in FP32 so the example runs anywhere (CPU included); a real
stack hands ``data`` and ``scales`` to its FP8 GEMM instead (``torch._scaled_mm`` with
``scale_layout="cublas"`` on Blackwell, DeepGEMM with ``scale_layout="deepgemm"`` on Hopper).
The weight gradient needs the activation in a K-major layout; this example dequantizes the saved
rowwise copy, a real FP8 stack saves a columnwise copy or the high-precision input instead.
"""

from __future__ import annotations

import argparse

import torch

from cake_cute import cake_rmsnorm_fp8
from cake_cute.fp8_numerics import dequantize_rows


class Fp8InputLinear(torch.autograd.Function):
    """``y_handle @ weight.T`` computed from the handle's quantized form (data, scales)."""

    @staticmethod
    def forward(ctx, y_handle, data, scales, weight, recipe):
        x_hat = dequantize_rows(data, scales, recipe)  # stands in for an FP8 GEMM on (data, scales)
        ctx.save_for_backward(data, scales, weight)
        ctx.recipe = recipe
        ctx.handle_dtype = y_handle.dtype
        return (x_hat @ weight.float().t()).to(weight.dtype)

    @staticmethod
    def backward(ctx, g):
        data, scales, weight = ctx.saved_tensors
        dgrad = (g.float() @ weight.float()).to(ctx.handle_dtype)  # flows into the RMSNorm backward
        wgrad = (g.float().t() @ dequantize_rows(data, scales, ctx.recipe)).to(weight.dtype)
        return dgrad, None, None, wgrad, None


def block(x, residual, norm_w, linear_w, recipe):
    out = cake_rmsnorm_fp8(x, norm_w, 1e-6, residual=residual, recipe=recipe)
    return Fp8InputLinear.apply(out.y, out.data, out.scales, linear_w, recipe), out.h_new


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recipe", default="mxfp8", choices=("mxfp8", "1x128"))
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens, hidden, out_features = 256, 1024, 512
    kw = dict(device=args.device, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, **kw, requires_grad=True)
    residual = torch.randn(tokens, hidden, **kw, requires_grad=True)
    norm_w = torch.ones(hidden, **kw, requires_grad=True)
    linear_w = (torch.randn(out_features, hidden, **kw) / hidden**0.5).requires_grad_()

    out, h_new = block(x, residual, norm_w, linear_w, args.recipe)
    (out.float().square().mean() + h_new.float().mean()).backward()

    # The same block in bf16 without FP8, for comparison.
    leaves = [t.detach().clone().requires_grad_() for t in (x, residual, norm_w, linear_w)]
    h = leaves[0] + leaves[1]
    y = torch.nn.functional.rms_norm(h.float(), (hidden,), leaves[2].float(), 1e-6).to(torch.bfloat16)
    ref = y @ leaves[3].t()
    (ref.float().square().mean() + h.float().mean()).backward()

    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    print(f"{args.recipe} on {args.device}: output relative error vs bf16 {rel:.4f}")
    for name, got, want in zip(
        ("x", "residual", "norm w", "linear w"), (x, residual, norm_w, linear_w), leaves
    ):
        err = (got.grad.float() - want.grad.float()).norm() / want.grad.float().norm()
        print(f"  grad {name:8s} relative difference {err:.4f}")


if __name__ == "__main__":
    main()
