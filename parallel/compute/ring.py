"""Ring attention (parallel/compute/sequence.py applies it): K/V blocks travel around the ring, the next
transfer posted before the current block is computed, and the partial outputs merge through their log-sum-exp
in float32. The blockwise kernels return that log-sum-exp; which one runs is chosen per device, dtype
and head size, and checked once against the plain math kernel.
"""

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.compute import comm

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
        # (batch, heads, tokens, dim)-contiguous one gives wrong dq and dk in half precision (H100, torch
        # 2.11).
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


def _outside_dispatch_modes():
    try:  # private, but the one way to leave a selective-checkpoint mode for a side computation
        from torch.utils._python_dispatch import _disable_current_modes

        return _disable_current_modes()
    except ImportError:  # another torch layout
        return contextlib.nullcontext()


def kernel_for(q: torch.Tensor, group=None):
    """The fastest LSE kernel that agrees with MathKernel for q's device, dtype and head dim (checked once;
    the ranks of `group` agree on the verdict, so they cannot run different kernels)."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _checked_kernels:
        candidates = kernel_candidates(*key)
        # outside any dispatch mode: in a checkpointed block under train.checkpoint_policy=selective, the
        # self-check's attention outputs would be kept and handed to the recomputed ring pass instead
        with _outside_dispatch_modes():
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


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, groups, tokens: int):
        with torch.autocast(q.device.type, enabled=False):  # the merge is float32 on purpose
            return RingAttention._forward(ctx, q, k, v, groups, tokens)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RingAttention._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, q, k, v, groups, tokens: int):
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
