"""The components a recipe names, built for this process: the frozen text encoder and VAE, and the DiT
(on the meta device, or with its weights), with model.pretrained checked against the recipe first.
Shared by train.py, infer.py and the scripts; the weights are filled by parallel/init.py.
"""

import warnings

import torch

from models.dit import ARCHITECTURE_OPTIONS, DiT, DiT_models, architecture_differences, build_dit, recipe_key
from models.text_encoder import TextEncoder, build_text_encoder
from models.vae import LatentSpace, build_vae
from models.wan import WanWeights
from parallel.init import materialize


def build_frozen(cfg, device) -> tuple[TextEncoder, LatentSpace]:
    """The text encoder and the VAE (frozen, on `device`); the VAE carries the recipe's decode tiles."""
    vae = build_vae(cfg.vae).to(device)
    vae.tile_latent, vae.tile_overlap = cfg.vae.tile_latent, cfg.vae.tile_overlap
    return build_text_encoder(cfg.text_encoder).to(device), vae


def build_model(cfg, text_encoder: TextEncoder, vae: LatentSpace, weights: bool = True) -> DiT:
    """The DiT of the recipe, built on the meta device. weights=True: on the host, with model.pretrained's
    weights if set (checked against the recipe), else with weights fixed by train.seed alone (every rank
    and every run builds the same ones). weights=False: none yet; train.py shards it first, then
    parallel/init.py fills each rank's shard (a checkpoint load overwrites every weight)."""
    with torch.device("meta"):
        model = build_dit(cfg.model, in_channels=vae.latent_channels, text_dim=text_encoder.dim)
    if not model.text_mask and cfg.text_encoder.max_length != 512:
        warnings.warn(
            f"text_encoder.max_length={cfg.text_encoder.max_length} with unmasked text (model.text_mask "
            "false, as Wan): padding is attended, so the model sees other inputs than Wan's 512-token "
            "padding; set text_encoder.max_length=512 to match Wan",
            stacklevel=2,
        )
    if weights:
        materialize(model, "cpu", cfg.train.seed, open_pretrained(cfg, model))
    return model


def open_pretrained(cfg, model: DiT):
    """model.pretrained as a models.wan.WanWeights, after checking that the recipe builds the same
    architecture (a disagreement is an error naming the keys and the fix); None without model.pretrained."""
    if not cfg.model.pretrained:
        return None
    weights = WanWeights(cfg.model.pretrained)
    folder = weights.dit_kwargs
    ours = model.architecture()
    differs = architecture_differences(ours, folder)
    if differs:
        wrong = [f"{recipe_key(k)}: {k}={ours[k]!r}, the folder has {folder[k]!r}" for k in differs]
        dims = ("depth", "hidden_size", "num_heads")
        value = lambda v: str(v).lower() if isinstance(v, bool) else list(v) if isinstance(v, tuple) else v  # noqa: E731
        fixes = [
            f"model.{k}={value(folder[k])}".replace(" ", "")
            for k in differs
            if k in ("patch_size", "qk_norm", "rope_theta", *ARCHITECTURE_OPTIONS)
        ]
        if any(k in differs for k in dims):
            same = [
                name
                for name, size in DiT_models.items()
                if all(size.get(k) == folder[k] for k in (*dims, "ffn_dim"))
            ]
            fixes = ([f"model.size={same[0]}"] if same else []) + [
                f for f in fixes if not f.startswith("model.ffn_dim")
            ]
        hint = "; set " + " ".join(fixes) if fixes else ""
        raise ValueError(
            f"model.pretrained={cfg.model.pretrained} disagrees with the recipe: " + "; ".join(wrong) + hint
        )
    return weights
