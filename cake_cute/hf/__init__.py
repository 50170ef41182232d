"""Hugging Face model surgery: reading a transformers norm, swapping it for ``CakeRMSNorm``, and fusing
the residual add of decoder layers into the norm that follows it; and transformers' own kernel route to
cake_cute's norms (``kernel_layers``, ``kernel_route``, ``kernel_config``)."""
