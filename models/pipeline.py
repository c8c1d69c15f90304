"""Building the frozen components and the DiT from a recipe, and text-to-video generation with them.
Shared by train.py (previews), infer.py and scripts/eval_demo.py."""

import contextlib
import warnings

import numpy as np
import torch

from configs.schema import VAEConfig
from models.dit import DiT, build_dit
from models.flow import RectifiedFlow
from models.text_encoder import TextEncoder, build_text_encoder
from models.vae import LatentSpace, build_vae
from parallel import vae as parallel_vae
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
    if not cfg.model.get("pretrained"):
        return None
    from models.dit import ARCHITECTURE_OPTIONS, DiT_models, architecture_differences, recipe_key
    from models.wan import WanWeights

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


@torch.no_grad()
def generate(
    model,
    vae: LatentSpace,
    text_encoder: TextEncoder,
    flow: RectifiedFlow,
    prompts: list[str],
    frames: int,
    height: int,
    width: int,
    steps: int,
    guidance: float,
    negative_prompt: str = "",
    seeds: list[int] | None = None,
    autocast_dtype=None,
    progress=None,
    sampler=None,
    decode_group=None,
    decode_fence=None,
) -> np.ndarray:
    """Videos (B, frames, height, width, 3) as float32 in [0, 1]. Prompt i starts from noise seeded by
    seeds[i] (default: i), so a video does not depend on which other prompts share its batch or rank.
    `sampler` replaces flow.sample(model, ...) (parallel/pipefusion.py's ParallelSampler: PipeFusion, CFG
    parallel); `decode_group` shares the VAE decode's tiles among its ranks, `decode_fence` (a gloo group
    with a long timeout) is where a rank done with its tiles waits for the others (parallel/vae.py). The
    tiles come from the recipe (vae.tile_latent, vae.tile_overlap), never from the number of ranks."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    device = next(model.parameters()).device
    latent_shape = vae.latent_shape(frames, height, width, flow.patch_size)
    noise = torch.stack(
        [torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds]
    ).to(device)
    y, y_mask = text_encoder(prompts, device)
    neg_y, neg_mask = text_encoder([negative_prompt] * len(prompts), device)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        if sampler is None:
            latents = flow.sample(
                model, noise, y, y_mask, neg_y, neg_mask, steps=steps, guidance=guidance, progress=progress
            )
        else:
            latents = sampler(
                flow, noise, y, y_mask, neg_y, neg_mask, steps=steps, guidance=guidance, progress=progress
            )
    tiles = dict(
        tile=getattr(vae, "tile_latent", VAEConfig.tile_latent),
        overlap=getattr(vae, "tile_overlap", VAEConfig.tile_overlap),
    )
    videos = parallel_vae.decode(
        vae, latents.float(), decode_group, control_group=decode_fence, **tiles
    )  # [-1, 1]
    return ((videos.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).float().cpu().numpy()
