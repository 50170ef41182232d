"""The implementations a sweep times, behind one interface: ``forward(x, w, residual)`` returns (y,) or
(y, h_new) with autograd, and the backward is whatever that forward's graph runs.

Each peer is imported inside its constructor, so a missing peer is skipped with a note.
"""

from __future__ import annotations


class Impl:
    """An implementation under test: ``forward(x, w, residual)`` with autograd, on leaf inputs."""

    name = "?"

    def forward(self, x, w, residual):
        """(y,) or (y, h_new) for ``residual`` None or a tensor; the backward is this graph's."""
        raise NotImplementedError

    def after_backward(self, tensors) -> None:
        """Restore what a backward overwrote in ``tensors`` (one input set); nothing by default."""


class _Cake(Impl):
    name = "cake_cute"

    def __init__(self, torch, eps):
        import cake_cute

        self._fn = cake_cute.cake_rmsnorm
        self._eps = eps

    def forward(self, x, w, residual):
        out = self._fn(x, w, self._eps, residual=residual)
        return out if isinstance(out, tuple) else (out,)


class _TorchEager(Impl):
    name = "torch"

    def __init__(self, torch, eps):
        self._rms_norm = torch.nn.functional.rms_norm
        self._eps = eps

    def forward(self, x, w, residual):
        if residual is None:
            return (self._rms_norm(x, (x.shape[-1],), w, self._eps),)
        h = x + residual
        return self._rms_norm(h, (h.shape[-1],), w, self._eps), h


class _TorchCompile(Impl):
    """torch.compile(fullgraph=True) of an FP32 reference, one graph per shape and a dynamo reset
    between shapes, so guards never accumulate."""

    name = "compile"

    def __init__(self, torch, eps):
        import torch._dynamo  # a lazy submodule: make torch._dynamo.config reachable
        import triton  # noqa: F401  (inductor's GPU backend; fail early with a clear skip note)

        self._torch = torch
        for mod, names, value in (
            (torch._dynamo.config, ("recompile_limit", "cache_size_limit"), 64),
            (torch._dynamo.config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4096),
        ):
            for n in names:
                if hasattr(mod, n):
                    setattr(mod, n, value)
        try:  # donated buffers forbid backward(retain_graph=True) on the compiled graph
            import torch._functorch.config as fconfig

            if hasattr(fconfig, "donated_buffer"):
                fconfig.donated_buffer = False
        except Exception:
            pass

        def plain(x, w):
            xf = x.float()
            rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            return (xf * rstd * w.float()).to(x.dtype)

        def with_residual(x, r, w):
            h = x + r
            hf = h.float()
            rstd = torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
            return (hf * rstd * w.float()).to(x.dtype), h

        self._plain, self._with_residual = plain, with_residual
        self._key = None
        self._fn = None

    def forward(self, x, w, residual):
        key = (tuple(x.shape), x.dtype, w.dtype, residual is not None)
        if key != self._key:
            self._fn = None
            self._torch._dynamo.reset()
            src = self._plain if residual is None else self._with_residual
            self._fn = self._torch.compile(src, dynamic=False, fullgraph=True)
            self._key = key
        if residual is None:
            return (self._fn(x, w),)
        return self._fn(x, residual, w)


class _Liger(Impl):
    """Liger-Kernel's RMSNorm modules with their defaults (LigerRMSNorm writes dx over dy)."""

    name = "liger"

    def __init__(self, torch, eps):
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        self._plain = LigerRMSNormFunction
        self._fused = LigerFusedAddRMSNormFunction
        self._eps = eps

    def forward(self, x, w, residual):
        if residual is None:
            # (X, W, eps, offset, casting_mode, in_place)
            return (self._plain.apply(x, w, self._eps, 0.0, "llama", True),)
        # (X, R, W, eps, offset, casting_mode, in_place) -> (Y, S = X + R)
        return tuple(self._fused.apply(x, residual, w, self._eps, 0.0, "llama", False))

    def after_backward(self, tensors):
        # in_place=True wrote dx into the upstream gradient: give the next rows fresh values
        tensors["g"].normal_()


class _Quack(Impl):
    name = "quack"

    def __init__(self, torch, eps):
        import inspect

        from quack.rmsnorm import rmsnorm

        self._fn = rmsnorm
        self._eps = eps
        self._has_prenorm = "prenorm" in inspect.signature(rmsnorm).parameters

    def forward(self, x, w, residual):
        if residual is None:
            return (self._fn(x, w, eps=self._eps),)
        if not self._has_prenorm:
            raise RuntimeError("this quack version's rmsnorm() has no prenorm= (cannot return h_new)")
        out = self._fn(x, w, residual=residual, eps=self._eps, prenorm=True)
        return tuple(out)


FACTORIES = {
    "cake_cute": _Cake,
    "torch": _TorchEager,
    "compile": _TorchCompile,
    "liger": _Liger,
    "quack": _Quack,
}
DIST_NAMES = {
    "liger": "liger-kernel",
    "quack": "quack-kernels",
    "cake_cute": "cake-cute",
    "triton": "triton",
    "cutlass": "nvidia-cutlass-dsl",
}


def versions() -> dict:
    """Installed versions of the implementations and their compilers, by short name."""
    from importlib import metadata

    out = {}
    for key, dist in DIST_NAMES.items():
        try:
            out[key] = metadata.version(dist)
        except Exception:
            pass
    return out


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """An error that poisons the CUDA context: nothing after it can be measured."""
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "illegal memory access",
            "unspecified launch failure",
            "illegal instruction",
            "misaligned address",
            "device-side assert",
            "an illegal",
            "cuda error: launch",
        )
    )
