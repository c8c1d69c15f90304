"""Attention operators with one contract: q, k, v of shape (batch, heads, tokens, head_dim) in,
the output of the same shape out.

Each self-attention calls one of these through an operator with a `kind` (SelfAttentionOperator, its
`inner_attention`); `parallel/` replaces the operator with a sequence-parallel one by plain assignment.
Asking for a backend that is not installed is an error, never a silent fallback to another kernel.
"""

import functools
import importlib.util
import os

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


def _sdpa_with(backend: str):
    """SDPA restricted to one of its kernels (torch.nn.attention.SDPBackend's name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, attn_mask=None):
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    return call


@functools.cache
def auto_candidates() -> dict:
    """{name: (q, k, v, attn_mask) -> out} of every kernel `auto` weighs: SDPA's four (which raise where
    they do not run), flash-attn's and xformers' where installed (maskless, so never for a masked call)."""
    found = {f"sdpa:{b.lower()}": _sdpa_with(b) for b in SDPA_KERNELS}
    for name, kind in (("flash", FlashAttention), ("xformers", XFormersAttention)):
        try:
            found[name] = kind()
        except AttentionBackendUnavailable:
            pass
    return found


SDPA_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
CHOSEN: dict = {}  # (shapes, dtype, device, mask, grad) -> the kernel `auto` measured fastest there
AUTO_REPEATS = 3


def _time(call, args, backward: bool) -> float:
    import time

    def once():
        out = call(*args)
        if backward:
            out.float().sum().backward()
        if args[0].is_cuda:
            torch.cuda.synchronize(args[0].device)

    once()  # warm-up: kernels load, caches fill
    start = time.perf_counter()
    for _ in range(AUTO_REPEATS):
        once()
    return (time.perf_counter() - start) / AUTO_REPEATS


def _key(q, k, v, attn_mask) -> tuple:
    """What a choice depends on: the shapes (the keys' count to the next multiple of 256: a batch's padded
    text length varies), dtype, device, mask and whether the call takes gradients."""
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    mask = None if attn_mask is None else (attn_mask.dim(), attn_mask.dtype)
    keys = (*k.shape[:-2], -(-k.shape[-2] // 256) * 256, k.shape[-1])
    return tuple(q.shape), keys, q.dtype, str(q.device), mask, backward


def _agrees(call, q, k, v, attn_mask, tolerance: float) -> bool:
    """Whether `call` gives the math kernel's output on a slice of the call (the first sample, two heads,
    256 queries: the whole call's scores would not fit beside a long video's), within `tolerance` of the
    largest output."""
    q, k, v = q[:1, :2, :256], k[:1, :2], v[:1, :2]
    if attn_mask is not None:
        attn_mask = attn_mask[:1, : min(2, attn_mask.shape[1]), : min(256, attn_mask.shape[2])]
    with torch.no_grad():
        reference = MathAttention()(q, k, v, attn_mask).float()
        ours = call(q, k, v, attn_mask).float()
    return (ours - reference).abs().max().item() <= tolerance * reference.abs().max().clamp(min=1e-6).item()


def choose_kernel(q, k, v, attn_mask=None) -> str | None:
    """The fastest of auto_candidates() that runs these inputs and agrees with MathAttention (on a slice),
    measured once per _key (forward and backward where the call takes gradients) on detached copies; None
    (plain SDPA, which picks its own kernel) where none could be measured. SDPA's math kernel is weighed
    for short sequences only (its scores would not fit a long video's). The measurement's own saved
    tensors bypass any hooks around the call (a checkpointed block's recompute must see only the block's)."""
    key = _key(q, k, v, attn_mask)
    if key in CHOSEN:
        return CHOSEN[key]
    backward, timed = key[-1], {}
    tolerance = 1e-4 if q.dtype == torch.float32 else 2e-2
    long = q.shape[-2] * k.shape[-2] > 2**24
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for name, call in auto_candidates().items():
            if long and name == "sdpa:math":
                continue
            args = [t.detach().requires_grad_(backward) for t in (q, k, v)] + [attn_mask]
            try:
                if _agrees(call, *args, tolerance):
                    with torch.enable_grad() if backward else torch.no_grad():
                        timed[name] = _time(call, args, backward)
            except (RuntimeError, NotImplementedError):  # not for these inputs; out of memory too
                if q.is_cuda:
                    torch.cuda.empty_cache()
    CHOSEN[key] = min(timed, key=timed.get) if timed else None
    if os.environ.get("RANK", "0") == "0":  # models/ knows no ranks: torchrun's variable
        mode = "forward and backward" if backward else "forward"
        ms = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in sorted(timed.items(), key=lambda x: x[1]))
        print(f"[tessera] model.attention_backend=auto: q {tuple(q.shape)} {q.dtype} on {q.device} ({mode}): "
              f"{CHOSEN[key] or 'SDPA as it picks'} ({ms})", flush=True)  # fmt: skip
    return CHOSEN[key]


class AutoAttention(nn.Module):
    """model.attention_backend=auto: the kernel choose_kernel measured fastest for the call (once, eagerly;
    a compiled call whose inputs no eager call measured runs SDPA, which picks its own kernel)."""

    def forward(self, q, k, v, attn_mask=None):
        compiling = torch.compiler.is_compiling()
        name = CHOSEN.get(_key(q, k, v, attn_mask)) if compiling else choose_kernel(q, k, v, attn_mask)
        if name is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return auto_candidates()[name](q, k, v, attn_mask)


ATTENTION_BACKENDS = {
    "sdpa": SDPAAttention,
    "math": MathAttention,
    "xformers": XFormersAttention,
    "flash": FlashAttention,
    "auto": AutoAttention,
}
# the backends that mask keys (a split's or PipeFusion's padding); auto weighs only masking kernels for a
# masked call
MASKING_BACKENDS = ("sdpa", "math", "auto")


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


def joint_beside(operator, q, k, v, text_q, text_k, text_v, text_mask, beside: int = 0):
    """`operator` (a joint attention) with the image stream's last `beside` tokens on the text's side: the
    reference images' tokens under PipeFusion and the first-block cache, which pass whole beside each
    patch and each rank's shard, as the text does (the patch pieces of Qwen-Image-Edit and FLUX.2). The
    same attention, its keys in another order; `beside` 0: the operator's own call."""
    if not beside:
        return operator(q, k, v, text_q, text_k, text_v, text_mask)
    n, length = q.shape[2] - beside, text_q.shape[2]
    side = lambda text, image: torch.cat([text, image[:, :, n:]], dim=2)  # noqa: E731
    if text_mask is not None:
        text_mask = torch.cat([text_mask.bool(), text_mask.new_ones(q.shape[0], beside, dtype=torch.bool)], 1)
    image, text = operator(
        q[:, :, :n], k[:, :, :n], v[:, :, :n], side(text_q, q), side(text_k, k), side(text_v, v), text_mask
    )
    return torch.cat([image, text[:, :, length:]], dim=2), text[:, :, :length]
