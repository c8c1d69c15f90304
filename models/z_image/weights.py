"""Z-Image's folders and weight names: the transformer from a ZImageTransformer2DModel config.json (at any
depth and width), diffusers' names <-> tessera's (`layers.` <-> `blocks.`), and the original release's
single file (Tongyi-MAI's names, under ComfyUI's `model.diffusion_model.` or not) -> diffusers', as
diffusers' convert_z_image_transformer_checkpoint_to_diffusers renames them.
"""

import re

import torch

from models.z_image.transformer import ZImageTransformer

PIPELINE_CLASS = "ZImagePipeline"
TRANSFORMER_CLASS = "ZImageTransformer2DModel"
# the release's rope split of its 128-channel heads (a single file's shapes do not hold it)
RELEASE_AXES = {128: (32, 48, 48)}
_RENAMES = (
    ("final_layer.", "all_final_layer.2-1."),
    ("x_embedder.", "all_x_embedder.2-1."),
    (".attention.out.", ".attention.to_out.0."),
    (".attention.q_norm.", ".attention.norm_q."),
    (".attention.k_norm.", ".attention.norm_k."),
)


def transformer_kwargs(config: dict) -> dict:
    """ZImageTransformer(...) keyword arguments from a diffusers config.json; the Omni variant (SigLIP
    features) and several patch sizes are refused by name."""
    if config.get("siglip_feat_dim") is not None:
        raise ValueError(
            "Z-Image Omni (siglip_feat_dim) is not supported: tessera samples text-to-image Z-Image"
        )
    patches = list(config.get("all_patch_size", (2,))), list(config.get("all_f_patch_size", (1,)))
    if len(patches[0]) != 1 or len(patches[1]) != 1:
        raise ValueError(
            f"Z-Image with several patch sizes ({patches}) is not supported: the release has one"
        )
    if config.get("n_kv_heads", config.get("n_heads", 30)) != config.get("n_heads", 30):
        raise ValueError(
            "Z-Image with n_kv_heads != n_heads: diffusers' model ignores it; tessera refuses it"
        )
    keys = ("in_channels", "dim", "n_layers", "n_refiner_layers", "n_heads", "norm_eps", "cap_feat_dim",
            "rope_theta", "t_scale", "axes_dims")  # fmt: skip
    kwargs = {key: config[key] for key in keys if key in config}
    if not config.get("qk_norm", True):
        raise ValueError("Z-Image without qk_norm is not supported (the release normalises queries and keys)")
    return dict(kwargs, patch_size=patches[0][0], f_patch_size=patches[1][0])


def build_transformer(config: dict, attention_backend: str = "sdpa") -> ZImageTransformer:
    return ZImageTransformer(**transformer_kwargs(config), attention_backend=attention_backend)


def diffusers_config(model: ZImageTransformer) -> dict:
    """The ZImageTransformer2DModel config of `model`'s architecture."""
    arch = model.architecture()
    patch, f_patch = arch.pop("patch_size"), arch.pop("f_patch_size")
    return dict(arch, _class_name=TRANSFORMER_CLASS, all_patch_size=[patch], all_f_patch_size=[f_patch],
                axes_dims=list(arch["axes_dims"]), n_kv_heads=arch["n_heads"], qk_norm=True)  # fmt: skip


def diffusers_from_original(state: dict) -> dict:
    """A single file's state dict (the release's names, or diffusers' already) under diffusers' names: the
    prefix dropped, the renames, the fused qkv split in three; the final norm's unused weight dropped."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^(model\.)?diffusion_model\.", "", key)
        for theirs, ours in _RENAMES:
            key = key.replace(theirs, ours) if not key.startswith("all_") else key
        if key.endswith(".attention.qkv.weight"):
            stem = key[: -len("qkv.weight")]
            q, k, v = torch.chunk(value, 3, dim=0) if isinstance(value, torch.Tensor) else (value,) * 3
            out.update({f"{stem}to_q.weight": q, f"{stem}to_k.weight": k, f"{stem}to_v.weight": v})
        elif key != "norm_final.weight":
            out[key] = value
    return out


def original_from_diffusers(state: dict, prefix: str = "") -> dict:
    """diffusers' names -> the release's (diffusers_from_original's inverse; the tests' single files)."""
    out = {}
    for key, value in state.items():
        if key.endswith(".attention.to_q.weight"):
            stem = key[: -len("to_q.weight")]
            qkv = [state[f"{stem}to_{p}.weight"] for p in "qkv"]
            out[f"{prefix}{stem}qkv.weight"] = torch.cat(qkv)
            continue
        if key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            continue
        for theirs, ours in reversed(_RENAMES):
            key = key.replace(ours, theirs)
        out[prefix + key] = value
    return out


def config_of_shapes(shapes: dict) -> dict | None:
    """The diffusers config a single file's shapes give (diffusers' names); None where the rope's split of
    its head size is not the release's."""
    head = shapes["layers.0.attention.norm_q.weight"][0]
    if head not in RELEASE_AXES:
        return None
    embed, dim = shapes["all_x_embedder.2-1.weight"][1], shapes["all_x_embedder.2-1.weight"][0]
    count = lambda prefix: 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith(prefix))  # noqa: E731
    return dict(
        _class_name=TRANSFORMER_CLASS, in_channels=embed // 4, dim=dim, n_layers=count("layers."),
        n_refiner_layers=count("noise_refiner."), n_heads=dim // head, n_kv_heads=dim // head,
        cap_feat_dim=shapes["cap_embedder.1.weight"][1], axes_dims=list(RELEASE_AXES[head]),
    )  # fmt: skip
