"""LTX-2's transformer config. The transformer is built from a diffusers LTX2VideoTransformer3DModel
config.json at any depth and width in LTX-2.0's configuration; what it does not run (LTX-2.3's and 2.5's
options) is refused by name. Its weights keep diffusers' names but `transformer_blocks.` <-> `blocks.`.
"""

import re

from models.ltx2.transformer import LTX2Positions, LTX2Transformer

TRANSFORMER_CLASS = "LTX2VideoTransformer3DModel"
# diffusers' defaults (LTX2VideoTransformer3DModel.__init__); the release's config.json gives them all
DEFAULTS = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    gated_attn=False,
    cross_attn_mod=False,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    audio_gated_attn=False,
    audio_cross_attn_mod=False,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="interleaved",
    use_prompt_embeddings=True,
    perturbed_attn=False,
    ff_bias=True,
    audio_ff_bias=True,
    use_prompt_adaln_single=True,
    use_keyframes_abs_pos_embedding=False,
)
# the value this transformer runs for each option it runs only one way (LTX-2.3 / 2.5 change them)
ONLY = dict(
    patch_size=1,
    patch_size_t=1,
    audio_patch_size=1,
    audio_patch_size_t=1,
    gated_attn=False,
    cross_attn_mod=False,
    audio_gated_attn=False,
    audio_cross_attn_mod=False,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    use_prompt_embeddings=True,
    ff_bias=True,
    audio_ff_bias=True,
    use_prompt_adaln_single=True,
    use_keyframes_abs_pos_embedding=False,
)


class LTX2FormatError(ValueError):
    """A config or state dict that is not an LTX-2 transformer this module can read."""


def _refuse(key, value, why="is not supported"):
    raise LTX2FormatError(f"LTX-2 transformer config {key}={value!r} {why}")


def check_config(c: dict) -> None:
    """Refuse by key and value what LTX2Transformer does not run, before anything is built."""
    for key in c:
        if not key.startswith("_") and key not in DEFAULTS:
            _refuse(key, c[key], "is not an option this transformer knows")
    for key, value in ONLY.items():
        if c[key] != value:
            _refuse(key, c[key], f"is not supported (only {value!r}: LTX-2.0's)")
    if c["rope_type"] not in ("interleaved", "split"):
        _refuse("rope_type", c["rope_type"])
    if c["rope_type"] == "split" and c["num_attention_heads"] != c["audio_num_attention_heads"]:
        # diffusers splits the a2v queries' angles by the video's head count, the keys' by the audio's
        why = f"differs from num_attention_heads={c['num_attention_heads']} under rope_type='split'"
        _refuse("audio_num_attention_heads", c["audio_num_attention_heads"], why)
    for key, heads, head_dim in [
        ("cross_attention_dim", "num_attention_heads", "attention_head_dim"),
        ("audio_cross_attention_dim", "audio_num_attention_heads", "audio_attention_head_dim"),
    ]:
        if c[key] != c[heads] * c[head_dim]:  # the projected text's width, and the a2v rope's
            _refuse(key, c[key], f"is not {heads} x {head_dim} = {c[heads] * c[head_dim]}")


def transformer_kwargs(config: dict) -> dict:
    """LTX2Transformer(...) keyword arguments from a diffusers config.json (its defaults where a key is
    missing); an option this transformer does not run is an LTX2FormatError naming it."""
    c = {**DEFAULTS, **config}
    check_config(c)
    positions = LTX2Positions(
        vae_scale_factors=tuple(c["vae_scale_factors"]),
        max_pos=(c["pos_embed_max_pos"], c["base_height"], c["base_width"]),
        audio_max_pos=c["audio_pos_embed_max_pos"],
        audio_scale_factor=c["audio_scale_factor"],
        audio_sampling_rate=c["audio_sampling_rate"],
        audio_hop_length=c["audio_hop_length"],
        causal_offset=c["causal_offset"],
        theta=c["rope_theta"],
        double_precision=c["rope_double_precision"],
        rope_type=c["rope_type"],
    )
    return dict(
        in_channels=c["in_channels"],
        out_channels=c["out_channels"] or c["in_channels"],  # diffusers: None means in_channels
        num_heads=c["num_attention_heads"],
        head_dim=c["attention_head_dim"],
        audio_in_channels=c["audio_in_channels"],
        audio_out_channels=c["audio_out_channels"] or c["audio_in_channels"],
        audio_num_heads=c["audio_num_attention_heads"],
        audio_head_dim=c["audio_attention_head_dim"],
        depth=c["num_layers"],
        caption_channels=c["caption_channels"],
        norm_eps=c["norm_eps"],
        attention_bias=c["attention_bias"],
        attention_out_bias=c["attention_out_bias"],
        timestep_scale=c["timestep_scale_multiplier"],
        cross_timestep_scale=c["cross_attn_timestep_scale_multiplier"],
        positions=positions,
        # STG's processor: no weights; diffusers ignores spatio_temporal_guidance_blocks without it
        perturbed_attn=c["perturbed_attn"],
    )


def build_transformer(config: dict, attention_backend: str = "sdpa") -> LTX2Transformer:
    """The tessera module of a diffusers transformer config dict (on whatever device is current)."""
    if config.get("_class_name", TRANSFORMER_CLASS) != TRANSFORMER_CLASS:
        raise LTX2FormatError(f"config describes a {config['_class_name']}, not a {TRANSFORMER_CLASS}")
    return LTX2Transformer(**transformer_kwargs(config), attention_backend=attention_backend)


# The release's single file (ltx-2-19b-dev.safetensors, the whole model): its transformer's names under
# model.diffusion_model., renamed to diffusers' in this order, as diffusers' own converter does
# (convert_ltx2_transformer_to_diffusers); audio_patchify_proj becomes audio_proj_in with the first. Its
# LoRAs' module names (family.py ORIGINAL_NAMES, the other way) are the top-level ones of these
RELEASE_RENAMES = (
    ("patchify_proj", "proj_in"),
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
    ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
    ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
    ("q_norm", "norm_q"),
    ("k_norm", "norm_k"),
)
# the whole model's other parts in that file (diffusers' own folders: vae/, audio_vae/, vocoder/, the
# text connectors/), which tessera reads from the pipeline folder in vae.pretrained or text_encoder.pretrained
OTHER_PARTS = ("vae.", "audio_vae.", "vocoder.", "text_embedding_projection.")


def diffusers_from_release(state: dict) -> dict:
    """A single file's transformer (the release's names under model.diffusion_model., or diffusers' names)
    under diffusers' names; the file's other parts (OTHER_PARTS, the text connectors) left out."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^(model\.)?diffusion_model\.", "", key)
        if key.startswith(OTHER_PARTS) or "embeddings_connector." in key:
            continue
        for theirs, ours in RELEASE_RENAMES:
            key = key.replace(theirs, ours)
        out[re.sub(r"^(audio_)?adaln_single\.", r"\1time_embed.", key)] = value
    return out
