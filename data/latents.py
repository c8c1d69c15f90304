"""The folder of precomputed latents that scripts/precompute_latents.py writes and data.latents reads.

    <folder>/meta.json          the VAE, text encoder and fps they were made with
    <folder>/index.jsonl        one line per sample: path, caption, frames, height, width (its bucket), source
    <folder>/latents/<key>.safetensors "latent" (C, t, h, w) float32, "text" (tokens, dim) float32; <key>
                                       is a hash of what it holds (scripts/precompute_latents.py);
                                       image-to-video adds "condition" (4 + C, t, h, w) and, with a CLIP
                                       encoder, "image_features" (images, tokens, width)
    <folder>/empty.safetensors  a dropped caption's (Family.empty_conditioning; older DiT folders have none:
                                training encodes it); samples hold Family.store_conditioning's tokens
Latents encode one clip per sample (the clip the loader takes in epoch 0) in the bucket the recipe
assigns; training reads them into the same buckets and the same sampler as media.
"""

import json
from pathlib import Path

from omegaconf import OmegaConf

from models.families import family_named
from models.family import part_folder

META_KEYS = {
    "vae": (
        "kind",
        "pretrained",
        "seed",
        "tiny_base_dim",
        "tiny_latent_channels",
        "tile_latent",
        "tile_overlap",
    ),
    "text_encoder": ("kind", "pretrained", "max_length", "seed", "tiny_d_model", "tiny_layers"),
    "data": ("fps", "audio"),  # data.audio: a family's latents hold the clips' sound too (LTX-2)
    "model": ("task", "image_dim"),  # image-to-video stores the condition too
    "image_encoder": ("pretrained",),
}


# What a folder written before a key was recorded was made with.
BEFORE = {"model": {"task": "t2v"}, "data": {"audio": False}, "family": {"images": False}}


def latent_meta(cfg) -> dict:
    """What the latents depend on, besides the samples themselves."""
    meta = {
        section: {k: OmegaConf.to_container(cfg, resolve=True)[section][k] for k in keys}
        for section, keys in META_KEYS.items()
    }
    if meta["model"]["task"] == "ti2v":  # its latents are text-to-video's: the clip holds its condition
        meta["model"]["task"] = "t2v"
    if cfg.model.image_dim:  # the CLIP folder actually read (a pipeline folder's image_encoder/)
        meta["image_encoder"]["pretrained"] = cfg.image_encoder.pretrained or cfg.model.pretrained
    family = family_named(cfg.model.family)
    if family.loading.from_pretrained:  # its VAE and text encoder: its folder's, in the compute dtype
        folders = {part: str(part_folder(cfg, part)) for part in ("vae", "text_encoder")}
        meta["family"] = {"name": family.name, **folders, "dtype": compute_dtype(cfg)}
        meta["family"]["images"] = family.needs_images(cfg)  # each clip's first frame stored (image-to-video)
        meta["family"].update(family.latent_record(cfg))
    return meta


# The keys of latent_meta that choose the frozen encoders' weights (tiling, max_length and fps change what
# is encoded, not with what)
ENCODER_KEYS = {
    "vae": ("kind", "pretrained", "seed", "tiny_base_dim", "tiny_latent_channels"),
    "text_encoder": ("kind", "pretrained", "seed", "tiny_d_model", "tiny_layers"),
    "image_encoder": ("pretrained",),
    "family": ("vae", "text_encoder"),
}


def encoder_record(cfg) -> dict:
    """What a training checkpoint records of the frozen encoders (train.py;
    parallel/checkpoints/checkpoint_records.py check_encoders refuses a resume with others): per part, the
    settings that choose its weights, and for a folder a fingerprint of the weight files its loader reads (the
    part's own folder: a pipeline's vae/, not the whole pipeline) in place of its path, so a folder moved
    elsewhere still resumes, and other weights of the same shapes, which would load silently, do not."""
    from models.family import component_folder
    from parallel.compute.cache import fingerprint_files

    meta = latent_meta(cfg)
    parts = {"vae.pretrained": "vae", "text_encoder.pretrained": "text_encoder"}
    parts |= {
        "image_encoder.pretrained": "image_encoder",
        "family.vae": "vae",
        "family.text_encoder": "text_encoder",
    }
    record = {}
    for section, keys in ENCODER_KEYS.items():
        for key in keys:
            if key not in meta.get(section, {}):
                continue
            value, name = meta[section][key], f"{section}.{key}"
            folder = component_folder(value, parts[name]) if name in parts and value else None
            if folder is not None and folder.exists():
                record[name] = {"folder": str(value), "weights": fingerprint_files(_weight_files(folder))}
            else:
                record[name] = value
    root = Path(cfg.model.pretrained) if cfg.model.pretrained else None
    if root is not None and (root / "model_index.json").is_file():  # a pipeline's other frozen parts
        for part in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("transformer")):
            files = _weight_files(part)
            if files and part.name not in ("vae", "text_encoder"):  # (those: above, from their own keys)
                record[f"parts.{part.name}"] = {"folder": str(part), "weights": fingerprint_files(files)}
    return record


def _weight_files(path: Path) -> list:
    if path.is_file():
        return [path]
    return sorted(p for pattern in ("*.safetensors", "*.bin", "*.pth") for p in path.glob(pattern))


def compute_dtype(cfg) -> str:
    """The dtype a family's frozen parts encode in (train.precision on this machine's device)."""
    import torch

    from parallel.lifecycle.runtime import computes_in_bf16

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "bf16" if computes_in_bf16(cfg.train.precision, device_type) else "fp32"


def meta_differences(made_with: dict, now: dict) -> list[str]:
    """'section.key: <there> there, <here> here' for each setting a folder's meta.json does not share."""

    def there(s, k):
        return made_with.get(s, {}).get(k, BEFORE.get(s, {}).get(k))

    return [
        f"{s}.{k}: {there(s, k)!r} there, {now[s].get(k)!r} here"
        for s in now
        for k in {**made_with.get(s, {}), **now[s]}  # a key recorded on one side only: set there, not here
        if there(s, k) != now[s].get(k)
    ]


def read_latent_index(folder, cfg) -> list[dict]:
    folder = Path(folder)
    if not (folder / "index.jsonl").is_file() or not (folder / "meta.json").is_file():
        raise FileNotFoundError(
            f"data.latents='{folder}' has no index.jsonl and meta.json; write it with "
            f"python scripts/precompute_latents.py --config <recipe> data.manifest=<your folder or manifest> "
            f"--out {folder} (torchrun to encode on several GPUs)"
        )
    now = latent_meta(cfg)
    differ = meta_differences(json.loads((folder / "meta.json").read_text()), now)
    if differ:
        raise ValueError(
            f"data.latents='{folder}' was made with another VAE, text encoder, fps, sound, task, folder or "
            f"family setting "
            f"({'; '.join(differ)}); "
            f"recompute it with this recipe or change the recipe back"
        )
    if "family" in now and not (folder / "empty.safetensors").is_file():
        raise FileNotFoundError(
            f"data.latents='{folder}' has no empty.safetensors (the empty prompt dropped captions train on); "
            f"write it again with torchrun scripts/precompute_latents.py --config <recipe> --out {folder}"
        )
    entries = []
    with open(folder / "index.jsonl") as f:
        for line in f:
            if line.strip():
                entry = json.loads(line)
                entry["path"] = str(folder / entry["path"])
                entries.append(entry)
    if not entries:
        raise ValueError(f"data.latents='{folder}': index.jsonl lists no samples")
    return entries
