"""HunyuanVideo 1.5's transformer config. The transformer is built from a diffusers
HunyuanVideo15Transformer3DModel config.json at any depth and width; its weights keep diffusers' names but
`transformer_blocks.` <-> `blocks.` (models/family.py Family.to_tessera's default).
"""

from models.hunyuan_video15.transformer import HunyuanVideo15Transformer

PIPELINE_CLASSES = ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")
TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
# diffusers' defaults for what the transformer reads (HunyuanVideo15Transformer3DModel.__init__)
DEFAULTS = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    use_meanflow=False,
)


class HunyuanVideo15FormatError(ValueError):
    """A config or state dict that is not a HunyuanVideo 1.5 transformer this module can read."""


def transformer_kwargs(config: dict) -> dict:
    """HunyuanVideo15Transformer(...) keyword arguments from a diffusers config.json (its defaults where a
    key is missing); what this transformer does not run (the distilled super-resolution models' MeanFlow
    timestep, another query/key norm) is refused by name."""
    c = {**DEFAULTS, **config}
    if c["use_meanflow"] or c["qk_norm"] != "rms_norm":
        wrong = "use_meanflow=true" if c["use_meanflow"] else f"qk_norm={c['qk_norm']!r}"
        raise HunyuanVideo15FormatError(f"HunyuanVideo 1.5 config {wrong} is not supported")
    return dict(
        in_channels=c["in_channels"],
        out_channels=c["out_channels"] or c["in_channels"],  # diffusers: None means in_channels
        num_heads=c["num_attention_heads"],
        head_dim=c["attention_head_dim"],
        depth=c["num_layers"],
        refiner_depth=c["num_refiner_layers"],
        mlp_ratio=c["mlp_ratio"],
        patch_size=c["patch_size"],
        patch_size_t=c["patch_size_t"],
        text_dim=c["text_embed_dim"],
        glyph_dim=c["text_embed_2_dim"],
        image_dim=c["image_embed_dim"],
        rope_theta=c["rope_theta"],
        rope_axes_dim=tuple(c["rope_axes_dim"]),
    )


def build_transformer(config: dict, attention_backend: str = "sdpa") -> HunyuanVideo15Transformer:
    """The tessera module of a diffusers transformer config dict (on whatever device is current)."""
    if config.get("_class_name", TRANSFORMER_CLASS) != TRANSFORMER_CLASS:
        raise HunyuanVideo15FormatError(
            f"config describes a {config['_class_name']}, not a {TRANSFORMER_CLASS}"
        )
    return HunyuanVideo15Transformer(**transformer_kwargs(config), attention_backend=attention_backend)
