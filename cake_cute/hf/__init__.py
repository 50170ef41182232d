"""Hugging Face model surgery: reading a transformers norm, swapping it for ``CakeRMSNorm``, and fusing
the residual add of decoder layers into the norm that follows it."""
