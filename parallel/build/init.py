"""Weights for a DiT that was built on the meta device and sharded with FSDP2, filled one parameter at
a time so that no rank ever holds the whole model (a 14B model is 56 GB in float32):

- from train.seed: each parameter is made whole on the host from its own generator (models.dit.transformer
  init_parameter and parameter_generator), then only this rank's rows are kept. The weights are those
  of `DiT.init_weights(seed=...)` on one process, whatever the layout;
- from model.pretrained: each rank reads only its rows from the safetensors files (models.dit.wan.WanWeights).
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from models.dit.transformer import init_parameter
from models.float8 import SCALE, is_float8, quantize_into
from models.layers import parameter_generator
from models.lora import is_adapter, seeded_adapter

# Wrappers that parallel/compute/fsdp.py may put around a block; state-dict names leave them out.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param.data


def is_scale(name: str) -> bool:
    """Whether a parameter name is that of a float8 weight's row scales (models/float8.py SCALE)."""
    return name.endswith("." + SCALE)


def derived_scales(model: nn.Module) -> set[str]:
    """The canonical names of the row scales of `model`'s float8 weights: derived from the weight as it is
    written, never read from a file (a parameter of that name beside a weight in another dtype is read)."""
    return {
        canonical_name(f"{name}.{SCALE}")
        for name, module in model.named_modules()
        if getattr(module, SCALE, None) is not None and is_float8(_local(module.weight))
    }


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows (along dim 0) of the whole parameter that this rank holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise NotImplementedError(f"parameter sharded along a dimension other than 0: {param.placements}")
    return offset[0], offset[0] + shape[0]


@torch.no_grad()
def materialize(
    model: nn.Module,
    device,
    seed: int,
    pretrained=None,
    zero_init: bool = True,
    partial: bool = False,
    adapter_seed: int = 0,
    adapter_start: dict | None = None,
) -> None:
    """Allocate `model`'s (sharded) parameters on `device` and fill them: from `pretrained` (a
    models.dit.wan.WanWeights) if given, else from `seed`; LoRA adapters from `adapter_seed` (lora.seed), or
    from `adapter_start` {name: whole tensor} where it has them (lora.init_from).
    `partial`: the model holds only some of the pretrained weights (a PipeFusion stage)."""
    model.to_empty(device=device)
    names, derived = [canonical_name(name) for name, _ in model.named_parameters()], derived_scales(model)
    if pretrained is not None:
        pretrained.check_parameters((n for n in names if not is_adapter(n) and n not in derived), partial)
    unused = set(adapter_start or {})
    for name, param in model.named_parameters():
        canonical = canonical_name(name)
        if canonical in derived:
            continue  # written with its float8 weight
        local = _local(param)
        start, stop = local_rows(param)
        if is_adapter(canonical):
            unused.discard(canonical)
            whole = (adapter_start or {}).get(canonical)
            if whole is None:
                whole = seeded_adapter(canonical, param.shape, adapter_seed)
            rows = whole[start:stop]
        elif pretrained is not None:
            expected = tuple(pretrained.shape(canonical))
            if expected != tuple(param.shape):
                raise ValueError(
                    f"model.pretrained: '{canonical}' has shape {expected} in {pretrained.folder}, "
                    f"the model expects {tuple(param.shape)}"
                )
            rows = pretrained.read(canonical, start, stop)
        else:
            whole = torch.empty(param.shape, dtype=torch.float32)
            init_parameter(
                canonical,
                whole,
                model.get_submodule(name.rpartition(".")[0]),
                zero_init,
                parameter_generator(seed, canonical),
            )
            rows = whole[start:stop]
        if is_float8(local):  # model.base_dtype=float8: these rows' scales are their module's weight_scale
            quantize_into(local, _local(getattr(model.get_submodule(name.rpartition(".")[0]), SCALE)), rows)
        else:
            local.copy_(rows.view(local.shape).to(local.dtype))
    if unused:  # a starting adapter with no parameter of that name would be lost without a word
        raise ValueError(f"lora.init_from: no adapter parameter named {', '.join(sorted(unused)[:4])}")


@torch.no_grad()
def copy_shards(target: nn.Module, source: nn.Module, device) -> None:
    """Allocate `target` on `device` and give it `source`'s weights, shard by shard (the EMA at start-up:
    sharded the same way, so no communication; no second pass of generators or file reads)."""
    target.to_empty(device=device)
    sources = {canonical_name(name): param for name, param in source.named_parameters()}
    for name, param in target.named_parameters():
        src = sources[canonical_name(name)]
        local = param.to_local() if isinstance(param, DTensor) else param.data
        local.copy_(src.to_local() if isinstance(src, DTensor) else src.data)
