"""Hugging Face's own kernel route to cake_cute's norms.

transformers decorates its norm classes with the layer names ``"RMSNorm"``, ``"RMSNormZeroCentered"``
and ``"RMSNormGated"``; ``from_pretrained(..., use_kernels=True, kernel_config=...)``,
``set_use_kernels`` and the ``kernels`` package's ``kernelize`` replace their forwards with a kernel
layer's. cake_cute ships its layers as a local layer repository inside the package (``REPOSITORY``),
so the route needs no network. ``hf_kernel_config`` and ``hf_kernel_mapping`` read the model first
and refuse by name, before any work, a class cake_cute cannot compute faithfully, and releases older
than ``MIN_TRANSFORMERS`` / ``MIN_KERNELS``, which would silently fall back to the stock forward.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch
from torch import nn

from . import kernel_layers
from .kernel_layers import DEVICES, gated_form
from .norm_reading import NormNotServed
from .swap import hf_rmsnorm_reading

# The local layer repository shipped in the package, and the layer serving each transformers layer name.
REPOSITORY = Path(__file__).resolve().parent / "cake_cute_norms"
LAYERS = {
    "RMSNorm": "CakeHFRMSNorm",
    "RMSNormZeroCentered": "CakeHFRMSNormZeroCentered",
    "RMSNormGated": "CakeHFRMSNormGated",
}
_READINGS = {
    "RMSNorm": hf_rmsnorm_reading,
    "RMSNormZeroCentered": hf_rmsnorm_reading,
    "RMSNormGated": gated_form,
}
# The oldest releases the route is tested with (transformers asks for its own range of kernels).
MIN_TRANSFORMERS = "5.17.0"
MIN_KERNELS = "0.16.0"


def hf_kernel_config(model, *, layers=None):
    """The ``transformers.KernelConfig`` that puts cake_cute's norms in ``model`` through transformers'
    kernel route (``from_pretrained(..., use_kernels=True, kernel_config=cfg)`` or
    ``model.set_use_kernels(True, kernel_config=cfg)``): each replaced norm computes what the swaps would
    put in its place, in every ``kernels.Mode``, across ``train()`` / ``eval()``, on CUDA and CPU.

    Parameters
    ----------
    model : torch.nn.Module or transformers.PretrainedConfig
        The model, or the config it will be built from (read through a meta-device skeleton).
    layers : iterable of str, optional
        The transformers layer names to map; default every one ``model`` has.

    Returns
    -------
    cake_cute.hf.kernel_config.CakeKernelConfig
        A ``transformers.KernelConfig`` with ``use_local_kernel=True``.

    Raises
    ------
    ImportError
        transformers or kernels missing, too old, or unable to load cake_cute's layer repository.
    NormNotServed (a ValueError)
        A class under a mapped name that cake_cute cannot compute faithfully, named with the reason.
    ValueError
        model has none of the layer names; ``layers`` names one not served or not in the model;
        ``USE_HUB_KERNELS`` turns transformers' route off.
    TypeError
        model is neither a module nor a transformers config; ``layers`` is a string.
    """
    names = _checked_names(model, layers)
    _check_enabled()
    from .kernel_config import CakeKernelConfig

    return CakeKernelConfig({name: f"{REPOSITORY}:{LAYERS[name]}" for name in names}, use_local_kernel=True)


def hf_kernel_mapping(model, *, layers=None) -> dict:
    """The ``kernels`` package's mapping to cake_cute's layers for ``model``, on CUDA and CPU, every mode:
    ``with kernels.use_kernel_mapping(mapping): kernels.kernelize(model, mode=Mode.TRAINING)``. The same
    reading and refusals as ``hf_kernel_config``.

    Parameters
    ----------
    model : torch.nn.Module or transformers.PretrainedConfig
        As for ``hf_kernel_config``.
    layers : iterable of str, optional
        As for ``hf_kernel_config``.

    Returns
    -------
    dict
        ``{layer name: {"cuda": repository, "cpu": repository}}``, each a ``kernels.LocalLayerRepository``.

    Raises
    ------
    ImportError, NormNotServed, ValueError, TypeError
        As ``hf_kernel_config``.
    """
    names = _checked_names(model, layers)
    return {name: dict.fromkeys(DEVICES, _repository(name)) for name in names}


def _repository(name: str):
    from kernels import LocalLayerRepository

    return LocalLayerRepository(repo_path=REPOSITORY, layer_name=LAYERS[name])


def _checked_names(model, layers) -> list[str]:
    """The layer names to map for ``model`` (``hf_kernel_config``'s checks, in its order)."""
    _check_versions()
    modules = _route_modules(_readable(model))
    names = _chosen(modules, layers, type(model).__name__)
    _check_served(modules, names)
    _check_loads(names)
    return names


def _check_versions() -> None:
    from packaging.version import Version

    for package, oldest in (("transformers", MIN_TRANSFORMERS), ("kernels", MIN_KERNELS)):
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(
                f"cake_cute's kernel route needs {package} >= {oldest} (pip install 'cake-cute[hf-kernels]')"
            ) from None
        if Version(installed) < Version(oldest):
            raise ImportError(
                f"cake_cute's kernel route needs {package} >= {oldest}; {installed} is installed"
            )


def _check_enabled() -> None:
    """transformers' own switch ``USE_HUB_KERNELS``, which when off keeps the stock norms silently."""
    from transformers.integrations import hub_kernels

    enabled = getattr(hub_kernels, "_kernels_enabled", True)  # a function from 5.25, a flag before
    if not (enabled() if callable(enabled) else enabled):
        raise ValueError(
            "USE_HUB_KERNELS turns transformers' kernel route off, so use_kernels=True would keep the stock "
            "norms: unset it (or set USE_HUB_KERNELS=YES)"
        )


def _readable(model) -> nn.Module:
    """``model``, or the skeleton of a transformers config's model on the meta device."""
    if isinstance(model, nn.Module):
        return model
    import transformers

    if not isinstance(model, transformers.PretrainedConfig):
        raise TypeError(
            f"model must be a torch.nn.Module or a transformers config, got {type(model).__name__}"
        )
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(model)
        except ValueError:  # no causal LM for this config
            return transformers.AutoModel.from_config(model)


def _route_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules transformers' route replaces under each layer name cake_cute serves."""
    found: dict[str, list[nn.Module]] = {}
    for module in dict.fromkeys(model.modules()):
        name = getattr(type(module), "kernel_layer_name", None)
        if name in LAYERS:
            found.setdefault(name, []).append(module)
    return found


def _chosen(modules: dict, layers, model_name: str) -> list[str]:
    if layers is None:
        if not modules:
            raise ValueError(
                f"{model_name} has no module that transformers' kernel route replaces as {', '.join(LAYERS)} "
                "(its norms are not decorated for it): swap_rmsnorm / swap_gated_rmsnorm serve them"
            )
        return sorted(modules)
    if isinstance(layers, str):
        raise TypeError(f"layers must be an iterable of layer names, not the string {layers!r}")
    names = list(dict.fromkeys(layers))
    for name in names:
        if name not in LAYERS:
            raise ValueError(f"layers: cake_cute serves {', '.join(LAYERS)}, not {name!r}")
        if name not in modules:
            raise ValueError(f"layers: {model_name} has no module registered as {name!r}")
    return names


def _check_served(modules: dict, names: list[str]) -> None:
    refused = {}
    for name in names:
        for module in modules[name]:
            try:
                _READINGS[name](module)
            except NormNotServed as refusal:
                refused[type(module).__name__] = str(refusal)
    if refused:
        reasons = "; ".join(refused.values())
        raise NormNotServed(
            f"cake_cute's kernel layers cannot compute these norms as their classes do: {reasons} "
            "(pass layers= without their layer names to keep these classes' own forward)"
        )


def _check_loads(names: list[str]) -> None:
    """Load each layer now: transformers would fall back silently to the stock forward."""
    for name in names:
        try:
            loaded = _repository(name).load()
        except Exception as error:
            version = importlib.metadata.version("kernels")
            raise ImportError(
                f"kernels {version} cannot load cake_cute's layer repository {REPOSITORY}: {error}"
            ) from error
        if loaded is not getattr(kernel_layers, LAYERS[name]):
            raise ImportError(f"{REPOSITORY} gave another {LAYERS[name]} than cake_cute.hf.kernel_layers'")
