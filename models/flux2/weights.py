"""FLUX.2's weight names and config: the transformer from a Flux2Transformer2DModel config.json; diffusers'
`transformer_blocks.i` <-> `blocks.i` and `single_transformer_blocks.j` <-> `blocks.(depth + j)` (one list
of both kinds, in order); everything else the same. BFL's single files (the release's names, under
ComfyUI's `model.diffusion_model.` or not) -> diffusers', as diffusers' converter renames them."""

import re

import torch

from models.flux2.transformer import Flux2Transformer
from models.weight_files import unprefixed

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
DEV_PIPELINE_CLASSES = ("Flux2Pipeline",)
TRANSFORMER_CLASS = "Flux2Transformer2DModel"


def transformer_kwargs(config: dict) -> dict:
    """Flux2Transformer(...) keyword arguments from a diffusers config.json; what it does not build is
    refused by name."""
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
        guidance=bool(config.get("guidance_embeds", True)),  # dev's (diffusers' default); klein's is off
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


# BFL's names -> diffusers' (the part after the block index for the blocks); norms' `scale` is `weight`
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # its halves swapped: BFL's (shift, scale)
}
_DOUBLE = {
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "img_attn.proj": "attn.to_out.0",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
    "txt_attn.proj": "attn.to_add_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}  # fmt: skip
_SINGLE = {
    "linear1": "attn.to_qkv_mlp_proj",
    "linear2": "attn.to_out",
    "norm.query_norm": "attn.norm_q",
    "norm.key_norm": "attn.norm_k",
}


def _swap_halves(value):
    """(shift, scale) rows <-> (scale, shift)."""
    first, second = value.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_from_original(state: dict) -> dict:
    """A single file's state dict (BFL's names, or diffusers' already) under diffusers' names: the prefix
    dropped (two keys naming one tensor refused), the blocks' fused q/k/v split in three, the final
    modulation's halves swapped. A name it does not map keeps its own (the load's check names it)."""
    out = {}
    for key, value in unprefixed(state).items():
        stem, _, kind = key.rpartition(".")
        if value.dim() == 0:  # a quantized file's scalar scales
            out[key] = value
            continue
        kind = "weight" if kind == "scale" else kind
        block = re.match(r"^(double|single)_blocks\.(\d+)\.(.+)$", stem)
        if block is None and stem in _TOP:
            value = _swap_halves(value) if stem == "final_layer.adaLN_modulation.1" else value
            out[f"{_TOP[stem]}.{kind}"] = value
        elif block is not None and block.group(1) == "double" and block.group(3) in _FUSED:
            for name, part in zip(_FUSED[block.group(3)], value.chunk(3, dim=0)):
                out[f"transformer_blocks.{block.group(2)}.{name}.{kind}"] = part
        elif block is not None and block.group(1) == "double" and block.group(3) in _DOUBLE:
            out[f"transformer_blocks.{block.group(2)}.{_DOUBLE[block.group(3)]}.{kind}"] = value
        elif block is not None and block.group(1) == "single" and block.group(3) in _SINGLE:
            out[f"single_transformer_blocks.{block.group(2)}.{_SINGLE[block.group(3)]}.{kind}"] = value
        else:  # diffusers' names already, or a name the load's check will name
            out[key] = value
    return out


def original_from_diffusers(state: dict, prefix: str = "") -> dict:
    """diffusers' names -> BFL's (diffusers_from_original's inverse; the tests' single files)."""
    back = {v: k for k, v in _TOP.items()}
    out, fused = {}, {}
    for key, value in state.items():
        stem, _, kind = key.rpartition(".")
        norm = kind == "weight" and ("norm_" in stem)  # RMSNorm weights are BFL's `scale`
        block = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$", stem)
        if block is None:
            value = _swap_halves(value) if stem == "norm_out.linear" else value
            out[f"{prefix}{back.get(stem, stem)}.{kind}"] = value
            continue
        index, name = block.group(2), block.group(3)
        if block.group(1) == "single_transformer_blocks":
            theirs = {v: k for k, v in _SINGLE.items()}[name]
            out[f"{prefix}single_blocks.{index}.{theirs}.{'scale' if norm else kind}"] = value
            continue
        for whole, parts in _FUSED.items():
            if name in parts:
                fused.setdefault((index, whole, kind), {})[parts.index(name)] = value
                break
        else:
            theirs = {v: k for k, v in _DOUBLE.items()}[name]
            out[f"{prefix}double_blocks.{index}.{theirs}.{'scale' if norm else kind}"] = value
    for (index, whole, kind), parts in fused.items():
        out[f"{prefix}double_blocks.{index}.{whole}.{kind}"] = torch.cat([parts[i] for i in range(3)])
    return out
