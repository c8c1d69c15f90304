"""Sequence parallelism: one sample's tokens split over `ulysses x ring` processes.

A model stays single-device code; parallel/compute/operators.py `apply_operators` changes it from the outside:
the sequence is padded and sliced after the patch embedding and gathered before the final layer
(ShardedSequence), and each self-attention (kind "self") becomes a SequenceParallelAttention: Ulysses
(all-to-all, heads for tokens), Ring (parallel/compute/ring.py) or both. Padded keys are masked, so the output
equals the unpadded computation, and the gather's backward is a reduce-scatter, so FSDP's mean over
dp x sp ranks is exactly the data-parallel mean. docs/internals.md has the rank order and the gradient
argument.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel.compute import comm
from parallel.compute.ring import RingAttention


@dataclass
class SequenceGroups:
    """This rank's place in its sequence-parallel groups (process groups built by
    parallel/lifecycle/runtime.py)."""

    ulysses_group: object
    ulysses_size: int
    ulysses_rank: int
    ring_group: object
    ring_ranks: list  # global ranks of this rank's ring, in ring order
    ring_rank: int
    sp_group: object  # ulysses x ring
    sp_size: int
    sp_rank: int

    @property
    def ring_size(self) -> int:
        return len(self.ring_ranks)


class SequenceState:
    """Set by ShardedSequence.shard for the current forward, read by the attention operators."""

    tokens: int = 0  # the real (unpadded) token count of the whole sequence


# ---------------------------------------------------------------------------------------------------
# Ulysses all-to-all and the sequence gather, as autograd functions.


def all_to_all_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split x along scatter_dim into group-size parts, send part i to rank i, and concatenate what
    arrives along gather_dim (in rank order). Its own inverse with the dims swapped."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def _all_to_all_forward(x, scatter_dim, gather_dim, group):
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all_forward(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_forward(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def gather_tokens(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Every rank's slice of the tokens (along `dim`), concatenated in rank order, on every rank."""
    size = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()  # the gathered blocks stack along the tokens
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, local, group)
    return out.movedim(0, dim)


class _GatherTokens(torch.autograd.Function):
    """(B, n, D) per rank -> (B, size*n, D) in rank order; backward: sum over ranks, keep my slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_tokens(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        full = grad.transpose(0, 1).contiguous()
        out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter_tensor(out, full, ctx.group)
        return out.transpose(0, 1), None


# ---------------------------------------------------------------------------------------------------
# The modules assigned into the DiT.


class ShardedSequence(nn.Module):
    """Replaces DiT.sequence: pads tokens to a multiple of the degree, keeps this rank's slice, and
    gathers (then unpads) before the final layer."""

    def __init__(self, groups: SequenceGroups, state: SequenceState):
        super().__init__()
        self.groups, self.state = groups, state

    def shard(self, x, rope):
        size, tokens = self.groups.sp_size, x.shape[1]
        padded = -(-tokens // size) * size
        self.state.tokens = tokens
        x = F.pad(x, (0, 0, 0, padded - tokens))
        n, start = padded // size, self.groups.sp_rank * (padded // size)
        if rope is None:  # a family whose positions are added before the blocks (Sana)
            return x[:, start : start + n], None
        rope = F.pad(rope, (0, 0, 0, 0, 0, padded - tokens))
        return x[:, start : start + n], rope[start : start + n]

    def gather(self, x):
        return _GatherTokens.apply(x, self.groups.sp_group)[:, : self.state.tokens]

    def valid_tokens(self, local: int) -> int:
        """How many of this rank's `local` tokens are real: the padding sits at the sequence's end."""
        return max(0, min(local, self.state.tokens - self.groups.sp_rank * local))

    def start(self, local: int) -> int:
        """Where this rank's `local` tokens start in the padded sequence."""
        return self.groups.sp_rank * local


class SequenceParallelAttention(nn.Module):
    """Replaces SelfAttention.inner_attention: local (B, H, n, Dh) q, k, v in, local output out."""

    def __init__(self, groups: SequenceGroups, state: SequenceState, local_attention: nn.Module):
        super().__init__()
        self.groups, self.state = groups, state
        self.local_attention = local_attention  # the model's own kernel, used when nothing is padded

    @torch.compiler.disable  # collectives and comm records: keep them out of compiled graphs
    def forward(self, q, k, v):
        g = self.groups
        if g.ulysses_size > 1:  # heads sharded, sequence (this ring position's part) whole
            q, k, v = all_to_all_dims(torch.stack((q, k, v)), 2, 3, g.ulysses_group).unbind(0)
        if g.ring_size > 1:
            out = RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), g, self.state.tokens)
        elif q.shape[-2] > self.state.tokens:  # the whole padded sequence is here: mask the padding
            mask = torch.arange(k.shape[-2], device=k.device) < self.state.tokens
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, 1, -1))
        else:
            out = self.local_attention(q, k, v)
        if g.ulysses_size > 1:
            out = all_to_all_dims(out, 2, 1, g.ulysses_group)
        return out


def share_batch(groups: SequenceGroups, tensors: list, specs: list, device) -> list:
    """The encoded batch (latents, text embeddings, text mask, and image-to-video's condition) of the
    group's first rank, on every rank of the group. One rank per sequence-parallel group reads and encodes
    the data: the group decodes each clip once, not sp_size times, and its ranks can never hold different
    samples or conditions (a file that reads on one rank and fails on another would otherwise give them
    different replacements). `specs`: each tensor's (shape, dtype), known on every rank from the plan;
    the other ranks pass None for the tensors. Floats travel as float32, masks as uint8."""
    if groups.sp_size == 1:
        return tensors
    src = dist.get_global_rank(groups.sp_group, 0)
    wire = [torch.uint8 if dtype == torch.bool else torch.float32 for _, dtype in specs]
    if groups.sp_rank == 0:
        buffers = [tensor.to(kind).contiguous() for tensor, kind in zip(tensors, wire)]
    else:
        buffers = [torch.empty(shape, dtype=kind, device=device) for (shape, _), kind in zip(specs, wire)]
    for buffer, (shape, _) in zip(buffers, specs):
        if tuple(buffer.shape) != tuple(shape):
            raise RuntimeError(
                f"share_batch: a tensor of shape {tuple(buffer.shape)} where the plan gives {tuple(shape)}"
            )
        comm.broadcast(buffer, src, groups.sp_group)
    return [buffer.to(dtype) for buffer, (_, dtype) in zip(buffers, specs)]
