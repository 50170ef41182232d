"""cake_cute's norms for Hugging Face's kernel route: the layers are cake_cute.hf.kernel_layers."""

from cake_cute.hf import kernel_layers as layers

__all__ = ["layers"]
