"""FLUX.2's transformer (diffusers' Flux2Transformer2DModel: klein and dev) in tessera's style; single-device
code.

Double-stream blocks (each stream its own weights, attending jointly) then single-stream blocks (one set
of weights over text and image, the attention's projections fused with the feed-forward's), every block
modulated by shared projections of the time embedding. RoPE has four axes (t, h, w, l): text token l at
(0, 0, 0, l), image token (h, w) at (0, h, w, 0). `blocks` holds both kinds in order (diffusers'
`transformer_blocks` then `single_transformer_blocks`: weights.py renames them), each taking and giving
(image tokens, text), so that FSDP2, checkpointing and sequence parallelism see one list; the text is
whole on every rank and joins the image tokens in each attention only ("joint": parallel/ splits it).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import JointAttention, joint_beside
from models.layers import WholeSequence, apply_rope, beside_patch, beside_split, timestep_features


@dataclass
class Flux2Cond:
    """What FLUX.2 takes beside latents and timestep: its text encoder's hidden states of several layers,
    stacked per token (text.py); every position enters unmasked, as the pipelines give them."""

    text: torch.Tensor  # (B, L, text_dim)
    text_mask: torch.Tensor | None = None  # always None: the pipelines mask nothing
    references: torch.Tensor | None = None  # (B, M, C): reference images' packed latents, kept clean
    reference_grids: torch.Tensor | None = None  # (B, k, 3) long: each reference's token grid (t, h, w)
    guidance: torch.Tensor | None = None  # (B,) dev's guidance scale, its transformer's input (klein: None)


def rope_angles(positions: torch.Tensor, axes_dims, theta: float) -> torch.Tensor:
    """Positions (N, 4) -> (N, Dh/2, 2) (cos, sin), each axis its own share of channel pairs, computed as
    diffusers' Flux2PosEmbed (float64 angles, then float32)."""
    parts = []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(positions[:, axis].float().cpu(), freqs)
        parts.append(torch.stack([angles.cos().float(), angles.sin().float()], dim=-1))
    return torch.cat(parts, dim=1).to(positions.device)


def token_positions(grid, first_frame: int) -> torch.Tensor:
    """(t h w, 4) positions (first_frame + t, h, w, 0) of a grid's tokens in (t, h, w) order."""
    cells = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).reshape(-1, 3)
    cells[:, 0] += first_frame
    return torch.cat([cells, torch.zeros(len(cells), 1, dtype=cells.dtype)], dim=1)


def split_modulation(mod: torch.Tensor, sets: int) -> tuple:
    """(B, 3 sets D) -> sets x (shift, scale, gate), each (B, 1, D): diffusers' Flux2Modulation.split."""
    chunks = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return tuple(chunks[3 * i : 3 * i + 3] for i in range(sets))


class Modulation(nn.Module):
    """SiLU, then one projection without bias: `sets` x (shift, scale, gate) for every block of a kind."""

    def __init__(self, dim: int, sets: int):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb):
        return self.linear(F.silu(temb))


def swiglu(x):
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class FeedForward(nn.Module):
    """linear_in to twice the inner width, SwiGLU, linear_out; no biases."""

    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        self.linear_in, self.linear_out = (
            nn.Linear(dim, 2 * inner, bias=False),
            nn.Linear(inner, dim, bias=False),
        )

    def forward(self, x):
        return self.linear_out(swiglu(self.linear_in(x)))


def heads(x, norm, rope, head_dim):
    """(B, N, D) -> (B, H, N, Dh), normalised per head and rotated (rope (N, Dh/2, 2) or None)."""
    x = norm(x.unflatten(-1, (-1, head_dim)))
    if rope is not None:
        x = apply_rope(x, rope[:, None])
    return x.transpose(1, 2)


def modulated(norm, x, shift, scale):
    return (1 + scale) * norm(x) + shift


class DoubleAttention(nn.Module):
    """Both streams' projections and per-head RMSNorms (torch's, as diffusers'), then the joint operator."""

    def __init__(self, dim: int, head_dim: int, eps: float, backend: str):
        super().__init__()
        self.head_dim = head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            nn.Linear(dim, dim, bias=False) for _ in range(3)
        )
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])
        self.to_add_out = nn.Linear(dim, dim, bias=False)
        self.joint_attention = JointAttention(backend)

    def forward(self, x, text, rope, text_rope, beside: int = 0):
        d, plain = self.head_dim, lambda y: y.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # noqa: E731
        q, k = heads(self.to_q(x), self.norm_q, rope, d), heads(self.to_k(x), self.norm_k, rope, d)
        tq = heads(self.add_q_proj(text), self.norm_added_q, text_rope, d)
        tk = heads(self.add_k_proj(text), self.norm_added_k, text_rope, d)
        tv = plain(self.add_v_proj(text))
        x, text = joint_beside(self.joint_attention, q, k, plain(self.to_v(x)), tq, tk, tv, None, beside)
        flat = lambda y: y.transpose(1, 2).flatten(2).to(q.dtype)  # noqa: E731
        return self.to_out[0](flat(x)), self.to_add_out(flat(text))


class DoubleBlock(nn.Module):
    """A double-stream block: each stream normed, modulated, attending jointly, then its own feed-forward."""

    kind_of_block = "double"

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, eps: float, backend: str):
        super().__init__()
        norm = lambda: nn.LayerNorm(dim, elementwise_affine=False, eps=eps)  # noqa: E731
        self.norm1, self.norm1_context, self.norm2, self.norm2_context = norm(), norm(), norm(), norm()
        self.attn = DoubleAttention(dim, head_dim, eps, backend)
        self.ff, self.ff_context = FeedForward(dim, mlp_ratio), FeedForward(dim, mlp_ratio)

    def forward(self, x, text, mods, rope, text_rope, beside: int = 0):
        """x (B, N, D) this rank's image tokens, text (B, L, D); mods: the modulations (ImageMods) -> both.
        `beside`: the patch pieces' reference tokens, the last of x (models/attention.py joint_beside)."""
        (shift, scale, gate), (shift2, scale2, gate2) = mods.double_img
        (c_shift, c_scale, c_gate), (c_shift2, c_scale2, c_gate2) = mods.double_txt
        attn, text_attn = self.attn(
            modulated(self.norm1, x, shift, scale), modulated(self.norm1_context, text, c_shift, c_scale),
            rope, text_rope, beside,
        )  # fmt: skip
        x = x + gate * attn
        x = x + gate2 * self.ff(self.norm2(x) * (1 + scale2) + shift2)
        text = text + c_gate * text_attn
        text = text + c_gate2 * self.ff_context(self.norm2_context(text) * (1 + c_scale2) + c_shift2)
        if text.dtype == torch.float16:  # diffusers clips the text stream in float16
            text = text.clip(-65504, 65504)
        return x, text


class SingleAttention(nn.Module):
    """The single-stream block's fused projection (queries, keys, values and the feed-forward's input), the
    per-head RMSNorms, the joint operator over [text, image], and one output projection of the attention
    and the feed-forward together."""

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, eps: float, backend: str):
        super().__init__()
        self.head_dim, self.mlp_hidden = head_dim, int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * dim + 2 * self.mlp_hidden, bias=False)
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(dim + self.mlp_hidden, dim, bias=False)
        self.joint_attention = JointAttention(backend)

    def _split(self, x, rope):
        projected = self.to_qkv_mlp_proj(x)
        qkv, mlp = projected.split([projected.shape[-1] - 2 * self.mlp_hidden, 2 * self.mlp_hidden], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)
        d = self.head_dim
        plain = v.unflatten(-1, (-1, d)).transpose(1, 2)
        return heads(q, self.norm_q, rope, d), heads(k, self.norm_k, rope, d), plain, swiglu(mlp)

    def forward(self, x, text, rope, text_rope, beside: int = 0):
        q, k, v, mlp = self._split(x, rope)
        tq, tk, tv, text_mlp = self._split(text, text_rope)
        x_attn, text_attn = joint_beside(self.joint_attention, q, k, v, tq, tk, tv, None, beside)
        flat = lambda y: y.transpose(1, 2).flatten(2).to(q.dtype)  # noqa: E731
        out = lambda a, m: self.to_out(torch.cat([flat(a), m], dim=-1))  # noqa: E731
        return out(x_attn, mlp), out(text_attn, text_mlp)


class SingleBlock(nn.Module):
    """A single-stream block: text and image normed and modulated alike, one fused attention and
    feed-forward, one gated residual."""

    kind_of_block = "single"

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, eps: float, backend: str):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = SingleAttention(dim, head_dim, mlp_ratio, eps, backend)

    def forward(self, x, text, mods, rope, text_rope, beside: int = 0):
        ((shift, scale, gate),) = mods.single
        out, text_out = self.attn(
            modulated(self.norm, x, shift, scale), modulated(self.norm, text, shift, scale), rope, text_rope,
            beside,
        )  # fmt: skip
        x, text = x + gate * out, text + gate * text_out
        if x.dtype == torch.float16:
            x, text = x.clip(-65504, 65504), text.clip(-65504, 65504)
        return x, text


@dataclass
class ImageMods:
    """Every block's modulation at one timestep (`Flux2Transformer.condition`)."""

    temb: torch.Tensor  # (B, D): the final norm's
    double_img: tuple
    double_txt: tuple
    single: tuple


@dataclass
class Flux2Context:
    """What the blocks read at one timestep besides the image tokens (`patch_context`): PipeFusion's and the
    first-block step cache's."""

    mods: ImageMods
    text: torch.Tensor  # (B, L, D) the text stream entering the first block
    rope: tuple  # the image tokens' angles (N + M, Dh/2, 2), its references' after, and the text's (L, ...)
    references: torch.Tensor | None = None  # (B, M, D) the reference images' tokens, embedded

    @property
    def temb(self) -> torch.Tensor:
        return self.mods.temb

    @property
    def beside(self) -> int:
        """The reference tokens that pass beside each patch, after the text (the patch pieces' companion)."""
        return 0 if self.references is None else self.references.shape[1]

    def rows(self, index):
        """The context of the samples `index` (the first-block step cache runs the others' blocks only)."""
        pick = lambda sets: tuple(tuple(m[index] for m in s) for s in sets)  # noqa: E731
        m = self.mods
        mods = ImageMods(m.temb[index], pick(m.double_img), pick(m.double_txt), pick(m.single))
        references = None if self.references is None else self.references[index]
        return Flux2Context(mods, self.text[index], self.rope, references)


def _embedder(channels: int, dim: int) -> nn.Module:
    """diffusers' TimestepEmbedding without biases: linear_1, SiLU, linear_2."""
    embedder = nn.Module()
    embedder.linear_1 = nn.Linear(channels, dim, bias=False)
    embedder.linear_2 = nn.Linear(dim, dim, bias=False)
    return embedder


class TimeEmbedding(nn.Module):
    """diffusers' Flux2TimestepGuidanceEmbeddings: 256 sinusoidal features (cos first) of the timestep
    through `timestep_embedder`, plus (dev: `guidance`) those of the guidance scale through its own
    `guidance_embedder`, when a guidance is given."""

    def __init__(self, dim: int, channels: int = 256, guidance: bool = False):
        super().__init__()
        self.channels = channels
        self.timestep_embedder = _embedder(channels, dim)
        self.guidance_embedder = _embedder(channels, dim) if guidance else None

    def forward(self, t, guidance=None):
        embed = lambda e, v: e.linear_2(F.silu(e.linear_1(timestep_features(v, self.channels).to(v.dtype))))  # noqa: E731
        temb = embed(self.timestep_embedder, t)
        if guidance is not None and self.guidance_embedder is not None:
            temb = temb + embed(self.guidance_embedder, guidance)
        return temb


class Flux2Transformer(nn.Module):
    """FLUX.2's transformer (klein: no guidance embedding; dev: `guidance`). in_channels counts the packed
    2 x 2 patch of the VAE's latents (128 released); the token grid is the latents' own (patch 1)."""

    def __init__(
        self,
        in_channels: int = 128,
        out_channels: int | None = None,
        depth: int = 8,
        single_depth: int = 48,
        head_dim: int = 128,
        num_heads: int = 48,
        text_dim: int = 15360,
        mlp_ratio: float = 3.0,
        axes_dims_rope=(32, 32, 32, 32),
        rope_theta: float = 2000.0,
        eps: float = 1e-6,
        guidance: bool = False,
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        if sum(axes_dims_rope) != head_dim:
            raise ValueError(f"axes_dims_rope {list(axes_dims_rope)} must add up to the head dim {head_dim}")
        dim = head_dim * num_heads
        self.in_channels, self.out_channels, self.patch_size = in_channels, out_channels or in_channels, 1
        self.depth, self.axes_dims, self.rope_theta = depth, tuple(axes_dims_rope), rope_theta
        self._architecture = dict(
            in_channels=in_channels, out_channels=self.out_channels, depth=depth, single_depth=single_depth,
            head_dim=head_dim, num_heads=num_heads, text_dim=text_dim, mlp_ratio=mlp_ratio,
            axes_dims_rope=tuple(axes_dims_rope), rope_theta=rope_theta, eps=eps, guidance=guidance,
        )  # fmt: skip
        self.time_guidance_embed = TimeEmbedding(dim, guidance=guidance)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(text_dim, dim, bias=False)
        self.sequence = WholeSequence()  # parallel/ assigns a sequence-parallel replacement
        blocks = [DoubleBlock(dim, head_dim, mlp_ratio, eps, attention_backend) for _ in range(depth)]
        blocks += [SingleBlock(dim, head_dim, mlp_ratio, eps, attention_backend) for _ in range(single_depth)]
        self.blocks = nn.ModuleList(blocks)
        self.norm_out = nn.Module()  # diffusers' AdaLayerNormContinuous without bias
        self.norm_out.linear = nn.Linear(dim, 2 * dim, bias=False)
        self.norm_out.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.proj_out = nn.Linear(dim, self.out_channels, bias=False)

    def architecture(self) -> dict:
        return dict(self._architecture)

    def forward(self, x, t, cond: Flux2Cond):
        """x: (B, C, 1, h, w) packed latents; t: (B,) sigma in [0, 1]; cond: the text (and reference
        images, their tokens after the noisy ones, split with them) -> the velocity of the noisy tokens."""
        tokens, grid = self.embed(x)
        ctx, n = self.patch_context(t, cond, grid), tokens.shape[1]
        if ctx.references is not None:
            tokens = torch.cat([tokens, ctx.references], dim=1)
        (rope, text_rope), text, mods = ctx.rope, ctx.text, ctx.mods
        tokens, rope = self.sequence.shard(tokens, rope)
        for block in self.blocks:
            tokens, text = block(tokens, text, mods, rope, text_rope)
        tokens = self.sequence.gather(tokens)[:, :n]
        return self.unpatchify(self.final_layer(tokens, mods.temb), grid)

    def embed(self, x):
        """(B, C, T, h, w) -> tokens (B, T h w, D) in (t, h, w) order, and the grid."""
        B, C, T, H, W = x.shape
        if C != self.in_channels:
            raise ValueError(f"FLUX.2 takes latents of {self.in_channels} channels; got {tuple(x.shape)}")
        tokens = x.to(self.x_embedder.weight.dtype).reshape(B, C, T * H * W).transpose(1, 2)
        return self.x_embedder(tokens), (T, H, W)

    def condition(self, t, cond=None) -> ImageMods:
        """The time embedding (the pipeline's 1000 sigma in the model's dtype, / 1000, * 1000; dev: plus
        its guidance scale's, 1000 times the scale in the model's dtype) and every block's modulation."""
        dtype = self.x_embedder.weight.dtype
        timestep = ((t.float() * 1000).to(dtype) / 1000).to(dtype) * 1000
        guidance = getattr(cond, "guidance", None)
        temb = self.time_guidance_embed(timestep, None if guidance is None else guidance.to(dtype) * 1000)
        double_img = split_modulation(self.double_stream_modulation_img(temb), 2)
        double_txt = split_modulation(self.double_stream_modulation_txt(temb), 2)
        return ImageMods(
            temb, double_img, double_txt, split_modulation(self.single_stream_modulation(temb), 1)
        )

    def ropes(self, grid, text_len: int, device, references=()) -> tuple:
        """The image tokens' angles (t h w, Dh/2, 2) at (t, h, w, 0), then reference i's at (10 (i + 1) + t,
        h, w, 0) (the pipelines' time offsets), and the text's at (0, 0, 0, l)."""
        grids = [(grid, 0), *((g, 10 * (i + 1)) for i, g in enumerate(references))]
        image = torch.cat([token_positions(g, first) for g, first in grids])
        text = torch.zeros(text_len, 4, dtype=torch.long)
        text[:, 3] = torch.arange(text_len)
        angles = lambda p: rope_angles(p, self.axes_dims, self.rope_theta).to(device)  # noqa: E731
        return angles(image), angles(text)

    # PipeFusion's (parallel/compute/pipefusion.py) and the first-block cache's (models/step_cache.py): the
    # blocks on one patch of whole token rows; the reference images' tokens pass beside it, after the text

    def patch_context(self, t, cond: Flux2Cond, grid) -> Flux2Context:
        """`condition`'s modulations, the text stream's input, the rotary angles and the references' tokens at
        timestep t."""
        mods = self.condition(t, cond)
        text = self.context_embedder(cond.text.to(self.x_embedder.weight.dtype))
        references, grids = None, []
        if cond.references is not None:
            references = self.x_embedder(cond.references.to(text.dtype))
            grids = [tuple(int(v) for v in g) for g in cond.reference_grids[0].tolist()]  # alike per sample
        return Flux2Context(mods, text, self.ropes(grid, text.shape[1], text.device, grids), references)

    def companion(self, ctx: Flux2Context):
        """The stream that passes through the blocks beside a patch's image tokens: the text, then the
        references' tokens."""
        return ctx.text if ctx.references is None else torch.cat([ctx.text, ctx.references], dim=1)

    def patch_blocks(self, indices, tokens, companion, ctx: Flux2Context, grid, start: int, end: int):
        """Blocks `indices` on image tokens start:end (B, n, D) and the companion (B, L + M, D) -> both;
        under a split, tokens past the sequence's end are padding (zero angles)."""
        (image_rope, text_rope), beside, n = ctx.rope, ctx.beside, tokens.shape[1]
        count = grid[0] * grid[1] * grid[2]
        tokens, text, rope = beside_patch(tokens, companion, image_rope, count, beside, start, end)
        for index in indices:
            tokens, text = self.blocks[index](tokens, text, ctx.mods, rope, text_rope, beside)
        return beside_split(tokens, text, n, beside)

    def patch_final(self, tokens, ctx: Flux2Context, start: int, end: int):
        return self.final_layer(tokens, ctx.temb)

    def final_layer(self, tokens, temb):
        scale, shift = self.norm_out.linear(F.silu(temb).to(tokens.dtype)).chunk(2, dim=1)
        return self.proj_out(self.norm_out.norm(tokens) * (1 + scale)[:, None, :] + shift[:, None, :])

    def unpatchify(self, tokens, grid):
        B, (t, h, w) = tokens.shape[0], grid
        return tokens.transpose(1, 2).reshape(B, self.out_channels, t, h, w)
