"""``CakeKernelConfig``: the ``transformers.KernelConfig`` that ``cake_cute.hf_kernel_config`` returns.

transformers' own ``create_compatible_mapping`` registers a local repository for the one mode the
model is in when the config is applied (eval, under ``from_pretrained``), so a later ``train()``
silently puts the stock forward back; it also cannot read the ``(string, metadata)`` pair
``from_pretrained`` makes of a local entry, and maps the first device only. This class registers each
layer for every mode, on each device where cake_cute's layers run, and reads both spellings.
"""

from __future__ import annotations

from pathlib import Path

from transformers import KernelConfig
from transformers.utils.kernel_config import infer_device

from .kernel_layers import DEVICES


class CakeKernelConfig(KernelConfig):
    """A ``KernelConfig`` whose local layers serve every ``kernelize`` mode."""

    def create_compatible_mapping(self, model, compile=False):
        """Replace ``kernel_mapping`` by the ``kernels`` package's form: each layer name to a
        ``LocalLayerRepository`` on CUDA and CPU, for every mode (``compile`` is accepted as transformers
        passes it).

        Raises
        ------
        ValueError
            The model is on another device than CUDA or CPU; an entry is not a ``"/path:Layer"`` string
            (or transformers' ``(string, metadata)`` pair).
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
