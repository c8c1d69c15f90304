"""Qwen-Image's weight names and config (the family recognises its folders). The transformer is built from
its config.json at any depth and width. Key maps: diffusers <-> tessera
(`transformer_blocks.` <-> `blocks.`, everything else identical) and the original single-file release
<-> diffusers (the same names, maybe prefixed with `model.diffusion_model.`).
"""

import re

from models.names import renamed
from models.qwen_image.transformer import QwenImageTransformer
from models.weight_files import unprefixed

PIPELINE_CLASS = "QwenImagePipeline"
TRANSFORMER_CLASS = "QwenImageTransformer2DModel"
# diffusers options of later variants (Edit 2511, Layered, guidance-distilled) this transformer lacks
_UNSUPPORTED = dict(guidance_embeds=False, use_additional_t_cond=False, use_layer3d_rope=False)
# ComfyUI's checkpoint saves prefix the transformer's keys; its split files and Qwen's release do not.
# scaled-fp8 single files carry per-layer scales: they need dequantising, not renaming
_QUANTIZED = re.compile(r"(^|\.)(scaled_fp8|scale_weight|scale_input|weight_scale|input_scale|comfy_quant)$")


class QwenImageFormatError(ValueError):
    """A folder, config or state dict that is not a Qwen-Image transformer this module can read."""


def transformer_kwargs_from_diffusers_config(config: dict) -> dict:
    """QwenImageTransformer(...) keyword arguments from a QwenImageTransformer2DModel config.json."""
    wrong = [f"{k}={config[k]!r}" for k, v in _UNSUPPORTED.items() if config.get(k, v) != v]
    if wrong:
        raise QwenImageFormatError(
            f"Qwen-Image config {', '.join(wrong)} is not supported (text-to-image only)"
        )
    patch = config.get("patch_size", 2)
    in_channels = config.get("in_channels", 64)
    if in_channels % (patch * patch):
        raise QwenImageFormatError(
            f"in_channels {in_channels} is not a whole number of {patch}x{patch} patches"
        )
    heads, head_dim = config.get("num_attention_heads", 24), config.get("attention_head_dim", 128)
    return dict(
        in_channels=in_channels // (patch * patch),  # diffusers counts the packed patch's channels
        out_channels=config.get("out_channels", 16) or in_channels,  # diffusers: None means in_channels
        depth=config.get("num_layers", 60),
        hidden_size=heads * head_dim,
        num_heads=heads,
        text_dim=config.get("joint_attention_dim", 3584),
        patch_size=patch,
        axes_dims_rope=tuple(config.get("axes_dims_rope", (16, 56, 56))),
        zero_cond_t=bool(config.get("zero_cond_t", False)),  # Edit-2511: references modulated at t = 0
    )


def diffusers_config_from_kwargs(kwargs: dict) -> dict:
    """The QwenImageTransformer2DModel config of a QwenImageTransformer built with `kwargs`."""
    patch, heads = kwargs["patch_size"], kwargs["num_heads"]
    return dict(
        _class_name=TRANSFORMER_CLASS,
        patch_size=patch,
        in_channels=kwargs["in_channels"] * patch * patch,
        out_channels=kwargs["out_channels"],
        num_layers=kwargs["depth"],
        attention_head_dim=kwargs["hidden_size"] // heads,
        num_attention_heads=heads,
        joint_attention_dim=kwargs["text_dim"],
        axes_dims_rope=list(kwargs["axes_dims_rope"]),
        zero_cond_t=kwargs.get("zero_cond_t", False),
        **_UNSUPPORTED,
    )


def build_transformer(config: dict, attention_backend: str = "sdpa") -> QwenImageTransformer:
    """The tessera module for a diffusers transformer config dict."""
    if config.get("_class_name", TRANSFORMER_CLASS) != TRANSFORMER_CLASS:
        raise QwenImageFormatError(f"config describes a {config['_class_name']}, not a {TRANSFORMER_CLASS}")
    return QwenImageTransformer(
        **transformer_kwargs_from_diffusers_config(config), attention_backend=attention_backend
    )


# a QwenImageTransformer2DModel state dict under tessera's names (tensors are not copied), and back
tessera_state_dict_from_diffusers = renamed("transformer_blocks.", "blocks.")
diffusers_state_dict_from_tessera = renamed("blocks.", "transformer_blocks.")


def diffusers_state_dict_from_original(state_dict: dict) -> dict:
    """A single-file Qwen-Image transformer (Qwen's / ComfyUI's; what diffusers' from_single_file reads
    with an identity map) -> diffusers names: the `model.diffusion_model.` prefix, if any, removed."""
    quantized = sorted(k for k in state_dict if _QUANTIZED.search(k))
    if quantized:
        raise QwenImageFormatError(
            f"a scaled-fp8 single file ({quantized[0]}, ...): dequantise it first, or use the bf16 file"
        )
    return unprefixed(state_dict, QwenImageFormatError)


def original_state_dict_from_diffusers(state_dict: dict, prefix: str = "") -> dict:
    """diffusers names -> a single file's: the same names, with ComfyUI's checkpoint prefix if asked
    (prefix="model.diffusion_model."); the default writes the split-file layout ComfyUI's UNETLoader reads."""
    return {prefix + k: v for k, v in state_dict.items()}
