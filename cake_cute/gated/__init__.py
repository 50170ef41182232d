"""Gated RMSNorm (norm then gate, gate then norm over groups): the kernels' entries, autograd, module,
swap of the Hugging Face gated classes, FlashInfer's spellings and the DTensor rules."""
