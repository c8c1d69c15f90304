"""Attention operators with one contract: q, k, v of shape (batch, heads, tokens, head_dim) in,
the output of the same shape out.

Each self-attention calls one of these through an operator with a `kind` (SelfAttentionOperator, its
`inner_attention`); `parallel/` replaces the operator with a sequence-parallel one by plain assignment.
Asking for a backend that is not installed is an error, never a silent fallback to another kernel.
"""

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F


class AttentionBackendUnavailable(RuntimeError):
    pass


class SDPAAttention(nn.Module):
    """PyTorch scaled_dot_product_attention: picks flash / memory-efficient / math kernels itself."""

    def forward(self, q, k, v, attn_mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class MathAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v written out in float32: the reference the kernels are tested against."""

    def forward(self, q, k, v, attn_mask=None):
        scale = q.shape[-1] ** -0.5
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


class XFormersAttention(nn.Module):
    """xformers memory_efficient_attention (expects (batch, tokens, heads, head_dim))."""

    def __init__(self):
        super().__init__()
        if importlib.util.find_spec("xformers") is None:
            raise AttentionBackendUnavailable(
                "model.attention_backend=xformers but xformers is not installed; "
                "install it with `pip install -e .[xformers]` (GPU machines) or use "
                "model.attention_backend=sdpa"
            )
        import xformers.ops

        self._attention = xformers.ops.memory_efficient_attention

    def forward(self, q, k, v, attn_mask=None):
        if attn_mask is not None:
            raise NotImplementedError("the xformers backend takes no attention mask; use sdpa")
        out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


class FlashAttention(nn.Module):
    """flash-attn 2/3 (CUDA, fp16/bf16 only; expects (batch, tokens, heads, head_dim))."""

    def __init__(self):
        super().__init__()
        if importlib.util.find_spec("flash_attn") is None:
            raise AttentionBackendUnavailable(
                "model.attention_backend=flash but flash-attn is not installed; "
                "install it with `pip install -e .[flash]` on a CUDA machine or use "
                "model.attention_backend=sdpa"
            )
        from flash_attn import flash_attn_func

        self._attention = flash_attn_func

    def forward(self, q, k, v, attn_mask=None):
        if attn_mask is not None:
            raise NotImplementedError("the flash backend takes no attention mask; use sdpa")
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"flash-attn needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}; use sdpa")
        out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)


ATTENTION_BACKENDS = {
    "sdpa": SDPAAttention,
    "math": MathAttention,
    "xformers": XFormersAttention,
    "flash": FlashAttention,
}


def make_attention(backend: str) -> nn.Module:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend '{backend}'; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[backend]()


class SelfAttentionOperator(nn.Module):
    """Self-attention over the sharded tokens, q, k, v (B, H, N, Dh) -> (B, H, N, Dh), through the recipe's
    kernel (kind "self": under sequence parallelism parallel/compute/operators.py replaces it with Ulysses' or
    ring attention). tessera's DiT's and LTX-2's video self-attention."""

    kind = "self"

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.kernel = make_attention(backend)

    def forward(self, q, k, v):
        return self.kernel(q, k, v)


class JointAttention(nn.Module):
    """Joint attention of two streams (MMDiT: Qwen-Image, HunyuanVideo 1.5). Single-device contract: image
    q, k, v (B, H, N_img, Dh) and text q, k, v (B, H, N_txt, Dh), heads in dim 1, and text_mask (B, N_txt)
    bool (True: attend) or None -> (image output (B, H, N_img, Dh), text output (B, H, N_txt, Dh)). Every
    query attends to the concatenation [text, image] (Qwen-Image's order in diffusers) with padded text
    keys masked out (a padded text query's output is of no use: it is never a key). Under sequence
    parallelism the image tokens are sharded and each text token must still count once per attention
    (kind "joint"); parallel/ replaces this operator by assignment."""

    kind = "joint"

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.kernel = make_attention(backend)  # (q, k, v, attn_mask) on (B, H, N, Dh)

    def forward(self, q, k, v, text_q, text_k, text_v, text_mask):
        n_text = text_q.shape[2]
        mask = None
        if text_mask is not None:  # image keys are always attended
            image_mask = text_mask.new_ones(q.shape[0], q.shape[2])
            mask = torch.cat([text_mask.bool(), image_mask.bool()], dim=1)[:, None, None, :]
        out = self.kernel(
            torch.cat([text_q, q], dim=2), torch.cat([text_k, k], dim=2), torch.cat([text_v, v], dim=2), mask
        )
        return out[:, :, n_text:], out[:, :, :n_text]
