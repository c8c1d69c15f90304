"""Qwen-Image's MMDiT (diffusers' QwenImageTransformer2DModel) in tessera's style; single-device code.

Text and image tokens attend jointly in every block, each stream with its own weights. Module names are
diffusers' except `blocks` (diffusers: `transformer_blocks`; weights.py maps the key), and the arithmetic
is diffusers' step for step (no float32 upcasts beyond its own), so bf16 runs match diffusers' too.
Latents (B, C, T, H, W) are packed 2x2 into tokens inside `embed`, as the pipeline packs outside.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from models.attention import JointAttention, joint_beside  # noqa: F401  (the package exports JointAttention)
from models.layers import (
    AdaNormOut,
    DualStreamAttention,
    FeedForward,
    RMSNorm,
    TimestepMLP,
    WholeSequence,
    beside_patch,
    beside_split,
    timestep_features,
)


@dataclass
class QwenImageCond:
    """What Qwen-Image takes beside latents and timestep: Qwen2.5-VL's last hidden state (text.py); for
    Qwen-Image-Edit also its reference images' latents, as tokens after the noisy ones (kept clean)."""

    text: torch.Tensor  # (B, L, text_dim), padded to the batch's longest prompt
    text_mask: torch.Tensor | None  # (B, L) bool, True on a real token; None: every token is real
    references: torch.Tensor | None = None  # (B, M, C p p): every reference's packed latents, in order
    reference_grids: torch.Tensor | None = None  # (B, k, 3) long: each reference's token grid (t, h, w)


@dataclass
class QwenImageContext:
    """What every block reads besides the image tokens (`QwenImageTransformer.condition`)."""

    temb: torch.Tensor  # (B, D) the time embedding: both streams' and the final layer's modulation input
    text: torch.Tensor  # (B, L, D) the text stream entering the first block
    text_mask: torch.Tensor | None  # (B, L) bool, or None
    rope: tuple | None = None  # the patch pieces': the image's (its references' after) and the text's angles
    reference_temb: torch.Tensor | None = None  # (B, D) Edit-2511 (zero_cond_t): the references' (t = 0)
    references: torch.Tensor | None = None  # the patch pieces': (B, M, D) the references' tokens, embedded

    @property
    def beside(self) -> int:
        """The reference tokens that pass beside each patch, after the text (the patch pieces' companion)."""
        return 0 if self.references is None else self.references.shape[1]

    def rows(self, index):
        """The context of the samples `index` (the first-block step cache runs the others' blocks only)."""
        pick = lambda x: None if x is None else x[index]  # noqa: E731
        return QwenImageContext(
            self.temb[index], self.text[index], pick(self.text_mask), self.rope, pick(self.reference_temb),
            pick(self.references),
        )  # fmt: skip


def reference_grids(cond: QwenImageCond) -> list:
    """The references' token grids [(t, h, w), ...], alike for every sample (the pipeline's)."""
    if cond.references is None:
        return []
    return [tuple(int(v) for v in grid) for grid in cond.reference_grids[0].tolist()]


def reference_flags(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """(1, N, 1) in the tokens' dtype: 1 on the image stream's tokens after its first n (the references')."""
    return (torch.arange(tokens.shape[1], device=tokens.device) >= n).view(1, -1, 1).to(tokens.dtype)


def pack_latents(x: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T*h*w, C*p*p) tokens in (t, h, w) order, channels in (c, ph, pw) order: the
    pipeline's `_pack_latents` (T = 1), generalised to T frames."""
    B, C, T, H, W = x.shape
    x = x.view(B, C, T, H // patch, patch, W // patch, patch).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(B, T * (H // patch) * (W // patch), C * patch * patch)


def unpack_latents(tokens: torch.Tensor, grid: tuple[int, int, int], patch: int = 2) -> torch.Tensor:
    """The inverse of pack_latents: (B, N, C*p*p) on the token grid (t, h, w) -> (B, C, t, h*p, w*p)."""
    (t, h, w), B = grid, tokens.shape[0]
    x = tokens.view(B, t, h, w, -1, patch, patch).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(B, -1, t, h * patch, w * patch)


class QwenRope(nn.Module):
    """Qwen-Image's rotary angles (diffusers' QwenEmbedRope, scale_rope=True). Each of (frame, height,
    width) rotates its own share of channel pairs (axes_dims, 16/56/56 released); frames count from 0,
    rows and columns from the grid's centre (-(h - h//2) ... h//2 - 1); text token i sits at
    max(h//2, w//2) + i on all three axes, after the image. Holds no state."""

    def __init__(self, axes_dims=(16, 56, 56), theta: int = 10000):
        super().__init__()
        self.axes_dims, self.theta = tuple(axes_dims), theta

    def _angles(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        inv_freq = 1.0 / torch.pow(self.theta, torch.arange(0, dim, 2, dtype=torch.float32).div(dim))
        return torch.outer(positions.float(), inv_freq)  # (n, dim/2), in diffusers' order of operations

    def forward(self, grid: tuple[int, int, int], text_len: int, device, references=()):
        """-> image angles (t*h*w, Dh/2, 2) in (t, h, w) token order, text angles (L, Dh/2, 2); (cos, sin).
        `references`: the grids of Qwen-Image-Edit's reference images, whose tokens follow, image i's
        frames counting from i; the text then starts after the largest half-side of them all. Computed on
        the CPU, as diffusers does, then moved."""
        images = [self._grid(g, index) for index, g in enumerate([grid, *references])]
        image = torch.cat(images)
        text_pos = torch.arange(text_len) + max(max(h // 2, w // 2) for _, h, w in [grid, *references])
        text = torch.cat([self._angles(text_pos, dim) for dim in self.axes_dims], dim=-1)
        polar = lambda a: torch.view_as_real(torch.polar(torch.ones_like(a), a)).to(device)  # noqa: E731
        return polar(image), polar(text)

    def _grid(self, grid, first_frame: int = 0) -> torch.Tensor:
        """The angles of one image's tokens (t*h*w, Dh/2), its frames from `first_frame`."""
        t, h, w = grid
        starts = (first_frame, -(h - h // 2), -(w - w // 2))
        parts = []
        for axis, (size, start, dim) in enumerate(zip(grid, starts, self.axes_dims)):
            angles = self._angles(torch.arange(start, start + size), dim)
            shape = [1, 1, 1, dim // 2]
            shape[axis] = size
            parts.append(angles.view(shape).expand(t, h, w, dim // 2))
        return torch.cat(parts, dim=-1).reshape(t * h * w, -1)


class QwenAttention(DualStreamAttention):
    """Both streams' projections, per-head RMSNorm on queries and keys, RoPE, then the joint operator."""

    def forward(self, x, text, text_mask, rope, text_rope, beside: int = 0):
        """`beside`: the last image tokens that attend from the text's side (models/attention.py)."""
        q = self._heads(self.to_q(x), self.norm_q, rope)  # (B, H, N, Dh)
        k = self._heads(self.to_k(x), self.norm_k, rope)
        text_q = self._heads(self.add_q_proj(text), self.norm_added_q, text_rope)  # (B, H, L, Dh)
        text_k = self._heads(self.add_k_proj(text), self.norm_added_k, text_rope)
        x, text = joint_beside(
            self.joint_attention, q, k, self._heads(self.to_v(x)), text_q, text_k,
            self._heads(self.add_v_proj(text)), text_mask, beside,
        )  # fmt: skip
        x, text = x.transpose(1, 2).flatten(2).to(q.dtype), text.transpose(1, 2).flatten(2).to(q.dtype)
        return self.to_out[0](x), self.to_add_out(text)  # (B, N, D), (B, L, D)


def modulate(x, params, references=None):
    """x * (1 + scale) + shift and the gate, from one stream's (B, 3D) slice (shift, scale, gate); with
    `references` ((B, 3D) slice of the t = 0 embedding, and the (1, n, 1) flags of the reference tokens)
    each token takes its own (diffusers' _modulate with a modulate_index)."""
    shift, scale, gate = (p.unsqueeze(1) for p in params.chunk(3, dim=-1))
    if references is not None:
        zero, flags = references
        pick = lambda ours, theirs: torch.where(flags == 0, ours, theirs.unsqueeze(1))  # noqa: E731
        shift, scale, gate = (pick(a, b) for a, b in zip((shift, scale, gate), zero.chunk(3, dim=-1)))
    return x * (1 + scale) + shift, gate


class QwenImageBlock(nn.Module):
    """One dual-stream block: each stream modulated by the time embedding, joint attention, then each
    stream's own MLP, with gated residuals."""

    def __init__(self, dim: int, num_heads: int, backend: str = "sdpa"):
        super().__init__()
        norm = lambda: nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)  # noqa: E731
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1, self.img_norm2 = norm(), norm()
        self.attn = QwenAttention(dim, num_heads, backend)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1, self.txt_norm2 = norm(), norm()
        self.txt_mlp = FeedForward(dim)

    def forward(self, x, text, text_mask, temb, rope, text_rope, references=None, beside: int = 0):
        """x (B, N, D) image tokens (this rank's), text (B, L, D), text_mask (B, L) or None, temb (B, D),
        rope (N, Dh/2, 2), text_rope (L, Dh/2, 2) -> (x, text), both updated. `references`: Edit-2511's
        (the t = 0 embedding (B, D), the image tokens' reference flags (1, N, 1)); `beside`: the patch
        pieces' reference tokens, the last of x."""
        zero1 = zero2 = None
        if references is not None:  # one projection of both embeddings, as diffusers batches them
            img_mod, zero = self.img_mod(torch.cat([temb, references[0]])).chunk(2)
            img_mod1, img_mod2 = img_mod.chunk(2, dim=-1)
            zero1, zero2 = ((z, references[1]) for z in zero.chunk(2, dim=-1))
        else:
            img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)  # (B, 3D) each
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_in, img_gate1 = modulate(self.img_norm1(x), img_mod1, zero1)
        txt_in, txt_gate1 = modulate(self.txt_norm1(text), txt_mod1)
        img_attn, txt_attn = self.attn(img_in, txt_in, text_mask, rope, text_rope, beside)
        x = x + img_gate1 * img_attn
        text = text + txt_gate1 * txt_attn
        img_in, img_gate2 = modulate(self.img_norm2(x), img_mod2, zero2)
        x = x + img_gate2 * self.img_mlp(img_in)
        txt_in, txt_gate2 = modulate(self.txt_norm2(text), txt_mod2)
        text = text + txt_gate2 * self.txt_mlp(txt_in)
        if x.dtype == torch.float16:  # diffusers clips both streams in float16
            x, text = x.clip(-65504, 65504), text.clip(-65504, 65504)
        return x, text


class TimestepEmbedding(nn.Module):
    """Timestep t in [0, 1] -> 256 sinusoidal features of 1000 t (cos first), in float32 -> MLP (B, D) in
    `dtype`, as diffusers' QwenTimestepProjEmbeddings."""

    def __init__(self, dim: int, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.timestep_embedder = TimestepMLP(frequency_size, dim)

    def forward(self, t, dtype):
        features = timestep_features(t, self.frequency_size, scale=1000)
        return self.timestep_embedder(features.to(dtype))


class QwenImageTransformer(nn.Module):
    """Qwen-Image's transformer. in_channels / out_channels are the latent's channels (16 released; the
    diffusers config's in_channels counts the packed 2x2 patch, 64); hidden_size = heads x head dim."""

    def __init__(
        self,
        in_channels: int = 16,
        out_channels: int | None = None,
        depth: int = 60,
        hidden_size: int = 3072,
        num_heads: int = 24,
        text_dim: int = 3584,
        patch_size: int = 2,
        axes_dims_rope=(16, 56, 56),
        zero_cond_t: bool = False,
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        if hidden_size % num_heads or sum(axes_dims_rope) != hidden_size // num_heads:
            raise ValueError(
                f"hidden_size {hidden_size} must be num_heads {num_heads} x a head dim equal to the sum of "
                f"axes_dims_rope {list(axes_dims_rope)}"
            )
        self.in_channels, self.out_channels = in_channels, out_channels or in_channels
        self.patch_size, self.zero_cond_t = patch_size, zero_cond_t
        self._architecture = dict(
            in_channels=in_channels,
            out_channels=self.out_channels,
            depth=depth,
            hidden_size=hidden_size,
            num_heads=num_heads,
            text_dim=text_dim,
            patch_size=patch_size,
            axes_dims_rope=tuple(axes_dims_rope),
            zero_cond_t=zero_cond_t,
        )
        self.img_in = nn.Linear(in_channels * patch_size**2, hidden_size)
        self.txt_norm = RMSNorm(text_dim, eps=1e-6)
        self.txt_in = nn.Linear(text_dim, hidden_size)
        self.time_text_embed = TimestepEmbedding(hidden_size)
        self.pos_embed = QwenRope(axes_dims_rope)
        self.sequence = WholeSequence()  # parallel/ assigns a sequence-parallel replacement
        self.blocks = nn.ModuleList(
            [QwenImageBlock(hidden_size, num_heads, attention_backend) for _ in range(depth)]
        )
        self.norm_out = AdaNormOut(hidden_size)
        self.proj_out = nn.Linear(hidden_size, patch_size**2 * self.out_channels)

    def architecture(self) -> dict:
        """The keyword arguments it was built with, less the attention backend (weights.py turns them into
        a diffusers config)."""
        return dict(self._architecture)

    def forward(self, x, t, cond: QwenImageCond):
        """x: (B, C, T, H, W) latents (normalised: sampling.py); t: (B,) sigma in [0, 1]; cond: the text
        (and Qwen-Image-Edit's references) -> the velocity (B, C_out, T, H, W)."""
        tokens, grid = self.embed(x)  # (B, N, D)
        ctx, n = self.patch_context(t, cond, grid), tokens.shape[1]
        (rope, text_rope), references = ctx.rope, None  # (N + M, ...), (L, ...)
        if cond.references is not None:  # their tokens after the noisy ones, sharded with them
            tokens = torch.cat([tokens, ctx.references], dim=1)
            if ctx.reference_temb is not None:
                references = (ctx.reference_temb, self.sequence.shard(reference_flags(tokens, n), None)[0])
        tokens, rope = self.sequence.shard(tokens, rope)  # (B, N_local, D); the identity on one device
        text = ctx.text  # (B, L, D): whole on every rank
        for block in self.blocks:
            tokens, text = block(tokens, text, ctx.text_mask, ctx.temb, rope, text_rope, references)
        tokens = self.sequence.gather(tokens)[:, :n]  # (B, N, D): the noisy tokens' output alone
        return self.unpatchify(self.final_layer(tokens, ctx.temb), grid)  # (B, C_out, T, H, W)

    # The pieces of `forward`, for sequence parallelism and PipeFusion to call one by one.

    def embed(self, x):
        """Latents (B, C, T, H, W) -> tokens (B, N, D) in (t, h, w) order, and the token grid (t, h, w)."""
        B, C, T, H, W = x.shape
        p = self.patch_size
        if C != self.in_channels or H % p or W % p:
            raise ValueError(
                f"Qwen-Image takes latents of {self.in_channels} channels with height and width divisible "
                f"by {p}; got (B, C, T, H, W) = {tuple(x.shape)}"
            )
        tokens = self.img_in(pack_latents(x.to(self.img_in.weight.dtype), p))
        return tokens, (T, H // p, W // p)

    def condition(self, t, cond: QwenImageCond) -> QwenImageContext:
        """The time embedding and the text stream's input: needs no block, so every PipeFusion stage can
        compute it. The pipeline hands the model (1000 sigma rounded to the latents' dtype) / 1000 in that
        dtype: the same rounding here keeps bf16 runs equal to diffusers'."""
        dtype = self.img_in.weight.dtype
        timestep = (t.float() * 1000).to(dtype) / 1000
        temb = self.time_text_embed(timestep, dtype)  # (B, D)
        text = self.txt_in(self.txt_norm(cond.text.to(dtype)))  # (B, L, D)
        mask = None if cond.text_mask is None else cond.text_mask.bool()
        zero = None  # Edit-2511 modulates its references' tokens by the embedding of t = 0
        if self.zero_cond_t and cond.references is not None:
            zero = self.time_text_embed(timestep * 0, dtype)
        return QwenImageContext(temb, text, mask, reference_temb=zero)

    # PipeFusion's (parallel/compute/pipefusion.py) and the first-block cache's (models/step_cache.py): the
    # blocks on one patch of whole token rows; Qwen-Image-Edit's references pass beside it, after the text

    def patch_context(self, t, cond: QwenImageCond, grid) -> QwenImageContext:
        """What the blocks read at timestep t, besides the tokens: `condition`'s, the rotary angles and the
        references' tokens."""
        ctx = self.condition(t, cond)
        ctx.rope = self.pos_embed(grid, ctx.text.shape[1], ctx.text.device, reference_grids(cond))
        if cond.references is not None:
            ctx.references = self.img_in(cond.references.to(ctx.text.dtype))
        return ctx

    def companion(self, ctx: QwenImageContext):
        """The stream that passes through the blocks beside a patch's image tokens: the text, then the
        references' tokens."""
        return ctx.text if ctx.references is None else torch.cat([ctx.text, ctx.references], dim=1)

    def patch_blocks(self, indices, tokens, companion, ctx: QwenImageContext, grid, start: int, end: int):
        """Blocks `indices` on image tokens start:end (B, n, D) and the companion (B, L + M, D) -> both;
        under a split, tokens past the patch's end are padding (past the sequence's end: zero angles)."""
        (image_rope, text_rope), beside, n = ctx.rope, ctx.beside, tokens.shape[1]
        count = grid[0] * grid[1] * grid[2]
        tokens, text, rope = beside_patch(tokens, companion, image_rope, count, beside, start, end)
        references = None  # Edit-2511's: the references' tokens modulated at t = 0
        if beside and ctx.reference_temb is not None:
            references = (ctx.reference_temb, reference_flags(tokens, n))
        for index in indices:
            block = self.blocks[index]
            tokens, text = block(tokens, text, ctx.text_mask, ctx.temb, rope, text_rope, references, beside)
        return beside_split(tokens, text, n, beside)

    def patch_final(self, tokens, ctx, start: int, end: int):
        """The final layer on the tokens start:end."""
        return self.final_layer(tokens, ctx.temb)

    def final_layer(self, tokens, temb):
        """(B, N, D) -> (B, N, p*p*C_out): the modulated norm, then the projection."""
        return self.proj_out(self.norm_out(tokens, temb))

    def unpatchify(self, tokens, grid):
        return unpack_latents(tokens, grid, self.patch_size)
