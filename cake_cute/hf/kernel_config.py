"""``CakeKernelConfig``: the ``transformers.KernelConfig`` that ``cake_cute.hf_kernel_config`` returns.

transformers' own ``KernelConfig.create_compatible_mapping`` registers a local repository for one
``kernels.Mode``, the one the model is in when the config is applied: ``from_pretrained`` applies it
in eval mode, so the ``model.train()`` that follows (a Trainer's) re-kernelizes for training, finds no
layer for that mode and silently puts the stock forward back. And ``from_pretrained`` turns a local
entry into a ``(string, metadata)`` pair that transformers 5.25's method cannot read. This class
registers each layer for every mode instead (the ``kernels`` package's fallback mode) and reads both
spellings, on each device where cake_cute's layers run: a model kernelized on CPU and moved to CUDA
before ``train()`` re-kernelizes there (transformers' own config maps the first device only).
"""

from __future__ import annotations

from pathlib import Path

from transformers import KernelConfig
from transformers.utils.kernel_config import infer_device

from .kernel_layers import DEVICES


class CakeKernelConfig(KernelConfig):
    """A ``KernelConfig`` whose layers (``"/path:Layer"``, local) serve every ``kernelize`` mode, so a
    model keeps them across ``train()`` / ``eval()``. Built by ``cake_cute.hf_kernel_config``."""

    def create_compatible_mapping(self, model, compile=False):
        """Replace ``kernel_mapping`` by the ``kernels`` package's form: each layer name to a
        ``LocalLayerRepository`` on CUDA and CPU, for every mode. ``compile`` (a mode flag) is accepted
        as transformers passes it; every mode is served anyway.

        Raises
        ------
        ValueError
            The model is on another device than CUDA or CPU; an entry is not a ``"/path:Layer"``
            string (or transformers' ``(string, metadata)`` pair).
        """
        from kernels import LocalLayerRepository

        device = infer_device(model)
        if device not in DEVICES:
            raise ValueError(f"cake_cute's kernel layers run on {' and '.join(DEVICES)}, not on {device}")
        mapping = {}
        for name, entry in self.kernel_mapping.items():
            path, layer = _path_and_layer(name, entry)
            repository = LocalLayerRepository(repo_path=Path(path), layer_name=layer)
            mapping[name] = dict.fromkeys(DEVICES, repository)
        self.kernel_mapping = mapping


def _path_and_layer(name: str, entry) -> tuple[str, str]:
    """``(repository path, layer name)`` of a ``"/path:Layer"`` entry or a ``(string, metadata)`` pair."""
    text = entry[0] if isinstance(entry, tuple) and entry else entry
    if isinstance(text, str):
        path, _, layer = text.rpartition(":")
        if path and layer:
            return path, layer
    raise ValueError(f"kernel_mapping[{name!r}] must be '/path:Layer' for CakeKernelConfig, got {entry!r}")
