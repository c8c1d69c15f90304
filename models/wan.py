"""Wan 2.1/2.2 weights in tessera's DiT: the architecture from a diffusers `WanTransformer3DModel`
config, and its state dict under tessera's names. Single-device code; `models/dit.py` has the options
(adaln="single", QK norm across heads, no pooled text, unmasked text) that make the DiT Wan exactly.

Key map (diffusers -> tessera), per block i:
    attn1.to_q | to_k | to_v      -> blocks.i.attn.qkv            (concatenated, q first)
    attn1.to_out.0                -> blocks.i.attn.proj
    attn1.norm_q | norm_k         -> blocks.i.attn.q_norm | k_norm
    attn2.to_q                    -> blocks.i.cross_attn.q
    attn2.to_k | to_v             -> blocks.i.cross_attn.kv        (concatenated, k first)
    attn2.to_out.0, norm_q/k      -> blocks.i.cross_attn.proj, q_norm/k_norm
    norm2 (the only affine norm)  -> blocks.i.norm2
    ffn.net.0.proj | ffn.net.2    -> blocks.i.mlp.0 | mlp.2
    scale_shift_table             -> blocks.i.scale_shift_table
and patch_embedding -> x_embedder.proj, condition_embedder.time_embedder.linear_1/2 -> t_embedder.mlp.0/2,
condition_embedder.time_proj -> time_proj.1, condition_embedder.text_embedder.linear_1/2 -> y_embedder.0/2,
scale_shift_table -> final_layer.scale_shift_table, proj_out -> final_layer.linear.
"""

import re

import torch

from models.dit import WAN_OPTIONS

_RENAMES = [  # (diffusers pattern, tessera name); \\1 is the block index
    (r"patch_embedding\.(weight|bias)", r"x_embedder.proj.\1"),
    (r"condition_embedder\.time_embedder\.linear_1\.(weight|bias)", r"t_embedder.mlp.0.\1"),
    (r"condition_embedder\.time_embedder\.linear_2\.(weight|bias)", r"t_embedder.mlp.2.\1"),
    (r"condition_embedder\.time_proj\.(weight|bias)", r"time_proj.1.\1"),
    (r"condition_embedder\.text_embedder\.linear_1\.(weight|bias)", r"y_embedder.0.\1"),
    (r"condition_embedder\.text_embedder\.linear_2\.(weight|bias)", r"y_embedder.2.\1"),
    (r"scale_shift_table", r"final_layer.scale_shift_table"),
    (r"proj_out\.(weight|bias)", r"final_layer.linear.\1"),
    (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.scale_shift_table"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"blocks\.(\d+)\.attn1\.norm_q\.weight", r"blocks.\1.attn.q_norm.weight"),
    (r"blocks\.(\d+)\.attn1\.norm_k\.weight", r"blocks.\1.attn.k_norm.weight"),
    (r"blocks\.(\d+)\.attn2\.to_q\.(weight|bias)", r"blocks.\1.cross_attn.q.\2"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.(weight|bias)", r"blocks.\1.cross_attn.proj.\2"),
    (r"blocks\.(\d+)\.attn2\.norm_q\.weight", r"blocks.\1.cross_attn.q_norm.weight"),
    (r"blocks\.(\d+)\.attn2\.norm_k\.weight", r"blocks.\1.cross_attn.k_norm.weight"),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.(weight|bias)", r"blocks.\1.mlp.0.\2"),
    (r"blocks\.(\d+)\.ffn\.net\.2\.(weight|bias)", r"blocks.\1.mlp.2.\2"),
]
_CONCATENATED = [  # (diffusers name template, the projections in order, tessera name template)
    ("blocks.{i}.attn1.to_{p}.{kind}", ("q", "k", "v"), "blocks.{i}.attn.qkv.{kind}"),
    ("blocks.{i}.attn2.to_{p}.{kind}", ("k", "v"), "blocks.{i}.cross_attn.kv.{kind}"),
]


class WanFormatError(ValueError):
    """A folder or state dict that is not a Wan transformer tessera can load."""


def dit_kwargs_from_diffusers_config(config: dict) -> dict:
    """DiT(...) keyword arguments for a diffusers WanTransformer3DModel config (its config.json)."""
    unsupported = {
        "image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": None,  # image-to-video
        "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True, "eps": 1e-6, "freq_dim": 256,
    }
    for key, expected in unsupported.items():
        if config.get(key, expected) != expected:
            raise WanFormatError(f"Wan config {key}={config[key]!r} is not supported (tessera expects {expected!r})")
    out_channels = config.get("out_channels") or config["in_channels"]
    if out_channels != config["in_channels"]:
        raise WanFormatError(f"Wan config in_channels={config['in_channels']} and out_channels={out_channels} differ")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    return dict(in_channels=config["in_channels"], text_dim=config["text_dim"], depth=config["num_layers"],
                hidden_size=heads * head_dim, num_heads=heads, patch_size=tuple(config["patch_size"]),
                ffn_dim=config["ffn_dim"], **WAN_OPTIONS)


def tessera_state_dict_from_diffusers(state_dict: dict) -> dict:
    """diffusers WanTransformer3DModel keys -> tessera DiT keys (tensors are not copied, except where
    two or three projections are concatenated into one). Unknown keys are an error naming them."""
    out, used = {}, set()
    for template, projections, target in _CONCATENATED:
        first = re.compile(re.escape(template).replace(r"\{i\}", r"(\d+)").replace(r"\{kind\}", "(weight|bias)")
                           .replace(r"\{p\}", re.escape(projections[0])))
        for key in list(state_dict):
            match = first.fullmatch(key)
            if not match:
                continue
            i, kind = match.groups()
            parts = [template.format(i=i, p=p, kind=kind) for p in projections]
            missing = [part for part in parts if part not in state_dict]
            if missing:
                raise WanFormatError(f"Wan state dict has {key} but not {', '.join(missing)}")
            out[target.format(i=i, kind=kind)] = torch.cat([state_dict[part] for part in parts], dim=0)
            used.update(parts)
    for key, tensor in state_dict.items():
        if key in used:
            continue
        for pattern, target in _RENAMES:
            if re.fullmatch(pattern, key):
                out[re.sub("^" + pattern + "$", target, key)] = tensor
                break
        else:
            raise WanFormatError(f"Wan state dict key '{key}' has no tessera counterpart (image-to-video weights "
                                 "and other variants are not supported)")
    return out
