"""LTX-2's audio-video transformer (diffusers' LTX2VideoTransformer3DModel) in tessera's style; single-device
code.

Two streams, video tokens and audio tokens, each with its own width and weights. Every block runs, per
stream: self-attention, cross-attention to its own text (the connectors' output), then the two streams'
cross-attentions (audio-to-video: video queries, audio keys; video-to-audio: the reverse), then a
feed-forward, all modulated by the time embeddings. Positions are rotary over the token's place in
seconds and pixels (video: frame time, y, x; audio: time), interleaved or split per head as the config
says. Module names are diffusers' except `blocks` (diffusers: `transformer_blocks`).
"""

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import SelfAttentionOperator, make_attention
from models.layers import FeedForward, TimestepMLP, WholeSequence, apply_rope, timestep_features


@dataclass
class LTX2Cond:
    """What the transformer takes beside the latents and the timestep, as the pipeline passes it."""

    text: torch.Tensor  # (B, L, caption_channels): the connectors' video text embeddings
    audio_text: torch.Tensor  # (B, L2, caption_channels): the connectors' audio text embeddings
    text_mask: torch.Tensor | None  # (B, L) bool or 0/1, True on a real token; None: every token real
    audio_text_mask: torch.Tensor | None  # (B, L2) likewise (the pipeline passes the same mask)
    fps: float = 24.0  # the frame rate the video positions are in: the pipeline's frame_rate / motion_speed
    # (B, T*H*W) per video token sigma (image-to-video: 0 on the given frames); None: t on every token
    video_t: torch.Tensor | None = None
    # the pipeline's use_cross_timestep (its default True): each stream's audio-video modulations read the
    # other stream's sigma (the audio's: audio_t, else t) rather than its own (the video's per token)
    cross_timestep: bool = True
    # (B,) the audio's own sigma, where it differs from the video's (training draws one per stream, as
    # LTX-2's trainer does: docs/ltx2_training.md); None: t, as every pipeline samples
    audio_t: torch.Tensor | None = None
    # Lightricks' own model (its trainer's, ltx-core transformer_args.py): the audio-video scale and shift
    # read each stream's own timesteps, the gates alone the other stream's sigma; over cross_timestep
    cross_gate_only: bool = False
    # (B, C_a, L, M) training only: the clips' clean audio latents, which the loss reads (models/ltx2/
    # training.py); None: the video trains alone (data.audio=false), or sampling
    audio_x0: torch.Tensor | None = None


@dataclass
class LTX2Context:
    """What every block reads besides the two token streams (`LTX2Transformer.condition`). Video pieces
    with one row per video token (the ropes; the modulations when video_t is per token) are sliced with
    the tokens by `shard_video`."""

    video_temb: torch.Tensor  # (B, 1 or N, 6 D): the video's modulations (diffusers' temb)
    audio_temb: torch.Tensor  # (B, 1, 6 Da)
    video_embedded: torch.Tensor  # (B, 1 or N, D): the output layer's (diffusers' embedded_timestep)
    audio_embedded: torch.Tensor  # (B, 1, Da)
    video_cross: torch.Tensor  # (B, 1 or N, 4 D): a2v scale, shift, v2a scale, shift (video side)
    video_cross_gate: torch.Tensor  # (B, 1 or N, D): the audio-to-video gate
    audio_cross: torch.Tensor  # (B, 1, 4 Da): a2v scale, shift, v2a scale, shift (audio side)
    audio_cross_gate: torch.Tensor  # (B, 1, Da): the video-to-audio gate
    text: torch.Tensor  # (B, L, D): the video's text after caption_projection
    audio_text: torch.Tensor  # (B, L2, Da)
    text_bias: torch.Tensor | None  # (B, 1, 1, L) additive: 0 on real tokens, -10000 on padding
    audio_text_bias: torch.Tensor | None
    video_rope: torch.Tensor  # (N, D/2, 2) = (cos, sin): the video self-attention's angles
    audio_rope: torch.Tensor  # (Na, Da/2, 2)
    video_cross_rope: torch.Tensor  # (N, Da/2, 2): the video side of a2v and v2a (frame time only)
    audio_cross_rope: torch.Tensor  # (Na, Da/2, 2)


# the context's video fields with a row per video token once video_t is per token
PER_TOKEN = ("video_temb", "video_cross", "video_cross_gate")


class PlainRMSNorm(nn.Module):
    """diffusers' RMSNorm without a weight (elementwise_affine=False): the mean square in float32."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


class AudioSelfAttention(SelfAttentionOperator):
    """Self-attention over the audio stream, which is whole on every rank (its 126 tokens for 121 frames
    cost less to repeat than to split): kind "whole", unchanged under sequence parallelism."""

    kind = "whole"


class TextCrossAttention(nn.Module):
    """A stream's queries (B, H, N, Dh) attend to its text's keys and values (B, H, L, Dh), whole on every
    rank, with the additive text bias (B, 1, 1, L) or None."""

    kind = "cross"

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.kernel = make_attention(backend)

    def forward(self, q, k, v, bias=None):
        return self.kernel(q, k, v, bias)


class AudioToVideoAttention(TextCrossAttention):
    """Audio-to-video: queries from the video tokens (B, H, N, Dh; this rank's under sequence parallelism),
    keys and values from the audio tokens (B, H, Na, Dh; whole on every rank); no mask. Kind "cross": as
    the text's, unchanged under a split."""


class VideoToAudioAttention(TextCrossAttention):
    """Video-to-audio: queries from the audio tokens (B, H, Na, Dh; whole on every rank), keys and values
    from the video tokens (B, H, N, Dh; this rank's under sequence parallelism); no mask. Kind
    "whole_queries": a split gathers every rank's keys and values (parallel/compute/operators.py)."""

    kind = "whole_queries"


def rotate(x, rope, heads: int, split: bool):
    """x (B, N, H*Dh) rotated by rope (N, H*Dh/2, 2) = (cos, sin): "interleaved", channel pairs (2i, 2i+1)
    of the whole width; "split", each head's channel j with j + Dh/2 (diffusers' apply_split_rotary_emb)."""
    if not split:
        return apply_rope(x, rope)
    pairs = x.unflatten(-1, (heads, 2, -1)).transpose(-1, -2).flatten(-2)  # (B, N, H, Dh): (j, j + Dh/2)
    out = apply_rope(pairs, rope.reshape(rope.shape[0], heads, -1, 2))
    return out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-3)


class LTX2Attention(nn.Module):
    """diffusers' LTX2Attention: projections, RMSNorm of queries and keys across heads, the rotary angles
    (the queries' and the keys' may differ), then the operator `inner_attention` (its `kind` says what
    each side is). `perturb` (STG): None, plain attention; 0.0, every sample's output is its values (no
    attention); a (B, 1, 1) tensor, per sample 1 attends and 0 takes the values (diffusers' lerp)."""

    def __init__(
        self, dim, heads, head_dim, kv_dim, operator, split_rope=False, eps=1e-6, bias=True, out_bias=True
    ):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.split_rope = heads, split_rope
        self.norm_q, self.norm_k = nn.RMSNorm(inner, eps=eps), nn.RMSNorm(inner, eps=eps)  # torch's, as there
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k, self.to_v = nn.Linear(kv_dim, inner, bias=bias), nn.Linear(kv_dim, inner, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=out_bias)])
        self.inner_attention = operator

    def forward(self, x, context=None, bias=None, rope=None, key_rope=None, perturb=None):
        context = x if context is None else context
        v = self.to_v(context)
        if perturb is not None and not torch.is_tensor(perturb):  # STG on every sample: no attention
            return self.to_out[0](v)
        q, k = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(context))
        if rope is not None:
            q = rotate(q, rope, self.heads, self.split_rope)
            k = rotate(k, rope if key_rope is None else key_rope, self.heads, self.split_rope)
        heads = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        q, k, vh = heads(q), heads(k), heads(v)
        out = self.inner_attention(q, k, vh) if bias is None else self.inner_attention(q, k, vh, bias)
        out = out.transpose(1, 2).flatten(2).to(q.dtype)
        if perturb is not None:
            out = torch.lerp(v, out, perturb.to(v.dtype))
        return self.to_out[0](out)


def modulations(table, temb):
    """diffusers' get_mod_params: table (k, D) + temb (B, T, k D) -> k tensors (B, T, D)."""
    return (table[None, None] + temb.unflatten(-1, (table.shape[0], -1))).unbind(dim=2)


def modulate(x, scale, shift):
    return x * (1 + scale) + shift


class LTX2Block(nn.Module):
    """One audio-video block (diffusers' LTX2VideoTransformerBlock, LTX-2.0's configuration)."""

    def __init__(self, dim, heads, head_dim, audio_dim, audio_heads, audio_head_dim, eps, backend, **attn):
        """attn: LTX2Attention's split_rope, bias, out_bias."""
        super().__init__()
        attention = lambda *a: LTX2Attention(*a, eps=eps, **attn)
        self.norm1, self.audio_norm1 = PlainRMSNorm(eps), PlainRMSNorm(eps)
        self.attn1 = attention(dim, heads, head_dim, dim, SelfAttentionOperator(backend))
        self.audio_attn1 = attention(
            audio_dim, audio_heads, audio_head_dim, audio_dim, AudioSelfAttention(backend)
        )
        self.norm2, self.audio_norm2 = PlainRMSNorm(eps), PlainRMSNorm(eps)
        self.attn2 = attention(dim, heads, head_dim, dim, TextCrossAttention(backend))
        self.audio_attn2 = attention(
            audio_dim, audio_heads, audio_head_dim, audio_dim, TextCrossAttention(backend)
        )
        self.audio_to_video_norm, self.video_to_audio_norm = PlainRMSNorm(eps), PlainRMSNorm(eps)
        # both at the audio's heads and width, whichever stream asks
        self.audio_to_video_attn = attention(
            dim, audio_heads, audio_head_dim, audio_dim, AudioToVideoAttention(backend)
        )
        self.video_to_audio_attn = attention(
            audio_dim, audio_heads, audio_head_dim, dim, VideoToAudioAttention(backend)
        )
        self.norm3, self.ff = PlainRMSNorm(eps), FeedForward(dim, 4, "gelu-approximate")
        self.audio_norm3, self.audio_ff = PlainRMSNorm(eps), FeedForward(audio_dim, 4, "gelu-approximate")
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(6, audio_dim) / audio_dim**0.5)
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, audio_dim))

    def forward(self, x, a, ctx: LTX2Context, perturb=None, cross_modal: bool = True):
        """x (B, N, D) video tokens (this rank's), a (B, Na, Da) audio tokens; perturb: STG's (LTX2Attention)
        for both self-attentions; cross_modal False: no a2v / v2a (diffusers' isolate_modalities)."""
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = modulations(
            self.scale_shift_table, ctx.video_temb
        )
        a_shift, a_scale, a_gate, a_shift_mlp, a_scale_mlp, a_gate_mlp = modulations(
            self.audio_scale_shift_table, ctx.audio_temb
        )
        x_in = modulate(self.norm1(x), scale, shift)
        x = x + self.attn1(x_in, rope=ctx.video_rope, perturb=perturb) * gate
        a_in = modulate(self.audio_norm1(a), a_scale, a_shift)
        a = a + self.audio_attn1(a_in, rope=ctx.audio_rope, perturb=perturb) * a_gate
        x = x + self.attn2(self.norm2(x), ctx.text, ctx.text_bias)
        a = a + self.audio_attn2(self.audio_norm2(a), ctx.audio_text, ctx.audio_text_bias)
        if cross_modal:
            x, a = self.cross_streams(x, a, ctx)
        x = x + self.ff(modulate(self.norm3(x), scale_mlp, shift_mlp)) * gate_mlp
        a = a + self.audio_ff(modulate(self.audio_norm3(a), a_scale_mlp, a_shift_mlp)) * a_gate_mlp
        return x, a

    def cross_streams(self, x, a, ctx: LTX2Context):
        """Audio-to-video and video-to-audio, both from the streams as they enter (neither sees the other's
        update), each side modulated by its global and per-block scale and shift, each output gated."""
        x_norm, a_norm = self.audio_to_video_norm(x), self.video_to_audio_norm(a)
        table = self.video_a2v_cross_attn_scale_shift_table
        a_table = self.audio_a2v_cross_attn_scale_shift_table
        a2v_scale, a2v_shift, v2a_scale, v2a_shift = modulations(table[:4], ctx.video_cross)
        (a2v_gate,) = modulations(table[4:], ctx.video_cross_gate)
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = modulations(a_table[:4], ctx.audio_cross)
        (v2a_gate,) = modulations(a_table[4:], ctx.audio_cross_gate)
        a2v = self.audio_to_video_attn(
            modulate(x_norm, a2v_scale, a2v_shift),
            modulate(a_norm, a_a2v_scale, a_a2v_shift),
            rope=ctx.video_cross_rope,
            key_rope=ctx.audio_cross_rope,
        )
        v2a = self.video_to_audio_attn(
            modulate(a_norm, a_v2a_scale, a_v2a_shift),
            modulate(x_norm, v2a_scale, v2a_shift),
            rope=ctx.audio_cross_rope,
            key_rope=ctx.video_cross_rope,
        )
        return x + a2v_gate * a2v, a + v2a_gate * v2a


def video_coords(grid, scale_factors, causal_offset: int, fps: float, device) -> torch.Tensor:
    """(3, T*H*W, 2): each video token's [start, end) in (seconds, pixel y, pixel x), tokens in (t, h, w)
    order (diffusers' prepare_video_coords at patch size 1). The first latent frame holds one pixel frame
    (the causal VAE), so the frame bounds shift back by scale - causal_offset and clamp at 0."""
    axes = [torch.arange(n, dtype=torch.float32, device=device) for n in grid]
    start = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # (3, T, H, W)
    bounds = torch.stack([start, start + 1], dim=-1).flatten(1, 3)  # (3, N, 2) in latents
    pixels = bounds * torch.tensor(scale_factors, device=device).view(3, 1, 1)
    pixels[0] = (pixels[0] + causal_offset - scale_factors[0]).clamp(min=0) / fps
    return pixels


def audio_coords(frames: int, scale: int, causal_offset: int, hop: int, rate: int, device) -> torch.Tensor:
    """(1, Na, 2): each audio latent's [start, end) in seconds (diffusers' prepare_audio_coords, shift 0):
    a latent is `scale` mel frames of `hop` samples at `rate`, the first shifted as the video's."""
    index = torch.arange(frames, dtype=torch.float32, device=device)
    seconds = lambda mel: (mel + causal_offset - scale).clip(min=0) * hop / rate  # noqa: E731
    return torch.stack([seconds(index * scale), seconds((index + 1) * scale)], dim=-1)[None]


def rope_angles(coords, max_positions, dim: int, theta: float, double: bool) -> torch.Tensor:
    """coords (P, N, 2) bounds -> (N, dim/2, 2) = (cos, sin) (diffusers' LTX2AudioVideoRotaryPosEmbed):
    each token at its bounds' midpoint over max_positions, mapped to [-1, 1]; dim // (2 P) frequencies
    theta^[0..1] pi/2 per axis, frequency-major and axis-minor; the pairs left over lead, unrotated."""
    mid = (coords[..., 0] + coords[..., 1]) / 2.0
    grid = torch.stack([mid[i] / max_positions[i] for i in range(len(max_positions))], dim=-1)  # (N, P)
    steps = dim // (2 * len(max_positions))
    dtype = torch.float64 if double else torch.float32
    freqs = torch.pow(theta, torch.linspace(0.0, 1.0, steps, dtype=dtype, device=coords.device))
    freqs = (freqs * math.pi / 2.0).to(torch.float32)
    angles = ((grid.unsqueeze(-1) * 2 - 1) * freqs).transpose(-1, -2).flatten(1)  # (N, steps P)
    angles = F.pad(angles, (dim // 2 - angles.shape[1], 0))  # angle 0: cos 1, sin 0, as diffusers' padding
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


class AdaLayerNormSingle(nn.Module):
    """diffusers' LTX2AdaLayerNormSingle: a timestep (M,) -> its `count` modulations (M, count D) and the
    embedding they come from (M, D)."""

    def __init__(self, dim: int, count: int):
        super().__init__()
        self.emb = nn.Module()  # diffusers' PixArtAlphaCombinedTimestepSizeEmbeddings, no size conditions
        self.emb.timestep_embedder = TimestepMLP(256, dim)
        self.linear = nn.Linear(dim, count * dim)

    def forward(self, timestep, dtype):
        embedded = self.emb.timestep_embedder(timestep_features(timestep).to(dtype))
        return self.linear(F.silu(embedded)), embedded


class TextProjection(nn.Module):
    """diffusers' PixArtAlphaTextProjection (gelu_tanh): the connectors' text -> a stream's width."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


def text_bias(mask, dtype):
    """(B, L) 0/1 or bool -> diffusers' additive (B, 1, 1, L): 0 on real tokens, -10000 on padding (a
    sample without a real token attends evenly, as there, rather than to nothing)."""
    return None if mask is None else ((1 - mask.to(dtype)) * -10000.0)[:, None, None, :]


@dataclass(frozen=True)
class LTX2Positions:
    """Where the tokens sit for the rotary angles (diffusers' config names in comments)."""

    vae_scale_factors: tuple = (8, 32, 32)  # latent -> pixel frames, y, x
    max_pos: tuple = (20, 2048, 2048)  # pos_embed_max_pos, base_height, base_width
    audio_max_pos: int = 20  # audio_pos_embed_max_pos
    audio_scale_factor: int = 4  # latent -> mel frames
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    causal_offset: int = 1
    theta: float = 10000.0  # rope_theta
    double_precision: bool = True  # rope_double_precision: the frequencies in float64
    rope_type: str = "interleaved"  # or "split"


class LTX2Transformer(nn.Module):
    """LTX-2's transformer. Latents in the VAEs' layouts: video (B, C, T, H, W), audio (B, C, L, M) with
    C M = audio_in_channels; patch size 1, so a token is a latent pixel (t, h, w order) or a latent audio
    frame (its C x M values, channel-major), as the pipeline packs them."""

    def __init__(
        self,
        in_channels: int = 128,
        out_channels: int = 128,
        num_heads: int = 32,
        head_dim: int = 128,
        audio_in_channels: int = 128,
        audio_out_channels: int = 128,
        audio_num_heads: int = 32,
        audio_head_dim: int = 64,
        depth: int = 48,
        caption_channels: int = 3840,
        norm_eps: float = 1e-6,
        attention_bias: bool = True,
        attention_out_bias: bool = True,
        timestep_scale: float = 1000,
        cross_timestep_scale: float = 1000,
        positions: LTX2Positions = LTX2Positions(),
        perturbed_attn: bool = False,
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        self._architecture = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._architecture.pop("attention_backend")
        self._architecture["positions"] = asdict(positions)
        dim, audio_dim = num_heads * head_dim, audio_num_heads * audio_head_dim
        self.dims, self.positions = (dim, audio_dim), positions
        self.timestep_scale, self.cross_timestep_scale = timestep_scale, cross_timestep_scale
        # diffusers skips STG blocks unless its config's perturbed_attn (false in LTX-2.0's release): here
        # STG runs when asked; a pipeline matching diffusers asks only when this is true
        self.perturbed_attn = perturbed_attn
        self.proj_in = nn.Linear(in_channels, dim)
        self.audio_proj_in = nn.Linear(audio_in_channels, audio_dim)
        self.caption_projection = TextProjection(caption_channels, dim)
        self.audio_caption_projection = TextProjection(caption_channels, audio_dim)
        self.time_embed, self.audio_time_embed = AdaLayerNormSingle(dim, 6), AdaLayerNormSingle(audio_dim, 6)
        self.av_cross_attn_video_scale_shift = AdaLayerNormSingle(dim, 4)
        self.av_cross_attn_audio_scale_shift = AdaLayerNormSingle(audio_dim, 4)
        self.av_cross_attn_video_a2v_gate = AdaLayerNormSingle(dim, 1)
        self.av_cross_attn_audio_v2a_gate = AdaLayerNormSingle(audio_dim, 1)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(2, audio_dim) / audio_dim**0.5)
        self.sequence = WholeSequence()  # parallel/ assigns a sequence-parallel replacement (video tokens)
        attn = dict(
            split_rope=positions.rope_type == "split", bias=attention_bias, out_bias=attention_out_bias
        )
        streams = (dim, num_heads, head_dim, audio_dim, audio_num_heads, audio_head_dim, norm_eps)
        self.blocks = nn.ModuleList([LTX2Block(*streams, attention_backend, **attn) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, out_channels)
        self.audio_norm_out = nn.LayerNorm(audio_dim, eps=1e-6, elementwise_affine=False)
        self.audio_proj_out = nn.Linear(audio_dim, audio_out_channels)

    def architecture(self) -> dict:
        return dict(self._architecture)

    def forward(
        self, video, audio, t, cond: LTX2Cond, stg_blocks=(), perturbation_mask=None, isolate_modalities=False
    ):
        """video (B, C, T, H, W), audio (B, C, L, M) latents; t (B,) sigma (diffusers' timestep / 1000, the
        audio's unless cond.audio_t, the video's unless cond.video_t) -> velocities (video, audio) in the same
        layouts.
        stg_blocks: the blocks whose self-attentions STG skips (diffusers' spatio_temporal_guidance_blocks),
        perturbation_mask (B,): 1 keeps a sample's attention, 0 perturbs it (None: every sample perturbed);
        isolate_modalities: no audio-video cross-attention (the pipeline's modality-guidance pass)."""
        x, a, grid = self.embed(video, audio)
        ctx = self.condition(t, cond, grid, a.shape[1])
        tokens, local = self.shard_video(x, ctx)
        perturb = 0.0 if perturbation_mask is None else perturbation_mask.view(-1, 1, 1)
        stg_blocks = set(stg_blocks)
        for index, block in enumerate(self.blocks):
            block_perturb = perturb if index in stg_blocks else None
            tokens, a = block(tokens, a, local, block_perturb, not isolate_modalities)
        tokens = self.sequence.gather(tokens)
        x, a = self.final_layer(tokens, a, ctx)
        return self.unpatchify(x, a, grid, audio.shape[-1])

    # The pieces of `forward`, for sequence parallelism to call one by one.

    def embed(self, video, audio):
        """Latents -> video tokens (B, T*H*W, D) in (t, h, w) order, audio tokens (B, L, Da), the grid."""
        if video.shape[1] != self.proj_in.in_features or audio.shape[1] * audio.shape[-1] != (
            self.audio_proj_in.in_features
        ):
            raise ValueError(
                f"LTX-2 takes video latents (B, {self.proj_in.in_features}, T, H, W) and audio latents "
                f"(B, C, L, M) with C M = {self.audio_proj_in.in_features}; got {tuple(video.shape)} and "
                f"{tuple(audio.shape)}"
            )
        dtype = self.proj_in.weight.dtype
        x = self.proj_in(video.to(dtype).flatten(2).transpose(1, 2))
        a = self.audio_proj_in(audio.to(dtype).transpose(1, 2).flatten(2))  # (B, L, C M), as the pipeline
        return x, a, tuple(video.shape[2:])

    def condition(self, t, cond: LTX2Cond, grid, audio_frames: int) -> LTX2Context:
        """The time embeddings, both texts and every rotary angle; needs no block."""
        dtype = self.proj_in.weight.dtype
        return LTX2Context(
            **self.time_embeddings(t, cond, dtype),
            text=self.caption_projection(cond.text.to(dtype)),
            audio_text=self.audio_caption_projection(cond.audio_text.to(dtype)),
            text_bias=text_bias(cond.text_mask, dtype),
            audio_text_bias=text_bias(cond.audio_text_mask, dtype),
            **self.rotary(grid, audio_frames, cond.fps, t.device),
        )

    def time_embeddings(self, t, cond: LTX2Cond, dtype) -> dict:
        """LTX2Context's modulations and output embeddings, each (B, 1 or N, .)."""
        B = t.shape[0]
        sigma = t.float() * self.timestep_scale  # the pipeline's timestep: float32 at any model dtype
        video_t = sigma if cond.video_t is None else cond.video_t.float() * self.timestep_scale
        audio_sigma = sigma if cond.audio_t is None else cond.audio_t.float() * self.timestep_scale
        rows = lambda x: x.view(B, -1, x.shape[-1])  # noqa: E731  (B * T, .) -> (B, T, .)
        video_temb, video_embedded = (rows(e) for e in self.time_embed(video_t.flatten(), dtype))
        audio_temb, audio_embedded = (rows(e) for e in self.audio_time_embed(audio_sigma, dtype))
        # what each stream's a2v / v2a scale, shift and gate read: diffusers' use_cross_timestep, the other
        # stream's sigma; without it each its own (the video's per token); cross_gate_only, the gates alone
        own, other = (video_t.flatten(), audio_sigma), (audio_sigma, sigma)
        shifts = other if cond.cross_timestep and not cond.cross_gate_only else own
        gates = other if cond.cross_timestep or cond.cross_gate_only else own
        gate_scale = self.cross_timestep_scale / self.timestep_scale
        return dict(
            video_temb=video_temb,
            audio_temb=audio_temb,
            video_embedded=video_embedded,
            audio_embedded=audio_embedded,
            video_cross=rows(self.av_cross_attn_video_scale_shift(shifts[0], dtype)[0]),
            video_cross_gate=rows(self.av_cross_attn_video_a2v_gate(gates[0] * gate_scale, dtype)[0]),
            audio_cross=rows(self.av_cross_attn_audio_scale_shift(shifts[1], dtype)[0]),
            audio_cross_gate=rows(self.av_cross_attn_audio_v2a_gate(gates[1] * gate_scale, dtype)[0]),
        )

    def rotary(self, grid, audio_frames: int, fps: float, device) -> dict:
        """LTX2Context's four angle tables: each stream's own over its width, and the a2v / v2a ones over
        the audio's width from the times alone, both streams' on one scale (the larger max position)."""
        p, (dim, audio_dim) = self.positions, self.dims
        coords = video_coords(grid, p.vae_scale_factors, p.causal_offset, fps, device)
        hop, rate = p.audio_hop_length, p.audio_sampling_rate
        sound = audio_coords(audio_frames, p.audio_scale_factor, p.causal_offset, hop, rate, device)
        angles = lambda c, m, d: rope_angles(c, m, d, p.theta, p.double_precision)  # noqa: E731
        cross_max = (max(p.max_pos[0], p.audio_max_pos),)
        return dict(
            video_rope=angles(coords, p.max_pos, dim),
            audio_rope=angles(sound, (p.audio_max_pos,), audio_dim),
            video_cross_rope=angles(coords[:1], cross_max, audio_dim),
            audio_cross_rope=angles(sound, cross_max, audio_dim),
        )

    def shard_video(self, tokens, ctx: LTX2Context):
        """This rank's video tokens, and the context with its per-video-token rows sliced as they are (both
        ropes in one shard call; the modulations when per token); the identity on one device."""
        width = ctx.video_rope.shape[1]
        tokens, rope = self.sequence.shard(tokens, torch.cat([ctx.video_rope, ctx.video_cross_rope], dim=1))
        rows = {
            name: self.sequence.shard(getattr(ctx, name), None)[0]
            for name in PER_TOKEN
            if getattr(ctx, name).shape[1] > 1
        }
        rope, cross = rope[:, :width].contiguous(), rope[:, width:].contiguous()
        return tokens, replace(ctx, video_rope=rope, video_cross_rope=cross, **rows)

    def final_layer(self, x, a, ctx: LTX2Context):
        """Both streams' output norm, modulated by their embeddings (shift, scale), and projection."""
        shift, scale = (self.scale_shift_table[None, None] + ctx.video_embedded[:, :, None]).unbind(2)
        table = self.audio_scale_shift_table
        a_shift, a_scale = (table[None, None] + ctx.audio_embedded[:, :, None]).unbind(2)
        x = self.proj_out(modulate(self.norm_out(x), scale, shift))
        return x, self.audio_proj_out(modulate(self.audio_norm_out(a), a_scale, a_shift))

    def unpatchify(self, x, a, grid, mel_bins: int):
        """(B, N, C) -> (B, C, T, H, W); (B, L, C M) -> (B, C, L, M)."""
        video = x.transpose(1, 2).unflatten(2, grid)
        return video, a.unflatten(2, (-1, mel_bins)).transpose(1, 2)
