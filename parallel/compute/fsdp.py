"""Apply distribution to a single-device DiT from the outside: activation checkpointing, then
torch.compile, then FSDP2 (`fully_shard`) per block and on the root (as torchtitan does)."""

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from parallel.compute import comm
from parallel.compute.fp8 import convert_blocks

try:  # FSDP2's default collectives (private module): subclassed only to record each call
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # another torch layout: FSDP's collectives then go unrecorded
    DefaultAllGather = DefaultReduceScatter = None


# What train.checkpoint_policy=selective keeps from a block's forward: the outputs of the matmuls, the
# attention kernels and the convolutions (torch's selective activation checkpointing); everything else (norms,
# modulation, activations, RoPE, residuals) is recomputed in backward, and so are collectives, as under "all".
# Only torch's own attention ops are known here: flash-attn's and xformers' are refused with it (configs).
ATEN = torch.ops.aten
SAVED_OPS = {
    ATEN.mm.default,
    ATEN.addmm.default,
    ATEN.bmm.default,
    ATEN.baddbmm.default,
    ATEN.convolution.default,
    ATEN._scaled_dot_product_flash_attention.default,
    ATEN._scaled_dot_product_flash_attention_for_cpu.default,
    ATEN._scaled_dot_product_efficient_attention.default,
    ATEN._scaled_mm.default,  # train.fp8's float8 matmuls (torchao) on a GPU
    ATEN._scaled_dot_product_cudnn_attention.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_context(policy: str) -> dict:
    """checkpoint_wrapper's keywords for train.checkpoint_policy: {} recomputes the whole block."""
    if policy == "all":
        return {}
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)}


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """train.activation_offload: the context a training forward runs in. What autograd keeps for backward
    outside the checkpointed blocks is copied to host memory (pinned on a GPU, so that backward's copies back
    are asynchronous), the blocks' inputs among it: non-reentrant checkpointing saves them through an
    autograd function, which these hooks pack. Parameters stay (they are not the forward's to free). The
    forward's copies out are synchronous: not overlapped with compute. `packed`: bytes copied out."""

    def __init__(self, device: torch.device):
        pin, self.packed = device.type == "cuda", 0

        def pack(tensor):
            if isinstance(tensor, nn.Parameter):
                return tensor
            # the tensor's own strides where it is dense (a transposed matmul input): a compiled backward
            # asserts them; a tensor with gaps or overlaps comes back contiguous
            span = 1 + sum((n - 1) * s for n, s in zip(tensor.size(), tensor.stride()) if n)
            if span == tensor.numel():
                host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, pin_memory=pin)
            else:
                host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=pin)
            host.copy_(tensor)  # a copy on a CPU too: the host's tensor is its own
            self.packed += host.numel() * host.element_size()
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def offloaded_activations(enabled: bool, device: torch.device):
    """OffloadedActivations under train.activation_offload, else a context that does nothing."""
    import contextlib

    return OffloadedActivations(device) if enabled else contextlib.nullcontext()


def check_cpu_offload(cpu_offload: bool, world_size: int) -> None:
    """train.cpu_offload, before start-up: one GPU only. The gradient norm of CPU-held shards is reduced
    over the FSDP group on the CPU: NCCL takes no CPU tensors, and a second (gloo) backend beside it is not
    built. Several processes on CPU (gloo) are fine."""
    if cpu_offload and world_size > 1 and torch.cuda.is_available():
        raise ValueError(
            "train.cpu_offload runs on one GPU for now (its gradient-norm reduction across GPUs would need "
            "CPU collectives beside NCCL); on several GPUs, shard the weights instead (cpu_offload=false)"
        )


def param_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where a sharded model's parameters are allocated: the CPU under train.cpu_offload."""
    return torch.device("cpu") if cpu_offload else device


def gathers_in_float8(mesh) -> bool:
    """Whether train.fp8's weights are all-gathered in float8: on several GPUs (gloo carries no float8)."""
    return mesh.device_type == "cuda" and mesh.size() > 1


def parallelize_dit(
    model: nn.Module,
    mesh,
    param_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    cpu_offload: bool = False,
    checkpoint_policy: str = "all",
    fp8_min_features: int | None = None,
) -> nn.Module:
    """Shard `model` (built with identical weights on every rank) over `mesh`.
    With param_dtype=bf16, parameters are all-gathered and computed in bf16 while the sharded
    master weights, gradients' reduction and the optimizer stay in float32. cpu_offload: the shards,
    their gradients and the optimizer live in CPU memory; each block's weights are copied in for its
    forward and backward (train.cpu_offload; `param_device` says where to allocate them).
    fp8_min_features (train.fp8): the blocks' Linear layers at least that large train through float8
    matmuls (parallel/compute/fp8.py), emulated on a CPU, gathered in float8 across several GPUs."""
    blocks = model.blocks
    if fp8_min_features is not None:
        convert_blocks(blocks, fp8_min_features, mesh.device_type != "cuda", gathers_in_float8(mesh))
    for i, block in enumerate(blocks):
        if activation_checkpointing:
            block = checkpoint_wrapper(  # blocks have no dropout
                block, preserve_rng_state=False, **recompute_context(checkpoint_policy)
            )
        if compile:
            block.compile()  # in place: state-dict keys stay the same
        blocks[i] = block
    # cast_forward_inputs=False: the DiT casts x and y itself, and the timestep must stay float32
    # (bf16 would round t=0.9987 to 1.0 while x_t was built with the exact t).
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once for backward: keep them gathered.
        last = i == len(blocks) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=not last, offload_policy=offload
        )
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    record_fsdp_collectives(model)
    return model


if DefaultAllGather is not None:

    class RecordedAllGather(DefaultAllGather):
        """FSDP2's all-gather, recorded by the comm layer (kind all_gather, group fsdp), so that a rank
        stuck in one shows it in failures/ and in the watchdog's message."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            with comm.recorded("all_gather", group, input_tensor):  # async: recorded until queued
                return super().__call__(output_tensor, input_tensor, group, async_op)

    class RecordedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            with comm.recorded("reduce_scatter", group, input_tensor):
                return super().__call__(output_tensor, input_tensor, group, op, async_op)


def record_fsdp_collectives(model: nn.Module) -> None:
    if DefaultAllGather is None:
        return
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):  # every fully_shard-ed module
            module.set_custom_all_gather(RecordedAllGather())
            module.set_custom_reduce_scatter(RecordedReduceScatter())


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, shard by shard (both are sharded the same way)."""
    ema_params = [p.to_local() if hasattr(p, "to_local") else p for p in ema.parameters()]
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    torch._foreach_lerp_(ema_params, params, 1.0 - decay)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered parameter of a sharded model. After a forward without backward (previews) the
    modules sharded with reshard_after_forward=False stay gathered, and FSDP2 then reuses those gathered
    copies: an in-place change of the shards since (the optimizer's, the EMA's, an adapter swap) would go
    unseen by the next forward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
