"""Sequence parallelism: one sample's tokens split over `ulysses x ring` processes.

The DiT stays single-device code. `apply_sequence_parallel` changes it from the outside:
- `model.sequence` becomes a `ShardedSequence`: after patch embedding it pads the tokens to a multiple
  of the degree and keeps this rank's slice (RoPE angles too); before the final layer it gathers them.
- each block's `attn.inner_attention` becomes a `SequenceParallelAttention`, which sees the local
  queries, keys and values and returns the local output, as if attention ran over the whole sequence:
  * Ulysses: one all-to-all (q, k, v packed) turns sequence shards into head shards; attention runs on
    the full sequence for H/ulysses heads; a second all-to-all turns the output back.
  * Ring: K/V blocks travel around the ring (`batch_isend_irecv`, the next transfer posted before the
    current block is computed) and the partial outputs merge through their log-sum-exp in float32.
  * Both (USP): Ulysses inside each ring position, then Ring across positions.
Padded keys are always masked, so the output equals the unpadded computation.

Rank order inside a sequence-parallel group: ulysses is innermost (see parallel/layout.py), and the
token slice of a rank is `ring_rank * ulysses + ulysses_rank`, so gathering over the group in rank
order restores the sequence.

Gradients: every rank of a group computes the same loss on the gathered output, and the gather's
backward is a reduce-scatter, so the parameter gradients of a group's P ranks add up to P times the
gradient of that loss. FSDP averages over all dp x P ranks, dividing by P as well: the result is
exactly the data-parallel mean. (Sharding over dp alone, or a gather whose backward keeps only the
local slice, would scale the gradients wrongly; tests/test_sequence_parallel.py compares grad norms.)
"""

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel import comm


@dataclass
class SequenceGroups:
    """This rank's place in its sequence-parallel groups (process groups built by parallel/runtime.py)."""

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
# Attention kernels that return the log-sum-exp, and their backward, for one (query, key block) pair.


def _key_mask(valid: int, keys: int, dtype, device):
    """Additive mask (1, 1, 1, keys): 0 for the first `valid` keys, -inf for padding. None if all valid."""
    if valid >= keys:
        return None
    mask = torch.zeros(keys, dtype=dtype, device=device)
    mask[valid:] = float("-inf")
    return mask.view(1, 1, 1, keys)


class MathKernel:
    """softmax attention written out in float32: any device, memory O(queries x keys)."""

    @staticmethod
    def forward(q, k, v, valid):
        scale = q.shape[-1] ** -0.5
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
        mask = _key_mask(valid, k.shape[-2], torch.float32, q.device)
        if mask is not None:
            scores = scores + mask
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, valid):
        """Gradients of this block given the *merged* output and log-sum-exp: its exact share of dq, and
        its dk, dv."""
        scale = q.shape[-1] ** -0.5
        qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
        scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
        mask = _key_mask(valid, k.shape[-2], torch.float32, q.device)
        if mask is not None:
            scores = scores + mask
        p = torch.exp(scores - lse.unsqueeze(-1))
        dv = torch.matmul(p.transpose(-2, -1), dof)
        dp = torch.matmul(dof, vf.transpose(-2, -1))
        delta = (dof * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        return torch.matmul(ds, kf), torch.matmul(ds.transpose(-2, -1), qf), dv


class CPUFlashKernel:
    """PyTorch's CPU flash-attention op: memory O(queries + keys), returns the log-sum-exp."""

    @staticmethod
    def forward(q, k, v, valid):
        mask = _key_mask(valid, k.shape[-2], q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask
        )
        return out, lse.float()

    @staticmethod
    def backward(dout, q, k, v, out, lse, valid):
        mask = _key_mask(valid, k.shape[-2], q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype), lse, 0.0, False, attn_mask=mask
        )


class CUDAEfficientKernel:
    """PyTorch's memory-efficient CUDA attention with log-sum-exp (private aten op: checked once
    against MathKernel before use, see `kernel_for`)."""

    @staticmethod
    def forward(q, k, v, valid):
        bias = _key_mask(valid, k.shape[-2], q.dtype, q.device)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[-2])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        return out, lse[..., : q.shape[-2]].float()

    @staticmethod
    def backward(dout, q, k, v, out, lse, valid):
        bias = _key_mask(valid, k.shape[-2], q.dtype, q.device)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[-2])
        # The op may expect its log-sum-exp padded to a multiple of 32 queries.
        padded = -(-q.shape[-2] // 32) * 32
        lse_full = F.pad(lse, (0, padded - lse.shape[-1]))
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        # `out` must be laid out as the forward op returns it, (batch, tokens, heads, dim) in memory: a
        # (batch, heads, tokens, dim)-contiguous one gives wrong dq and dk in half precision (H100, torch 2.11).
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.to(q.dtype).contiguous(),
            q,
            k,
            v,
            bias,
            out,
            lse_full.contiguous(),
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
        )
        return dq, dk, dv


class CUDAFlashKernel:
    """PyTorch's CUDA flash-attention op (half precision only), with log-sum-exp. It takes no mask, so a
    block's padding keys are cut off instead of masked; their gradients are zero. Second in
    `kernel_candidates` for half precision: 1.7x SDPA's time on an H100, where the memory-efficient op
    took 4x."""

    @staticmethod
    def _cut(k, v, valid):
        return (k, v) if valid >= k.shape[-2] else (k[..., :valid, :], v[..., :valid, :])

    @staticmethod
    def forward(q, k, v, valid):
        k, v = CUDAFlashKernel._cut(k, v, valid)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[:2]
        return out, lse.float()

    @staticmethod
    def backward(dout, q, k, v, out, lse, valid):
        keys = k.shape[-2]
        k, v = CUDAFlashKernel._cut(k, v, valid)
        # None for the varlen offsets and the dropout seed, as the forward op returns them here
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype).contiguous(),
            lse.float().contiguous(),
            None,
            None,
            q.shape[-2],
            k.shape[-2],
            0.0,
            False,
            None,
            None,
        )
        if valid < keys:
            dk, dv = (F.pad(g, (0, 0, 0, keys - valid)) for g in (dk, dv))
        return dq, dk, dv


class CUDACuDNNKernel:
    """PyTorch's cuDNN attention op (half precision), with log-sum-exp: on an H100 as fast as SDPA itself
    (7.1 ms for forward and backward at 12 x 14,040 x 128, against 12.9 for the flash op). Padding keys
    are cut off, as in `CUDAFlashKernel`."""

    @staticmethod
    def forward(q, k, v, valid):
        k, v = CUDAFlashKernel._cut(k, v, valid)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)[
            :2
        ]
        return out, lse.float().reshape(q.shape[:3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, valid):
        keys = k.shape[-2]
        k, v = CUDAFlashKernel._cut(k, v, valid)
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype).contiguous(),
            lse.float().unsqueeze(-1).contiguous(),
            seed,
            offset,
            None,
            None,
            None,
            q.shape[-2],
            k.shape[-2],
            0.0,
            False,
        )
        if valid < keys:
            dk, dv = (F.pad(g, (0, 0, 0, keys - valid)) for g in (dk, dv))
        return dq, dk, dv


def kernel_candidates(device_type, dtype, head_dim) -> list:
    """The kernels to try, fastest first, for this device, dtype and head dim; `kernel_for` takes the
    first that agrees with MathKernel (the fallback for anything else)."""
    if device_type == "cpu":
        return [CPUFlashKernel]
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256:
            return [CUDACuDNNKernel, CUDAFlashKernel, CUDAEfficientKernel]
        return [CUDAEfficientKernel]
    return []


_checked_kernels: dict = {}


def _kernel_agrees(kernel, device, dtype, head_dim) -> bool:
    g = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for valid in (40, 33):  # unmasked and masked blocks
        q, k, v, dout = (torch.randn(2, 2, 40, head_dim, generator=g).to(device, dtype) for _ in range(4))
        try:
            out, lse = kernel.forward(q, k, v, valid)
            ref_out, ref_lse = MathKernel.forward(q, k, v, valid)
            grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, valid)
            ref_grads = MathKernel.backward(dout, q, k, v, ref_out, ref_lse, valid)
        except Exception:
            return False
        pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)]
        if not all(torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance) for a, b in pairs):
            return False
    return True


def kernel_for(q: torch.Tensor, group=None):
    """The fastest LSE kernel that agrees with MathKernel for q's device, dtype and head dim (checked once;
    the ranks of `group` agree on the verdict, so they cannot run different kernels)."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _checked_kernels:
        candidates = kernel_candidates(*key)
        agrees = [_kernel_agrees(kernel, q.device, q.dtype, q.shape[-1]) for kernel in candidates]
        if candidates and group is not None and dist.is_initialized():
            vote = torch.tensor([1.0 if a else 0.0 for a in agrees], device=q.device)
            agrees = [v == 1.0 for v in comm.all_reduce(vote, op=dist.ReduceOp.MIN, group=group).tolist()]
        chosen = next((kernel for kernel, ok in zip(candidates, agrees) if ok), MathKernel)
        _checked_kernels[key] = chosen
        failed = [kernel.__name__ for kernel, ok in zip(candidates, agrees) if not ok]
        if failed:
            warnings.warn(
                f"ring attention: {', '.join(failed)} failed the self-check against the float32 reference "
                f"(wrong or unsupported, on this or another rank of the ring) for {key}; "
                f"using {chosen.__name__}"
                + (" (memory grows with block length squared)" if chosen is MathKernel else ""),
                stacklevel=2,
            )
    return _checked_kernels[key]


def merge_partial(out, lse, block_out, block_lse):
    """Merge a block's attention into the running result (float32, numerically stable form)."""
    if out is None:
        return block_out.float(), block_lse
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    return out - weight * (out - block_out.float()), lse - F.logsigmoid(lse - block_lse)


# ---------------------------------------------------------------------------------------------------
# Ring attention.


def _valid_keys(block: int, block_len: int, tokens: int) -> int:
    """Real (unpadded) keys in ring block `block`, which holds positions [block*block_len, ...)."""
    return max(0, min(block_len, tokens - block * block_len))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, groups: SequenceGroups, tokens: int):
        with torch.autocast(q.device.type, enabled=False):  # the merge is float32 on purpose
            return _RingAttention._forward(ctx, q, k, v, groups, tokens)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, q, k, v, groups: SequenceGroups, tokens: int):
        kernel = kernel_for(q, groups.ring_group)
        size, me, ranks = groups.ring_size, groups.ring_rank, groups.ring_ranks
        to_rank, from_rank = ranks[(me + 1) % size], ranks[(me - 1) % size]
        kv = torch.stack((k, v)).contiguous()
        block_len = k.shape[-2]
        out = lse = None
        for step in range(size):
            pending = None
            if step < size - 1:  # post the next block's transfer before computing this one
                incoming = torch.empty_like(kv)
                pending = comm.exchange(kv, to_rank, incoming, from_rank, groups.ring_group)
            block = (me - step) % size  # the ring position whose K/V we hold now
            valid = _valid_keys(block, block_len, tokens)
            if valid > 0:
                out, lse = merge_partial(out, lse, *kernel.forward(q, kv[0], kv[1], valid))
            if pending is not None:
                pending.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.tokens, ctx.kernel = groups, tokens, kernel
        return out

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups, kernel = ctx.groups, ctx.kernel
        size, me, ranks = groups.ring_size, groups.ring_rank, groups.ring_ranks
        to_rank, from_rank = ranks[(me + 1) % size], ranks[(me - 1) % size]
        kv = torch.stack((k, v)).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block_len = k.shape[-2]
        # dkv is the float32 gradient of the K/V block we hold; it travels with the block and is home
        # after `size` hops. Its transfer overlaps the next block's compute.
        dkv, dkv_pending, dkv_incoming = None, None, None
        for step in range(size):
            kv_pending = None
            if step < size - 1:
                kv_incoming = torch.empty_like(kv)
                kv_pending = comm.exchange(kv, to_rank, kv_incoming, from_rank, groups.ring_group)
            block = (me - step) % size
            valid = _valid_keys(block, block_len, ctx.tokens)
            if valid > 0:
                dq_block, dk_block, dv_block = kernel.backward(dout, q, kv[0], kv[1], out, lse, valid)
                dq += dq_block
            if dkv_pending is not None:  # the previous block's gradient, now ours to add to
                dkv_pending.wait()
                dkv = dkv_incoming
            else:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if valid > 0:
                dkv[0] += dk_block
                dkv[1] += dv_block
            dkv_incoming = torch.empty_like(dkv)
            dkv_pending = comm.exchange(dkv, to_rank, dkv_incoming, from_rank, groups.ring_group)
            if kv_pending is not None:
                kv_pending.wait()
                kv = kv_incoming
        dkv_pending.wait()
        dkv = dkv_incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


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
        rope = F.pad(rope, (0, 0, 0, 0, 0, padded - tokens))
        n, start = padded // size, self.groups.sp_rank * (padded // size)
        return x[:, start : start + n], rope[start : start + n]

    def gather(self, x):
        return _GatherTokens.apply(x, self.groups.sp_group)[:, : self.state.tokens]


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
            out = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), g, self.state.tokens)
        elif q.shape[-2] > self.state.tokens:  # the whole padded sequence is here: mask the padding
            mask = torch.arange(k.shape[-2], device=k.device) < self.state.tokens
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, 1, -1))
        else:
            out = self.local_attention(q, k, v)
        if g.ulysses_size > 1:
            out = all_to_all_dims(out, 2, 1, g.ulysses_group)
        return out


def share_batch(groups: SequenceGroups, x0, y, y_mask, shapes, device):
    """The encoded batch (latents, text embeddings, text mask) of the group's first rank, on every rank
    of the group. One rank per sequence-parallel group reads and encodes the data: the group decodes
    each clip once, not sp_size times, and its ranks can never hold different samples (a file that
    reads on one rank and fails on another would otherwise give them different replacements).
    `shapes` are the three shapes, known on every rank from the plan."""
    if groups.sp_size == 1:
        return x0, y, y_mask
    src = dist.get_global_rank(groups.sp_group, 0)
    if groups.sp_rank == 0:
        buffers = [x0.float().contiguous(), y.float().contiguous(), y_mask.to(torch.uint8).contiguous()]
    else:
        buffers = [
            torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in zip(shapes, (torch.float32, torch.float32, torch.uint8))
        ]
    for buffer, shape in zip(buffers, shapes):
        if tuple(buffer.shape) != tuple(shape):
            raise RuntimeError(
                f"share_batch: a tensor of shape {tuple(buffer.shape)} where the plan gives {tuple(shape)}"
            )
        comm.broadcast(buffer, src, groups.sp_group)
    return buffers[0], buffers[1], buffers[2].bool()


def apply_sequence_parallel(model: nn.Module, groups: SequenceGroups) -> nn.Module:
    """Make a single-device DiT sequence parallel over `groups` (before FSDP, compile or AC wrap it)."""
    if groups.sp_size == 1:
        return model
    if model.num_heads % groups.ulysses_size:
        raise ValueError(f"{model.num_heads} heads do not divide by ulysses={groups.ulysses_size}")
    state = SequenceState()
    model.sequence = ShardedSequence(groups, state)
    for block in model.blocks:
        block.attn.inner_attention = SequenceParallelAttention(groups, state, block.attn.inner_attention)
    return model
