"""Sana's weights in and out, and its architecture from a diffusers config; single-device code.

Three namings: diffusers' `SanaTransformer2DModel`; tessera's, the same but for `blocks.N.` in place of
`transformer_blocks.N.`; and the original release's (NVlabs/Sana `.pth` checkpoints, whose keys ComfyUI
users share, sometimes under `model.diffusion_model.`): q, k, v fused in `attn.qkv`, the cross-attention's
k, v in `kv_linear`, and two tensors with no diffusers counterpart (ORIGINAL_ONLY). The key tables follow
diffusers' scripts/convert_sana_to_diffusers.py, which also maps Sana 1.5's q/k norms.
"""

import inspect
import re

import torch

from models.names import renamed
from models.sana.transformer import SanaTransformer

ORIGINAL_ONLY = ("pos_embed", "y_embedder.y_embedding")  # a fixed buffer; the training-time null caption
_RENAMES = [  # (original, diffusers): a prefix when it ends in ".", else the whole key; {i} a block index
    ("x_embedder.proj.", "patch_embed.proj."),
    ("t_embedder.mlp.0.", "time_embed.emb.timestep_embedder.linear_1."),
    ("t_embedder.mlp.2.", "time_embed.emb.timestep_embedder.linear_2."),
    ("t_block.1.", "time_embed.linear."),
    ("y_embedder.y_proj.fc1.", "caption_projection.linear_1."),
    ("y_embedder.y_proj.fc2.", "caption_projection.linear_2."),
    ("attention_y_norm.", "caption_norm."),
    ("final_layer.linear.", "proj_out."),
    ("final_layer.scale_shift_table", "scale_shift_table"),
    ("blocks.{i}.scale_shift_table", "transformer_blocks.{i}.scale_shift_table"),
    ("blocks.{i}.attn.proj.", "transformer_blocks.{i}.attn1.to_out.0."),
    ("blocks.{i}.attn.q_norm.", "transformer_blocks.{i}.attn1.norm_q."),
    ("blocks.{i}.attn.k_norm.", "transformer_blocks.{i}.attn1.norm_k."),
    ("blocks.{i}.cross_attn.q_linear.", "transformer_blocks.{i}.attn2.to_q."),
    ("blocks.{i}.cross_attn.proj.", "transformer_blocks.{i}.attn2.to_out.0."),
    ("blocks.{i}.cross_attn.q_norm.", "transformer_blocks.{i}.attn2.norm_q."),
    ("blocks.{i}.cross_attn.k_norm.", "transformer_blocks.{i}.attn2.norm_k."),
    ("blocks.{i}.mlp.inverted_conv.conv.", "transformer_blocks.{i}.ff.conv_inverted."),
    ("blocks.{i}.mlp.depth_conv.conv.", "transformer_blocks.{i}.ff.conv_depth."),
    ("blocks.{i}.mlp.point_conv.conv.", "transformer_blocks.{i}.ff.conv_point."),
]
_FUSED = [  # (original, the diffusers parts concatenated along dim 0 in this order)
    ("blocks.{i}.attn.qkv.", tuple(f"transformer_blocks.{{i}}.attn1.to_{p}." for p in "qkv")),
    ("blocks.{i}.cross_attn.kv_linear.", tuple(f"transformer_blocks.{{i}}.attn2.to_{p}." for p in "kv")),
]

_TABLE = [(original, (diffusers,)) for original, diffusers in _RENAMES] + _FUSED


class SanaFormatError(ValueError):
    """A folder, config or state dict that is not a Sana transformer tessera can load."""


tessera_from_diffusers = renamed("transformer_blocks.", "blocks.")
diffusers_from_tessera = renamed("blocks.", "transformer_blocks.")


def _split(key: str, blocks: str):
    """`key` with its block index (after `blocks.`) written {i}, and that index (None outside the blocks)."""
    match = re.match(rf"^{blocks}\.(\d+)\.", key)
    index = match.group(1) if match else None
    template = key if match is None else f"{blocks}.{{i}}." + key[match.end() :]
    return template, index


def _match(template: str, entry: str):
    """The rest of `template` after table entry `entry` (a prefix if it ends in "."), or None."""
    if entry.endswith("."):
        return template[len(entry) :] if template.startswith(entry) else None
    return "" if template == entry else None


def diffusers_from_original(state_dict: dict) -> dict:
    """An original Sana checkpoint's state dict (or the dict around it, under "state_dict") -> diffusers'
    names; fused projections are split, ORIGINAL_ONLY dropped. Unknown keys are an error naming them."""
    state_dict = state_dict.get("state_dict", state_dict)
    out, unknown = {}, []
    for key, value in state_dict.items():
        key = key.removeprefix("model.diffusion_model.")
        if key in ORIGINAL_ONLY:
            continue
        template, i = _split(key, "blocks")
        for original, parts in _TABLE:
            rest = _match(template, original)
            if rest is not None:
                for part, piece in zip(parts, value.chunk(len(parts), dim=0)):
                    out[part.format(i=i) + rest] = piece if len(parts) > 1 else value
                break
        else:
            unknown.append(key)
    if unknown:
        raise SanaFormatError(f"keys that are not an original Sana transformer's: {unknown}")
    return out


def original_from_diffusers(state_dict: dict) -> dict:
    """diffusers' names -> the original release's, unprefixed (fused projections concatenated). ORIGINAL_ONLY
    are not made: diffusers keeps neither the fixed position buffer nor the learnt null caption."""
    out, unknown = {}, []
    for key in state_dict:
        template, i = _split(key, "transformer_blocks")
        for original, parts in _TABLE:
            rest = next((r for r in (_match(template, p) for p in parts) if r is not None), None)
            if rest is not None:
                if template.startswith(parts[0]):  # the first part brings the others
                    out[original.format(i=i) + rest] = torch.cat(
                        [state_dict[p.format(i=i) + rest] for p in parts], dim=0
                    )
                break
        else:
            unknown.append(key)
    if unknown:
        raise SanaFormatError(f"keys that are not a diffusers SanaTransformer2DModel's: {unknown}")
    return out


def sana_kwargs_from_diffusers_config(config: dict) -> dict:
    """SanaTransformer(...) keyword arguments for a diffusers SanaTransformer2DModel config.json (a key the
    config leaves out takes diffusers' default, as in diffusers). Unsupported settings are an error."""
    if config.get("guidance_embeds"):
        raise SanaFormatError("Sana-Sprint (guidance_embeds=true, sampled with SCM) is not supported")
    if config.get("qk_norm") not in (None, "rms_norm_across_heads"):
        raise SanaFormatError(f"Sana qk_norm={config['qk_norm']!r} is not supported (None or across heads)")
    if config.get("dropout", 0.0):
        raise SanaFormatError(f"Sana dropout={config['dropout']} is not supported (0.0)")
    defaults = {k: v.default for k, v in _parameters().items()}
    kwargs = {k: config.get(k, default) for k, default in defaults.items()}
    if kwargs["cross_attention_dim"] != kwargs["num_attention_heads"] * kwargs["attention_head_dim"]:
        raise SanaFormatError("Sana's cross_attention_dim must be num_attention_heads * attention_head_dim")
    return kwargs


def _parameters():
    return {k: p for k, p in inspect.signature(SanaTransformer.__init__).parameters.items() if k != "self"}


def build_sana(config: dict) -> SanaTransformer:
    """The tessera module of a diffusers SanaTransformer2DModel config (any depth and width)."""
    kwargs = sana_kwargs_from_diffusers_config(config)
    model = SanaTransformer(**kwargs)
    model._architecture = kwargs
    return model
