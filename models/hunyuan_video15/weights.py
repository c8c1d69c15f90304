"""HunyuanVideo 1.5's transformer config and weight names. The transformer is built from a diffusers
HunyuanVideo15Transformer3DModel config.json at any depth and width; its weights keep diffusers' names but
`transformer_blocks.` <-> `blocks.` (models/names.py Names, the default). A single file in the
original release's names (tencent/HunyuanVideo-1.5's, ComfyUI's) is mapped to diffusers' names, and its
config read from its shapes when no transformer/config.json comes with it.
"""

import re

import torch

from models.hunyuan_video15.transformer import HunyuanVideo15Transformer
from models.weight_files import unprefixed

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


# The original release's single file (tencent/HunyuanVideo-1.5's transformer/<variant>/, which ComfyUI loads
# too, under model.diffusion_model. or diffusion_model.): its modules and diffusers' (as diffusers' script
# scripts/convert_hunyuan_video1_5_to_diffusers.py maps them). Weights and biases follow their module.
_TOP = {
    "img_in.proj": "x_embedder.proj",
    "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_embed.timestep_embedder.linear_2",
    "time_r_in.mlp.0": "time_embed.timestep_embedder_r.linear_1",  # MeanFlow's (refused by its config)
    "time_r_in.mlp.2": "time_embed.timestep_embedder_r.linear_2",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "byt5_in.layernorm": "context_embedder_2.norm",
    **{f"byt5_in.fc{i}": f"context_embedder_2.linear_{i}" for i in (1, 2, 3)},
    "vision_in.proj.0": "image_embedder.norm_in",  # 2 is the GELU between the Linear layers
    "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2",
    "vision_in.proj.4": "image_embedder.norm_out",
    "cond_type_embedding": "cond_type_embed",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # rows (shift, scale) -> diffusers' (scale, shift)
    "final_layer.linear": "proj_out",
}
# txt_in.individual_token_refiner.blocks.{i}. -> context_embedder.token_refiner.refiner_blocks.{i}.
_REFINER = {
    "norm1": "norm1",
    "norm2": "norm2",
    "self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),  # fused: split in three along the rows
    "self_attn_proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm_out.linear",  # its two gates, in diffusers' order already
}
_DOUBLE = {  # double_blocks.{i}. -> transformer_blocks.{i}.: img_ the video stream, txt_ the context's
    "img_mod.linear": "norm1.linear",
    "txt_mod.linear": "norm1_context.linear",
    **{f"img_attn_{p}": f"attn.to_{p}" for p in "qkv"},
    **{f"txt_attn_{p}": f"attn.add_{p}_proj" for p in "qkv"},
    "img_attn_q_norm": "attn.norm_q",
    "img_attn_k_norm": "attn.norm_k",
    "txt_attn_q_norm": "attn.norm_added_q",
    "txt_attn_k_norm": "attn.norm_added_k",
    "img_attn_proj": "attn.to_out.0",
    "txt_attn_proj": "attn.to_add_out",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
}
_BLOCKS = (
    (re.compile(r"double_blocks\.(\d+)\.(.+)"), "transformer_blocks.{}.", _DOUBLE),
    (
        re.compile(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.(.+)"),
        "context_embedder.token_refiner.refiner_blocks.{}.",
        _REFINER,
    ),
)
# names only a diffusers file has: such a file is read as it is
_DIFFUSERS = ("transformer_blocks.", "x_embedder.", "context_embedder.", "proj_out.")
# scaled-fp8 files carry per-layer scales: they need dequantising, not renaming
_QUANTIZED = ("scaled_fp8", "scale_weight", "scale_input", "weight_scale", "input_scale", "comfy_quant")


def diffusers_names(key: str) -> tuple:
    """(diffusers' names of an original key (three for a fused qkv), whether its rows are (shift, scale)),
    or ((), False) for a key the original release does not have."""
    module, _, param = key.rpartition(".")
    if param not in ("weight", "bias"):
        return (), False
    for pattern, prefix, table in _BLOCKS:
        match = pattern.fullmatch(module)
        if match and match.group(2) in table:
            names = table[match.group(2)]
            names = (names,) if isinstance(names, str) else names
            return tuple(f"{prefix.format(match.group(1))}{n}.{param}" for n in names), False
    if module in _TOP:
        return (f"{_TOP[module]}.{param}",), module == "final_layer.adaLN_modulation.1"
    return (), False


def is_diffusers(state_dict: dict) -> bool:
    """Whether an unprefixed single file holds diffusers' names (a diffusers transformer's weights)."""
    return any(key.startswith(_DIFFUSERS) for key in state_dict)


def diffusers_from_original(state_dict: dict) -> dict:
    """A single transformer file in the original release's names (ComfyUI's prefix, if any, dropped) ->
    diffusers': renamed, the token refiner's fused qkv split in three, the final layer's modulation rows
    swapped to (scale, shift). A file already in diffusers' names comes back unprefixed. A key the release
    does not have (another model's, scaled fp8's scales) is an error naming it."""
    state_dict = unprefixed(state_dict, HunyuanVideo15FormatError)
    quantized = sorted(k for k in state_dict if k.rpartition(".")[2] in _QUANTIZED)
    if quantized:
        raise HunyuanVideo15FormatError(
            f"a scaled-fp8 single file ({quantized[0]}, ...): dequantise it first, or use the bf16 file"
        )
    if is_diffusers(state_dict):
        return state_dict
    out, unknown = {}, []
    for key, value in state_dict.items():
        names, swapped = diffusers_names(key)
        if not names:
            unknown.append(key)
        elif swapped:
            shift, scale = value.chunk(2, dim=0)
            out[names[0]] = torch.cat([scale, shift])
        else:
            out.update(zip(names, value.chunk(len(names), dim=0) if len(names) > 1 else (value,)))
    if unknown:
        raise HunyuanVideo15FormatError(
            f"keys that are not an original HunyuanVideo 1.5 transformer's: {sorted(unknown)[:5]}"
        )
    return out


# what a single file's config is read from: diffusers' name -> the original release's
_SHAPED = {
    "x_embedder.proj.weight": "img_in.proj.weight",
    "transformer_blocks.0.attn.norm_q.weight": "double_blocks.0.img_attn_q_norm.weight",
    "transformer_blocks.0.ff.net.0.proj.weight": "double_blocks.0.img_mlp.fc1.weight",
    "proj_out.weight": "final_layer.linear.weight",
    "context_embedder.proj_in.weight": "txt_in.input_embedder.weight",
    "context_embedder_2.linear_1.weight": "byt5_in.fc1.weight",
    "image_embedder.norm_in.weight": "vision_in.proj.0.weight",
}


def shapes_config(shapes: dict) -> dict:
    """The diffusers config of a single file from its tensors' shapes ({name: shape}, the original release's
    names or diffusers'). No shape holds the rope's split of a head (rope_axes_dim: the release's (16, 56,
    56) for heads of 128, else None) nor the pipeline's target size (None)."""
    shapes = unprefixed(shapes, HunyuanVideo15FormatError)
    original = not is_diffusers(shapes)
    if original:  # renamed; a fused qkv's rows are three projections'
        renamed = {}
        for key, shape in shapes.items():
            names = diffusers_names(key)[0]
            renamed.update({name: (shape[0] // len(names), *shape[1:]) for name in names})
        shapes = renamed
    missing = [(name, theirs) for name, theirs in _SHAPED.items() if name not in shapes]
    if missing:
        raise HunyuanVideo15FormatError(
            f"model.pretrained is not a HunyuanVideo 1.5 transformer file: it has no {missing[0][original]}"
        )
    hidden, in_channels, patch_t, patch, _ = shapes["x_embedder.proj.weight"]
    head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    count = lambda blocks: len({k[len(blocks) :].split(".")[0] for k in shapes if k.startswith(blocks)})  # noqa: E731
    return dict(
        _class_name=TRANSFORMER_CLASS,
        in_channels=in_channels,
        out_channels=shapes["proj_out.weight"][0] // (patch_t * patch * patch),
        num_attention_heads=hidden // head,
        attention_head_dim=head,
        num_layers=count("transformer_blocks."),
        num_refiner_layers=count("context_embedder.token_refiner.refiner_blocks."),
        mlp_ratio=shapes["transformer_blocks.0.ff.net.0.proj.weight"][0] / hidden,
        patch_size=patch,
        patch_size_t=patch_t,
        qk_norm="layer_norm" if "transformer_blocks.0.attn.norm_q.bias" in shapes else "rms_norm",
        text_embed_dim=shapes["context_embedder.proj_in.weight"][1],
        text_embed_2_dim=shapes["context_embedder_2.linear_1.weight"][1],
        image_embed_dim=shapes["image_embedder.norm_in.weight"][0],
        use_meanflow="time_embed.timestep_embedder_r.linear_1.weight" in shapes,
        rope_axes_dim=(16, 56, 56) if head == 128 else None,
        target_size=None,
    )
