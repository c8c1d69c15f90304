"""FP8 training (train.fp8): torchao's float8 linear layers (dynamic tensorwise scaling: the matmuls of
forward and backward in float8, the weights, their gradients and AdamW as before) for the blocks' large
projections, chosen by shape: a Linear whose smaller side is under train.fp8_min_features stays in the
compute dtype, since casting to float8 costs more than its matmul gains (torchao's float8 linear is 1.39x
at (4096, 8192, 16384) and 0.80x at (1024, 2048, 1024)). On several GPUs the sharded weights are gathered
in float8 (FSDP2's float8 all-gather: half the bytes of bf16). On a CPU torchao emulates the float8
matmuls (the same casts, matmuls in the compute dtype): slow, for tests. The weights keep their names, so
a checkpoint trained with FP8 loads into a plain model. torchao is an optional extra (`.[fp8]`).
"""

import torch
import torch.nn as nn

INSTALL = 'pip install -e ".[fp8]"'


def check_fp8(cfg, device_type: str, meta_transformer) -> None:
    """train.fp8 refused by name before start-up: with a LoRA (its base is frozen: nothing trains in the
    float8 matmuls that would pay), without torchao, on a GPU older than Ada/Hopper (no float8 matmul), or
    when no Linear of `meta_transformer(cfg)`'s blocks is large enough (chosen_layers)."""
    if not cfg.train.fp8:
        return
    if cfg.lora.rank:
        raise ValueError(
            "train.fp8 trains the base's weights through float8 matmuls, and a LoRA run's base is frozen: "
            "for its memory set model.base_dtype=float8 instead, or lora.rank=0 for full fine-tuning"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ValueError(f"train.fp8=true needs torchao, which is not installed: {INSTALL}") from None
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ValueError(f"train.fp8 needs float8 matmuls (compute capability 8.9 or newer); {name} has none")
    chosen_layers(meta_transformer(cfg), cfg.train.fp8_min_features)


def fp8_linears(block: nn.Module, min_features: int) -> list[str]:
    """The names (within `block`) of the Linear layers that train in float8: both sides at least
    `min_features` and multiples of 16 (the float8 matmul's alignment)."""
    return [
        name
        for name, m in block.named_modules()
        if type(m) is nn.Linear
        and min(m.in_features, m.out_features) >= min_features
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    ]


def chosen_layers(model: nn.Module, min_features: int) -> str:
    """What train.fp8 converts in `model` (a meta-device model is enough), for the start-up summary; a
    ValueError when no Linear of its blocks is large enough (the option would change nothing)."""
    linears = [m for b in model.blocks for m in b.modules() if type(m) is nn.Linear]
    chosen = sum(len(fp8_linears(block, min_features)) for block in model.blocks)
    if not chosen:
        largest = max((min(m.in_features, m.out_features) for m in linears), default=0)
        raise ValueError(
            f"train.fp8=true, but no Linear layer of the blocks has both sides at least "
            f"train.fp8_min_features={min_features} (the largest smaller side here: {largest}); layers this "
            "small lose more to float8's casts than they gain: set train.fp8=false (or a smaller minimum)"
        )
    return f"fp8: {chosen} of the blocks' {len(linears)} Linear layers"


def convert_blocks(blocks, min_features: int, emulate: bool, gather_in_float8: bool) -> int:
    """Swap the chosen Linear layers of each block for torchao's Float8Linear, in place, before sharding.
    Returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # pad_inner_dim: the weight gradient's matmul runs over the tokens (batch x tokens on this rank), which
    # no recipe keeps a multiple of 16 (32,760 at 81 frames; 257 CLIP tokens), as the float8 matmul needs
    config = Float8LinearConfig(
        emulate=emulate, enable_fsdp_float8_all_gather=gather_in_float8, pad_inner_dim=True
    )
    count = 0
    for block in blocks:
        chosen = set(fp8_linears(block, min_features))
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, fqn, c=chosen: fqn in c)
        count += len(chosen)
    return count


def after_optimizer_step(model: nn.Module, gather_in_float8: bool) -> None:
    """With the float8 all-gather: every weight's float8 scale for the next step's gather, in one
    all-reduce (torchao's precompute; without it each gather computes its own amax)."""
    if gather_in_float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
