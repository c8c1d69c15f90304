"""A frozen base in float8 (model.base_dtype=float8): the blocks' frozen Linear weights stored in float8
(e4m3) with a scale per output row, and computed in the compute dtype; single-device code.

Each quantized Linear keeps its `weight` (now float8) and gains `weight_scale` (out x 1, float32, a
frozen parameter beside it, so FSDP2 shards and gathers it with the same rows). The scale of a row is
the power of two that brings its largest |w| to at most 448 (e4m3's largest value): exact in bf16, so
FSDP2's cast of the shards to bf16 before it gathers them loses nothing, and e4m3's 3 mantissa bits are
what the base costs. A row holding NaN or inf gets a NaN or inf scale, which the finiteness check of the
loaded weights names (float8 has no inf). Only the repeated blocks are quantized (embedders, heads and
the timestep's float32 path stay): they hold all but a sliver of a large model's weights. Which layers:
`quantize_blocks`; the rows: `quantize_into`; the forward: `base_linear`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
SCALE = "weight_scale"


def is_float8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def base_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A (LoRA)Linear's base output: F.linear, or on float8 rows (F.linear of their values) times each
    row's scale, in the compute dtype. The scale goes on the output, not the weight: a scaled copy of the
    weight would be a new tensor that autograd keeps until backward, in every block at once (the weight
    itself is what FSDP2 gathers, frees and gathers again). A power of two, it changes no rounding."""
    scale = getattr(module, SCALE, None)
    if scale is None:
        return F.linear(x, module.weight, module.bias)
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    out = F.linear(x, module.weight.to(dtype)) * scale.view(-1).to(dtype)
    return out if module.bias is None else out + module.bias.to(out.dtype)


class Float8Linear(nn.Linear):
    """A frozen nn.Linear whose weight is float8 with a scale per row; made by `quantize_blocks`."""

    def forward(self, x):
        return base_linear(self, x)


def quantize_blocks(model: nn.Module) -> list[str]:
    """Turn every frozen Linear of `model.blocks` (LoRA-adapted ones included: their base) into float8
    storage with a `weight_scale` per row, in place and on the model's device (the meta device before
    sharding: the values are written by `quantize_into` as the weights are read). Returns their names."""
    names = []
    for name, module in model.blocks.named_modules(prefix="blocks"):
        # a plain Linear, or one whose forward calls base_linear (models/lora.py LoRALinear): a subclass
        # that used its weight itself would compute with the float8 values unscaled
        known = type(module) is nn.Linear or getattr(module, "dequantizes", False)
        if not known or module.weight.requires_grad:
            continue
        weight = module.weight
        module.weight = nn.Parameter(torch.empty_like(weight, dtype=FLOAT8), requires_grad=False)
        scale = torch.empty(weight.shape[0], 1, dtype=torch.float32, device=weight.device)
        module.register_parameter(SCALE, nn.Parameter(scale, requires_grad=False))
        if not weight.is_meta:
            quantize_into(module.weight.data, module.weight_scale.data, weight.data)
        if type(module) is nn.Linear:
            module.__class__ = Float8Linear
        names.append(name)
    return names


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """(n, 1) float32: per row, the smallest power of two s with max |row| / s <= 448 (1 for a zero row;
    NaN or inf for a row holding one)."""
    amax = rows.detach().float().abs().amax(dim=tuple(range(1, rows.dim())), keepdim=True).flatten(1)
    exponent = torch.ceil(torch.log2(amax / FLOAT8_MAX)).clamp(min=-126)  # float32's smallest normal
    scale = torch.exp2(torch.where(amax > 0, exponent, torch.zeros_like(exponent)))
    return torch.where(torch.isfinite(amax), scale, amax)  # keeps NaN and inf for the finiteness check


@torch.no_grad()
def quantize_into(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` (any float dtype) into a float8 `weight` and its (n, 1) `scale` (the same rows)."""
    s = row_scales(rows)
    scale.copy_(s.view(scale.shape))
    safe = torch.where(torch.isfinite(s), s, torch.ones_like(s))
    weight.copy_((rows.float() / safe.view(-1, *[1] * (rows.dim() - 1))).view(weight.shape).to(weight.dtype))


def base_bytes(model: nn.Module) -> int:
    """Bytes of the frozen parameters (the base of a LoRA run), float8 weights and their scales counted."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
