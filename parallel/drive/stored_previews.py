"""The training previews' conditionings stored beside precomputed latents (previews.safetensors), so that
training on data.latents never loads the text encoder (FLUX.2 dev's: 22.9B parameters beside a 32B
transformer). scripts/precompute_latents.py writes them with the recipe's sample.* prompts; train.py reads
them back when the recipe asks for the same previews (`preview_identity`), else encodes them as before.
"""

import json
import os
from dataclasses import fields
from pathlib import Path

import torch
from omegaconf import OmegaConf

from models.family import Family
from models.sampler import Sampling

PREVIEWS = "previews.safetensors"


def preview_size(cfg) -> tuple:
    """(frames, height, width) of the training previews: sample.*'s, else data.*'s."""
    sc, data = cfg.sample, cfg.data
    return sc.frames or data.frames, sc.height or data.height, sc.width or data.width


def preview_sampling(cfg, family: Family, references, seeds: list | None = None) -> Sampling:
    """The previews' request: sample.prompts at preview_size, from `seeds` (zeros: a request whose noise
    nobody draws), `references`: their reference images (family_training.py preview_references)."""
    sc = cfg.sample
    seeds = [0] * len(sc.prompts) if seeds is None else seeds
    return Sampling(list(sc.prompts), seeds, preview_size(cfg), sc.steps, sc.guidance, sc.negative_prompt,
                    cfg.text_encoder.max_length, references)  # fmt: skip


def preview_identity(cfg, family: Family, sampling: Sampling, dtype: torch.dtype) -> dict:
    """What the previews' conditionings depend on: the family, its text encoder (text_encoder.*, or
    model.pretrained's), the prompts, the negative prompt where the scale guides, the scale, the size, the
    reference images, the frame rates, the dtype and the family's latent_record."""
    guided = family.guidance.guided(sampling.guidance)
    identity = {
        "family": family.name,
        "text_encoder": OmegaConf.to_container(cfg.text_encoder, resolve=True),  # its folder, kind, length
        "pretrained": str(cfg.model.pretrained),  # where a family's encoder is, unless text_encoder says
        "prompts": sampling.prompts,
        "negative_prompt": sampling.negative_prompt if guided else None,
        "guidance": float(sampling.guidance),
        "size": sampling.size,
        "images": list(cfg.sample.images or []),
        "max_length": sampling.max_length,
        "fps": [cfg.sample.fps, cfg.data.fps],  # LTX-2's conditioning carries its frame rates
        "dtype": str(dtype),
        **family.latent_record(cfg),  # what else of the family's the conditioning depends on
    }
    return json.loads(json.dumps(identity))  # as the file holds it (tuples become lists)


def store_previews(path: Path, previews: tuple, identity: dict, family: Family) -> bool:
    """Write (cond, uncond or None) to `path` (through a temporary file); False where a conditioning holds
    something a file cannot (then nothing is written and training encodes the previews itself)."""
    from safetensors.torch import save_file

    tensors, values = {}, {}
    for tag, cond in zip(("cond", "uncond"), previews, strict=True):
        if cond is None:
            continue
        if type(cond) is not family.conditioning:
            return False
        for f in fields(cond):
            value = getattr(cond, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{tag}.{f.name}"] = value.detach().cpu().contiguous().clone()  # shared ones apart
            else:  # None too: a field may have no default
                values[f"{tag}.{f.name}"] = value
    try:
        meta = {"identity": json.dumps(identity), "values": json.dumps(values)}
    except TypeError:
        return False
    meta["uncond"] = json.dumps(previews[1] is not None)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return True


def read_previews(path: Path, family: Family, identity: dict, device) -> tuple | None:
    """(cond, uncond or None) stored at `path` for exactly these previews, on `device`; None where there is
    no such file or it was made for others."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as stored:
        meta = stored.metadata() or {}
        if json.loads(meta.get("identity", "null")) != identity:
            return None
        tensors = {key: stored.get_tensor(key).to(device) for key in stored.keys()}
    values = json.loads(meta["values"])

    def build(tag: str):
        mine = {key: t for key, t in {**tensors, **values}.items() if key.startswith(tag + ".")}
        return family.conditioning(**{key[len(tag) + 1 :]: t for key, t in mine.items()})

    try:
        return build("cond"), build("uncond") if json.loads(meta["uncond"]) else None
    except TypeError:  # written when the conditioning had other fields: encoded again
        return None
