"""Sliced pushes into vLLM's tensor-parallel workers: each worker's own share, already cut and fused
by the reshard plan, copied into its parameters; then vLLM's own weight processing.

Runs in vLLM's interpreter (``server.py`` loads it by path) and imports nothing of hybridflow.
vLLM's loaders take whole checkpoint tensors and cut them per rank; a worker given only its share
has nothing for them to do, so ``place`` goes through vLLM's layerwise reload (the machinery its
own ``reload_weights`` uses, ``vllm.model_executor.model_loader.reload``) without its loaders:

    initialize_layerwise_reload(model)     every layer back to model format, on the meta device
    per layer given tensors:
        materialize_layer                  model-format parameters allocated again
        param.copy_(share)                 the rank's tensors, shapes checked
        _layerwise_process                 vLLM's processing (CPU: oneDNN repacks), copied into
                                           the kernel tensors the engine already holds
    finalize_layerwise_reload              layers given nothing keep what they held; attention

Names and shapes are the model-format parameters vLLM records for its reloads (``server._params``,
what ``hybridflow plan``'s layout must produce). These are vLLM internals (0.32 on a CPU, 0.33 on
GPUs): ``tests/rollout/test_vllm_loader.py`` holds every rank's parameters after a sliced push to
what vLLM's loaders build from the full tensors, element for element (``capturing``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict


def place(model, model_config, tensors: dict) -> None:
    """Copy ``tensors`` (parameter name -> this rank's tensor) into ``model`` and process them."""
    from vllm.model_executor.model_loader.reload import layerwise

    by_layer: dict[str, dict] = defaultdict(dict)
    for name, tensor in tensors.items():
        module, _, param = name.rpartition(".")
        by_layer[module][param] = tensor
    layerwise.initialize_layerwise_reload(model)
    for module, given in by_layer.items():
        layer = model.get_submodule(module)
        info = layerwise.get_layerwise_info(layer)
        _materialize(layer, info)
        for param, tensor in given.items():
            held = getattr(layer, param, None)
            if held is None or tuple(held.shape) != tuple(tensor.shape):
                found = "no parameter" if held is None else f"a parameter of shape {list(held.shape)}"
                raise ValueError(f"sliced push: {module}.{param} {list(tensor.shape)} names {found} of this rank")
            held.data.copy_(tensor)
        info.loaded_weights = []  # nothing left for vLLM's loaders: the shares are in place
        layerwise._layerwise_process(layer, info)
    layerwise.finalize_layerwise_reload(model, model_config)


def _materialize(layer, info) -> None:
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    materialize_layer(layer, info)


@contextlib.contextmanager
def capturing(model, directory: str | None, rank: int):
    """With a ``directory`` (tests): every parameter as it is just before vLLM processes it (its
    loaders' or ``place``'s work, not its kernels' repacking), saved to ``rank<r>.safetensors``."""
    if directory is None:
        yield
        return
    from pathlib import Path

    from safetensors.torch import save_file

    seen: dict = {}
    names = {id(module): name for name, module in model.named_modules()}
    methods = {id(m.quant_method): m.quant_method for m in model.modules() if hasattr(m, "quant_method")}
    methods = {key: method for key, method in methods.items() if method is not None}

    def snapshot(layer) -> None:
        for param, tensor in layer.named_parameters(recurse=False):
            seen[f"{names[id(layer)]}.{param}"] = tensor.detach().to("cpu", copy=True).contiguous()

    for method in methods.values():
        original = method.process_weights_after_loading

        def wrapped(layer, *args, _original=original, **kwargs):
            snapshot(layer)
            return _original(layer, *args, **kwargs)

        method.process_weights_after_loading = wrapped
    try:
        yield
    finally:
        for method in methods.values():
            del method.process_weights_after_loading  # the class's method again
    for module in model.modules():  # layers vLLM does not process (norms): as they are now
        if getattr(module, "quant_method", None) is None:
            for param, tensor in module.named_parameters(recurse=False):
                seen.setdefault(f"{names[id(module)]}.{param}", tensor.detach().to("cpu", copy=True).contiguous())
    save_file(seen, str(Path(directory) / f"rank{rank}.safetensors"))
