"""FLUX.2's weight names and config: the transformer from a Flux2Transformer2DModel config.json; diffusers'
`transformer_blocks.i` <-> `blocks.i` and `single_transformer_blocks.j` <-> `blocks.(depth + j)` (one list
of both kinds, in order); everything else the same."""

import re

from models.flux2.transformer import Flux2Transformer

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
TRANSFORMER_CLASS = "Flux2Transformer2DModel"


def transformer_kwargs(config: dict) -> dict:
    """Flux2Transformer(...) keyword arguments from a diffusers config.json; what it does not build is
    refused by name."""
    if config.get("guidance_embeds", True):
        raise ValueError(
            "FLUX.2 with guidance_embeds (dev, guidance-distilled) is not supported yet: tessera samples "
            "FLUX.2 klein (Flux2KleinPipeline folders)"
        )
    if config.get("patch_size", 1) != 1:
        raise ValueError(f"FLUX.2 with patch_size {config['patch_size']} is not supported (the release's: 1)")
    return dict(
        in_channels=config.get("in_channels", 128),
        out_channels=config.get("out_channels"),
        depth=config.get("num_layers", 8),
        single_depth=config.get("num_single_layers", 48),
        head_dim=config.get("attention_head_dim", 128),
        num_heads=config.get("num_attention_heads", 48),
        text_dim=config.get("joint_attention_dim", 15360),
        mlp_ratio=config.get("mlp_ratio", 3.0),
        axes_dims_rope=tuple(config.get("axes_dims_rope", (32, 32, 32, 32))),
        rope_theta=config.get("rope_theta", 2000),
        eps=config.get("eps", 1e-6),
    )


def build_transformer(config: dict, attention_backend: str = "sdpa") -> Flux2Transformer:
    if config.get("timestep_guidance_channels", 256) != 256:
        raise ValueError("FLUX.2 with timestep_guidance_channels other than 256 is not supported")
    return Flux2Transformer(**transformer_kwargs(config), attention_backend=attention_backend)


def to_tessera(state: dict, depth: int) -> dict:
    def rename(key):
        key = re.sub(r"^transformer_blocks\.", "blocks.", key)
        single = re.match(r"^single_transformer_blocks\.(\d+)\.", key)
        return f"blocks.{depth + int(single.group(1))}.{key[single.end() :]}" if single else key

    return {rename(k): v for k, v in state.items()}


def to_diffusers(state: dict, depth: int) -> dict:
    def rename(key):
        block = re.match(r"^blocks\.(\d+)\.", key)
        if not block:
            return key
        index, rest = int(block.group(1)), key[block.end() :]
        return (
            f"transformer_blocks.{index}.{rest}"
            if index < depth
            else f"single_transformer_blocks.{index - depth}.{rest}"
        )

    return {rename(k): v for k, v in state.items()}
