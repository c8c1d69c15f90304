"""Training a model family of models/family.py (tessera's DiT, Qwen-Image, Sana, ...) in train.py's loop,
through the calls train.py makes for all of them: the frozen parts (the family's text encoder and VAE),
each batch encoded by the family and shared with the group, the family's loss on the training
transformer (built on the meta device by parallel/build/components.py, then adapters, the sequence operators,
FSDP2 and the weights read row by row), and previews sampled by models/sampler.py.
"""

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from models.family import Components, Family, shared_fields
from models.image_condition import first_frames
from models.sampler import checked, generate_images
from models.util import reading_weights
from parallel.compute import comm
from parallel.compute.operators import check_sequence_layout
from parallel.compute.sequence import share_batch
from parallel.drive.stored_previews import (
    PREVIEWS,
    preview_identity,
    preview_sampling,
    preview_size,
    read_previews,
)

_DTYPES = (torch.float32, torch.bool, torch.bfloat16, torch.float16, torch.int64)
_HEADER = 8  # per tensor: present, dtype, ndim, and up to 5 sizes


@dataclass
class FamilyRun:
    """A family's frozen parts for training (Components without its transformer) and the family. With
    precomputed latents (data.latents) the text encoder is freed once the previews' prompts are encoded."""

    family: Family
    parts: Components
    max_length: int
    empty: dict | None = None  # data.latents: the empty prompt's stored conditioning (dropped captions)
    previews: tuple | None = None  # data.latents: (cond, uncond or None) of sample.prompts
    unconditional: object = None  # the empty prompt's conditioning of one sample, once encoded (empty_batch)


def check_family_inputs(cfg, family: Family) -> None:
    """What any family's training (tessera's DiT's too) refuses by name before anything starts: a preview
    setting or negative prompt it does not read, a negative train.guidance, and data.audio for a family
    whose training reads no sound."""
    family.check_sample_keys(cfg)
    family.check_negative(cfg.sample.negative_prompt, "sample.negative_prompt")  # the previews'
    if cfg.model.base_dtype != "auto" and not cfg.lora.rank:  # sampling takes it with no LoRA at all
        raise ValueError(
            f"model.base_dtype={cfg.model.base_dtype} stores a frozen base, and lora.rank=0 trains every "
            "weight: set lora.rank for a LoRA run, or model.base_dtype=auto"
        )
    if cfg.train.guidance is not None and cfg.train.guidance < 0:
        raise ValueError(f"train.guidance={cfg.train.guidance}: a guidance scale is 0 or more")
    if cfg.data.audio and not family.capabilities.trains_audio:
        raise ValueError(
            f"data.audio=true: the training of {family.title} reads no sound (the clips' sound would go "
            "unused); set data.audio=false"
        )


def check_family_training(cfg, family: Family, layout) -> None:
    """What a family's training refuses, by name, before any process group (after its pretrained parts
    are checked: Family.check_pretrained): a model.task or image conditioning it does not train, and
    a sequence split its operators cannot take (the layout refuses cfg and pipefusion for training)."""
    if cfg.model.task not in family.capabilities.tasks:
        where = "comes from its image-to-video pipeline folder, where built"
        raise ValueError(
            f"model.task={cfg.model.task}: tessera's DiT's tasks; {family.title} leaves it at t2v (its "
            f"image-to-video training {family.capabilities.reasons.get('tasks', where)})"
        )
    family.check_training(cfg)
    can = family.capabilities
    folder_images = can.image_to_video and family.needs_images(cfg)  # its folder's first frame
    if folder_images and not can.trains_images:  # samples only from a first frame
        raise ValueError(
            f"model.pretrained={cfg.model.pretrained} is {family.title}'s image-to-video pipeline; its "
            "training is text-to-video only: use the text-to-video folder"
        )
    if folder_images:
        preview_images(cfg, family)  # read now: a wrong path is named before anything starts
    elif cfg.sample.images and not (family.takes_images(cfg) or can.references):  # else left unread
        raise ValueError(
            f"sample.images={list(cfg.sample.images)}: {family.title}'s previews from model.pretrained="
            f"{cfg.model.pretrained} sample from text alone; unset sample.images"
        )
    preview_references(cfg, family)  # likewise
    check_sequence_layout(family.meta_transformer(cfg), layout.ulysses, layout.ring, family.title)


def training_layouts(cfg, family: Family, buckets):
    """takes(layout) for parallel.auto: whether the family trains under its sequence split (its operators,
    and every bucket's and the previews' size split so: check_family_sizes)."""
    meta = functools.cache(lambda: family.meta_transformer(cfg))  # only parallel.auto asks

    def takes(layout) -> bool:
        try:
            check_sequence_layout(meta(), layout.ulysses, layout.ring, family.title)
            check_family_sizes(cfg, family, layout, buckets)
        except ValueError:
            return False
        return True

    return takes


def preview_images(cfg, family: Family) -> list:
    """The first frames (PIL) of an image-to-video folder's previews, one per sample.prompts, from
    sample.images (one for all, or one each): refused by name when empty, of another count or unreadable."""
    if not cfg.sample.images:
        raise ValueError(
            f"sample.images is empty: {family.title}'s image-to-video pipeline previews from a first frame; "
            "name one image for every preview, or one per sample.prompts"
        )
    return first_frames(list(cfg.sample.images), len(cfg.sample.prompts), "sample.images")


def preview_references(cfg, family: Family) -> list | None:
    """Every preview's reference images (PIL) from sample.images, for a family that takes references
    (its capabilities' references), read and checked as --image is; None without any."""
    sc = cfg.sample
    if not (family.capabilities.references and sc.images):
        return None
    try:
        given, count = (list(sc.images), None), len(sc.prompts)
        return family.sampling_images(cfg, given, count, preview_size(cfg), True)[0]
    except ValueError as e:
        raise ValueError(f"sample.images: {e}".replace("--image", "the image")) from None


def check_family_sizes(cfg, family: Family, layout, buckets) -> None:
    """Every bucket's size and the previews' the family can take, under the layout's split (Sana's halo
    needs a row and one per rank), or an error naming the bucket or sample.* key."""
    keys = "data.frames/frame_counts, data.height/width/resolutions/aspect_ratios"
    sizes = [(f"the bucket {b.name} ({keys})", b.frames, b.height, b.width) for b in buckets.buckets]
    for where, frames, height, width in [*sizes, ("sample.frames/height/width", *preview_size(cfg))]:
        try:
            family.check_size(cfg, frames, height, width)
            family.check_split(cfg, height, width, layout.ulysses, layout.ring)
        except ValueError as e:
            raise ValueError(f"{where}: {e}".replace("--", "")) from None


def frozen_family(cfg, family: Family, device, dtype, images: tuple = (None, None)) -> FamilyRun:
    """Its text encoder and VAE (with the previews' `images`: Family.with_preview_images); with
    data.latents, the VAE alone (for the previews) and the folder's empty prompt (its empty.safetensors,
    else encoded now) instead of the text encoder (Qwen-Image's: 15.7 GiB), with the previews'
    conditionings: the folder's (stored_previews.py: the text encoder is never read), else encoded now."""
    stored, latents = None, Path(cfg.data.latents) if cfg.data.latents else None
    if latents is not None:
        sampling = preview_sampling(cfg, family, preview_references(cfg, family))
        if (latents / "empty.safetensors").is_file():  # a dropped caption's too: no encoder at all
            identity = preview_identity(cfg, family, sampling, dtype)
            stored = read_previews(latents / PREVIEWS, family, identity, device)
    with reading_weights(f"{family.title}'s frozen parts (model.pretrained={cfg.model.pretrained})"):
        parts = family.load(cfg, device, dtype, transformer=False, texts=stored is None)
    run = FamilyRun(family, family.with_preview_images(cfg, parts, images), cfg.text_encoder.max_length)
    if latents is not None:
        from safetensors.torch import load_file

        parts, empty = run.parts, latents / "empty.safetensors"
        run.empty = load_file(empty) if empty.is_file() else family.empty_conditioning(parts, run.max_length)
        run.previews = stored or family.conditionings(parts, sampling)  # the references' latents too
        run.parts = replace(parts, text_encoder=None)
        del parts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return run


def share_family_batch(groups, tensors: list | None, count: int, device) -> list:
    """encode_family_batch's list from the group's first rank on every rank of the group: their shapes are
    not known from the plan (a prompt's length is its own), so a header travels first, then
    parallel/compute/sequence.py's share_batch."""
    if groups.sp_size == 1:
        return tensors
    header = torch.zeros(count, _HEADER, dtype=torch.int64)
    if groups.sp_rank == 0:
        for i, t in enumerate(tensors):
            if t is not None:
                header[i, :3] = torch.tensor([1, _DTYPES.index(t.dtype), t.dim()])
                header[i, 3 : 3 + t.dim()] = torch.tensor(t.shape)
    src = dist.get_global_rank(groups.sp_group, 0)
    rows = comm.broadcast(header.to(device), src, groups.sp_group).tolist()
    specs = [(tuple(sizes[:ndim]), _DTYPES[kind]) for present, kind, ndim, *sizes in rows if present]
    present = [t for t in tensors if t is not None] if groups.sp_rank == 0 else None
    shared = iter(share_batch(groups, present, specs, device))
    return [next(shared) if row[0] else None for row in rows]


def family_batch(run: FamilyRun, groups, encoded: list | None, device) -> tuple:
    """(x0, the family's conditioning) on every rank of the group, from the group's first rank's
    encode_family_batch list (None on the other ranks)."""
    names = shared_fields(run.family.conditioning)
    tensors = share_family_batch(groups, encoded, 1 + len(names), device)
    return tensors[0].float(), run.family.conditioning(**dict(zip(names, tensors[1:])))


def empty_batch(run: FamilyRun, count: int, device):
    """The empty prompt's conditioning for `count` samples (a distillation teacher's unconditional branch):
    encoded once on each rank (from the folder's stored one with data.latents), as a dropped caption is,
    and repeated; no clip is encoded again and nothing travels between ranks."""
    names = shared_fields(run.family.conditioning)
    if run.unconditional is None:
        if run.empty is not None:
            one = run.family.load_conditioning([run.empty], run.max_length)
        else:
            one = run.family.encode_batch(run.parts, [""], run.max_length, {})
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        run.unconditional = {name: on(getattr(one, name)) for name in names}
    repeat = lambda t: None if t is None else t.expand(count, *t.shape[1:]).clone()  # noqa: E731  (not the cache)
    return run.family.conditioning(**{name: repeat(t) for name, t in run.unconditional.items()})


def family_previews(cfg, run: FamilyRun, model, seeds: list, progress, device) -> tuple:
    """(images (B, 1, H, W, 3) in [0, 1], {index: where NaN or inf was found}) of sample.prompts, from the
    training transformer on every rank (it is sharded: each forward needs them all)."""
    parts = replace(run.parts, transformer=model)
    sampling = preview_sampling(cfg, run.family, None, seeds)
    can = run.family.capabilities
    if can.image_to_video and run.family.needs_images(cfg):  # its folder's first frame
        sampling = replace(sampling, images=preview_images(cfg, run.family))
    elif can.references:  # every preview's reference images, if any
        sampling = replace(sampling, images=preview_references(cfg, run.family))
    images, bad = checked(
        generate_images, run.family, parts, sampling, progress, device=device, conditioning=run.previews
    )
    return (images if images is not None else np.zeros(0)), bad
