"""The Megatron-Core norm builders: ``CakeRMSNorm`` built from a ``TransformerConfig`` through Megatron's
norm-builder protocol, one class per norm slot of a GPT layer spec, and the opt-in Gated DeltaNet
subclass whose output norm and gate are one gated kernel. They read the config's norm fields and refuse
by name what they cannot honour; none of this needs Megatron-Core itself.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..gated.autograd import cake_gated_rmsnorm
from ..library_ops import norm_backward, save_for_backward
from ..module import CakeRMSNorm  # importing it registers the torch.ops.cake_cute ops used below
from ..runtime.views import kernel_weight

__all__ = [
    "check_norm_config",
    "with_fused_output_gate",
    "MegatronCakeInputRMSNorm",
    "MegatronCakeQKRMSNorm",
    "MegatronCakeRMSNorm",
    "MegatronCakeResidualRMSNorm",
]


def _config_flag(config, name: str) -> bool:
    """A boolean field of a Megatron config; False where this Megatron version has no such field."""
    return bool(getattr(config, name, False))


def _recomputes_norms(config) -> bool:
    """Whether Megatron recomputes the layers' norms in the backward (selective ``"layernorm"``)."""
    modules = getattr(config, "recompute_modules", None) or ()
    return getattr(config, "recompute_granularity", None) == "selective" and "layernorm" in modules


def check_norm_config(config) -> None:
    """Refuse, by field name, a config whose norm cake_cute would compute differently."""
    normalization = getattr(config, "normalization", None)
    if normalization != "RMSNorm":
        raise ValueError(
            f"config.normalization must be 'RMSNorm' for a cake_cute norm, got {normalization!r}: "
            "cake_cute implements RMSNorm only; keep Megatron's own norm spec for other norms"
        )


def _weight_device(config) -> torch.device:
    """Where Megatron puts a norm's weight at construction, after the config."""
    if _config_flag(config, "use_cpu_initialization"):
        return torch.device("cpu")
    if _config_flag(config, "init_model_with_meta_device"):
        return torch.device("meta")
    if not torch.cuda.is_available():
        raise ValueError(
            "config.use_cpu_initialization is False, so the norm's weight goes on the current CUDA "
            "device, but CUDA is not available; set use_cpu_initialization=True to build on the CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


class _NormKeepingInput(torch.autograd.Function):
    """``(y, x)``: the norm of x and x itself, whose gradients the backward adds in its last step, as
    ``fused_residual_rmsnorm`` asks; the residual-mode rule with x as h_new."""

    @staticmethod
    def forward(ctx, x, w, eps, weight_offset, memory_efficient):
        y, rstd, _ = torch.ops.cake_cute.rmsnorm_fwd(x, w, eps, None, weight_offset)
        saved_output = y if memory_efficient else None
        save_for_backward(ctx, x, w, x, rstd, x, eps, weight_offset, direct=False, y=saved_output)
        return y, x

    @staticmethod
    def backward(ctx, g, g_residual):
        dx, dw, _ = norm_backward(ctx, g, g_residual)
        return dx, dw, None, None, None


class MegatronCakeRMSNorm(CakeRMSNorm):
    """``CakeRMSNorm`` built from a Megatron ``TransformerConfig`` through Megatron's norm-builder protocol,
    as a layer spec names ``TENorm`` or ``WrappedTorchNorm``.

    Parameters
    ----------
    config : megatron.core.transformer.TransformerConfig
        Read at construction: ``normalization`` (``"RMSNorm"``), ``layernorm_zero_centered_gamma``
        (``1 + weight``), ``sequence_parallel``, ``fused_residual_rmsnorm``, ``params_dtype``,
        ``use_cpu_initialization``, ``init_model_with_meta_device``, ``memory_efficient_layer_norm``
        (the memory-efficient mode) and the recomputed modules; ``persist_layer_norm`` changes nothing.
    hidden_size : int
        The normalized dimension: the hidden size, or the head size for q/k norms.
    eps : float, optional
        Added to the mean square; default ``config.layernorm_epsilon``.
    has_residual : bool
        The input is also the layer's residual: with ``config.fused_residual_rmsnorm`` the forward
        returns ``(output, input)`` and its backward adds the residual's gradient into dx.

    Raises
    ------
    ValueError
        ``normalization`` is not ``"RMSNorm"``; the weight would go on CUDA without CUDA; the fused
        residual form under selective recomputation of the norms; ``CakeRMSNorm``'s errors.
    """

    def __init__(self, *, config, hidden_size, eps=None, has_residual=False):
        check_norm_config(config)
        zero_centered = _config_flag(config, "layernorm_zero_centered_gamma")
        super().__init__(
            hidden_size,
            eps=config.layernorm_epsilon if eps is None else eps,
            device=_weight_device(config),
            dtype=getattr(config, "params_dtype", None),
            weight_offset=1.0 if zero_centered else 0.0,
            sequence_parallel=_config_flag(config, "sequence_parallel"),
            memory_efficient=_config_flag(config, "memory_efficient_layer_norm"),
        )
        self.fused_residual = bool(has_residual) and _config_flag(config, "fused_residual_rmsnorm")
        if self.fused_residual and _recomputes_norms(config):
            raise ValueError(
                "config.fused_residual_rmsnorm cannot be combined with config.recompute_modules "
                "containing 'layernorm' (recompute_granularity='selective'): Megatron frees every output of "
                "a recomputed norm after the attention or MLP has read it, and the fused form's second "
                "output is the residual, which the layer still adds afterwards; turn one of them off"
            )

    def forward(self, input: torch.Tensor, *, residual: torch.Tensor | None = None):
        """The normalized input, or ``(normalized, input)`` where the fused residual form is on.

        Parameters
        ----------
        input : torch.Tensor
            ``[s, b, h]`` hidden states (the local sequence shard under sequence parallelism).
        residual : torch.Tensor, optional
            As for ``CakeRMSNorm`` (not used by Megatron's layers).

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            y; ``(y, input)`` in the fused residual form; ``(y, input + residual)`` with ``residual``.

        Raises
        ------
        TypeError, ValueError
            The errors of ``CakeRMSNorm.forward``.
        """
        if not self.fused_residual or residual is not None:
            return super().forward(input, residual=residual)
        w = kernel_weight(self.weight, input)
        return _NormKeepingInput.apply(input, w, self.eps, self.weight_offset, self.memory_efficient)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fused_residual=True" if self.fused_residual else "")


class MegatronCakeResidualRMSNorm(MegatronCakeRMSNorm):
    """``MegatronCakeRMSNorm`` with ``has_residual=True``: the input and pre-MLP norms of a layer spec."""

    def __init__(self, *, config, hidden_size, eps=None, has_residual=True):
        super().__init__(config=config, hidden_size=hidden_size, eps=eps, has_residual=has_residual)


class MegatronCakeQKRMSNorm(MegatronCakeRMSNorm):
    """``MegatronCakeRMSNorm`` for the per-head q/k norms.

    Raises
    ------
    ValueError
        ``config.qk_l2_norm`` is set (those are Megatron's weightless ``L2Norm``, which a spec keeps), or
        ``config.qk_layernorm`` is off.
    """

    def __init__(self, *, config, hidden_size, eps=None, has_residual=False):
        if _config_flag(config, "qk_l2_norm"):
            raise ValueError(
                "config.qk_l2_norm is set, so the q/k norms are Megatron's weightless L2Norm; use a spec "
                "whose q/k norms are L2Norm (get_gpt_layer_spec(qk_l2_norm=True)) instead of cake norms"
            )
        if not _config_flag(config, "qk_layernorm"):
            raise ValueError(
                "config.qk_layernorm is off but the layer spec has q/k norms: use gpt_layer_spec (which "
                "follows the config) or get_gpt_layer_spec(qk_layernorm=False), or set qk_layernorm"
            )
        super().__init__(config=config, hidden_size=hidden_size, eps=eps, has_residual=has_residual)


class MegatronCakeInputRMSNorm(MegatronCakeResidualRMSNorm):
    """``MegatronCakeResidualRMSNorm`` as the input norm of a layer spec without q/k norms, which Megatron
    builds without them whatever the config says; so it refuses ``config.qk_layernorm``.

    Raises
    ------
    ValueError
        ``config.qk_layernorm`` is set.
    """

    def __init__(self, *, config, hidden_size, eps=None, has_residual=True):
        if _config_flag(config, "qk_layernorm"):
            raise ValueError(
                "config.qk_layernorm is set but the layer spec has no q/k norms: use gpt_layer_spec (which "
                "follows the config) or get_gpt_layer_spec(qk_layernorm=True); for a hybrid model, "
                "hybrid_stack_spec_qk_norm"
            )
        super().__init__(config=config, hidden_size=hidden_size, eps=eps, has_residual=has_residual)


@functools.cache
def with_fused_output_gate(layer_class: type) -> type:
    """``layer_class`` (Megatron's Gated DeltaNet) with its output norm and SiLU gate run as one gated
    kernel: ``round(x * rstd * (w + offset) * silu(float(z)))``, one rounding, where the stock layer
    rounds the norm's output before its gate. Parameters and checkpoint keys stay ``layer_class``'s.

    Parameters
    ----------
    layer_class : type
        A Megatron layer whose ``_apply_gated_norm(x, gate)`` normalizes x with ``self.out_norm`` (a
        ``MegatronCakeRMSNorm``) and gates it with ``self.act_fn``.

    Returns
    -------
    type
        Its subclass (one per class). Building it raises ``ValueError`` where the activation is not
        SiLU or ``config.memory_efficient_layer_norm`` is set (the gated kernels have no such mode),
        ``TypeError`` where ``out_norm`` is not a ``MegatronCakeRMSNorm``.
    """

    def __init__(self, *args, **kwargs):
        layer_class.__init__(self, *args, **kwargs)
        if self.act_fn is not F.silu:
            raise ValueError(
                "the fused output gate applies SiLU: config.activation_func must be F.silu, got "
                f"{getattr(self.act_fn, '__name__', self.act_fn)!r}"
            )
        if not isinstance(self.out_norm, MegatronCakeRMSNorm):
            raise TypeError(
                f"the fused output gate needs a MegatronCakeRMSNorm out_norm, got {type(self.out_norm)}"
            )
        if self.out_norm.memory_efficient:
            raise ValueError(
                "config.memory_efficient_layer_norm: the fused output gate has no memory-efficient mode "
                "(it saves x, the gate, w and rstd); turn one of them off"
            )

    def _apply_gated_norm(self, x, gate):
        norm, hidden = self.out_norm, x.shape[-1]
        x, gate = x.reshape(-1, hidden), gate.reshape(-1, hidden)
        return cake_gated_rmsnorm(
            x, gate, kernel_weight(norm.weight, x), norm.eps, weight_offset=norm.weight_offset
        )

    namespace = {"__init__": __init__, "_apply_gated_norm": _apply_gated_norm, "__module__": __name__}
    namespace["__doc__"] = (
        f"{layer_class.__name__} with its output norm and gate fused (``with_fused_output_gate``)."
    )
    return type(f"CakeFusedGate{layer_class.__name__}", (layer_class,), namespace)
