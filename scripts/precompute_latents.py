"""Encode a dataset once, sharded over ranks: videos/images with the VAE, prompts with the text encoder (a
model family's own; the empty prompt's and the training previews' conditionings too).

    torchrun --nproc_per_node 8 scripts/precompute_latents.py --config configs/video.yaml \
        --out latents/video480
    torchrun --nproc_per_node 8 train.py --config configs/video.yaml data.latents=latents/video480

Each sample is encoded in the bucket the recipe assigns it, from the clip that epoch 0 would take; rank
r encodes samples r, r + N, ...; loader workers (data.num_workers) decode ahead of the encoder.
Finished files are kept, named by what they hold (source file with its size and modification time,
caption, bucket, seed): a rerun after a crash, or after samples were added, encodes only what is
missing, and never reuses a file for other content. A folder made with another VAE, text encoder or
fps is refused before anything is encoded. Unreadable samples are left out and listed (data/latents.py).
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallel.lifecycle.startup  # noqa: E402, F401  (before torch loads)

# isort: split

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from configs import load_config, split_overrides  # noqa: E402
from data.latents import latent_meta, meta_differences  # noqa: E402
from data.loader import build_buckets, build_dataset, build_sampler, check_same_plan  # noqa: E402
from data.manifest import reference_paths  # noqa: E402
from data.media import to_model_range  # noqa: E402
from models.families import family_named  # noqa: E402
from models.family import REFERENCES  # noqa: E402
from models.util import reading_weights  # noqa: E402
from parallel.compute.layout import ParallelLayout  # noqa: E402
from parallel.drive.distill import distilled_recipe  # noqa: E402
from parallel.drive.family_training import (  # noqa: E402
    check_family_sizes,
    check_family_training,
    preview_references,
)
from parallel.drive.stored_previews import PREVIEWS, preview_identity, preview_sampling, store_previews  # noqa: E402
from parallel.lifecycle.entrypoint import run_as_process  # noqa: E402
from parallel.lifecycle.runtime import init_runtime, world_from_env  # noqa: E402


class _Shard:
    """This rank's samples, decoded in loader workers; a failure comes back as its reason."""

    def __init__(self, dataset, indices, seed):
        self.dataset, self.indices, self.seed = dataset, indices, seed

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        index = self.indices[i]
        entry = self.dataset.entries[index]
        bucket = self.dataset.table.buckets[self.dataset.bucket_of[index]]
        try:  # epoch 0's clip, the one training from media would take first
            return index, self.dataset.load(entry, bucket, np.random.default_rng([self.seed, 0, index])), None
        except Exception as e:  # noqa: BLE001 - reported by name, left out of the index
            return index, None, f"{type(e).__name__}: {e}"


def content_key(entry: dict, bucket: str, seed: int) -> str:
    """What a latent file holds: the source file as it is now (path, size, modification time), the
    caption, the bucket and the seed that picks epoch 0's clip. A rerun reuses a file only if all match."""
    held = [entry["path"], _version(entry["path"]), entry["caption"], bucket, seed]
    images = [entry.get(k) for k in ("image", "last_image")]
    if any(images):  # image-to-video's frames a manifest names (keys without them stay as they were)
        held.append(images)
    if entry.get(REFERENCES):  # an edit pair's input images, as they are now
        held.append([[path, _version(path)] for path in reference_paths(entry)])
    return hashlib.sha1(json.dumps(held).encode()).hexdigest()[:20]


def _version(path) -> tuple | None:
    """(size, modification time) of a file; None for what is not one (the synthetic generator's)."""
    try:
        stat = os.stat(path)
        return stat.st_size, stat.st_mtime_ns
    except OSError:
        return None


def family_encoder(cfg, family, runtime):
    """encode(entry, item) for a model family: the clip's latent as training encodes it (Family.encode_clips:
    the frames a manifest names too) and what it keeps of the caption's conditioning
    (Family.store_conditioning), in the compute dtype training uses; encode(None, None): the empty prompt's
    conditioning alone (Family.empty_conditioning). Each rank encodes its own samples alone."""
    dtype = torch.bfloat16 if runtime.bf16(cfg.train.precision) else torch.float32
    with reading_weights(f"{family.title}'s frozen parts (model.pretrained={cfg.model.pretrained})"):
        parts = family.load(cfg, runtime.device, dtype, transformer=False)
    length = cfg.text_encoder.max_length

    def encode(entry, item):
        if item is None:
            return family.empty_conditioning(parts, length)
        batch = {REFERENCES: [item[REFERENCES]]} if REFERENCES in item else {}  # an edit pair's input images
        cond = family.encode_batch(parts, [entry["caption"]], length, batch)
        sound = item["audio"][None].to(runtime.device) if "audio" in item else None  # data.audio
        video = to_model_range(item["video"][None].to(runtime.device))
        given = [item.get(k) for k in ("image", "last_image")]  # image-to-video's frames a manifest names
        given = [None if g is None else to_model_range(g[None].to(runtime.device)) for g in given]
        latent, cond = family.encode_clips(parts, video, sound, cond, given)
        dropped = family.dropped_conditioning(parts, length, batch)  # its caption dropped, if not the empty's
        dropped = {f"dropped_{name}": tensor for name, tensor in dropped.items()}
        return {"latent": latent[0], **family.store_conditioning(cond)[0], **dropped}

    encode.parts, encode.dtype = parts, dtype  # the previews' (store_training_previews)
    return encode


def store_training_previews(cfg, family, encode, out: Path) -> None:
    """The training previews' conditionings (sample.prompts) beside the latents: training on them then
    never loads the text encoder (parallel/drive/stored_previews.py). Not for previews sampled from
    first frames (image-to-video), whose conditioning training makes from its own parts."""
    if family.capabilities.image_to_video and family.needs_images(cfg):
        return
    sampling = preview_sampling(cfg, family, preview_references(cfg, family))
    identity = preview_identity(cfg, family, sampling, encode.dtype)
    if not store_previews(out / PREVIEWS, family.conditionings(encode.parts, sampling), identity, family):
        print("[precompute] the previews' conditionings hold values no file keeps: training encodes them")


def save_tensors(tensors: dict, path: Path) -> None:
    """float32 on the host, through a temporary file: a file is complete or absent (a rerun skips it)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.float().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def main(argv=None, session=None):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the recipe that will train on the latents")
    parser.add_argument("--out", required=True, help="the folder to write (data.latents=<this> trains on it)")
    args = parser.parse_args(args)
    cfg = load_config(args.config, overrides + ["data.latents=null"])  # this script reads the media
    family = family_named(cfg.model.family)
    cfg = distilled_recipe(cfg, family)  # train.objective=dmd: the previews the student's, as train.py's
    if family.loading.from_pretrained:
        family.check_pretrained(cfg)  # its VAE and text encoder named now, before any process group
    rank, world_size, _ = world_from_env()
    out = Path(args.out)
    meta = latent_meta(cfg)
    differ = (
        meta_differences(json.loads((out / "meta.json").read_text()), meta)
        if (out / "meta.json").is_file()
        else []
    )
    if differ:
        raise ValueError(
            f"--out {out} holds latents made with another VAE, text encoder, fps, task or family setting "
            f"({'; '.join(differ)}); write to another folder, or delete it to start over"
        )
    table = build_buckets(cfg)
    # what training would refuse (the task, a bucket's size), refused before encoding
    check_family_training(cfg, family, ParallelLayout(dp=world_size))
    check_family_sizes(cfg, family, ParallelLayout(dp=world_size), table)
    dataset = build_dataset(cfg, table)
    if rank == 0:
        print(f"[precompute] {dataset.summary()}", flush=True)
    runtime = init_runtime(cfg.parallel, ParallelLayout(dp=world_size), task="encode", session=session)
    # every rank must have indexed the same samples, or the shards would overlap or miss some
    check_same_plan(
        build_sampler(cfg, dataset, table, rank, world_size), dataset, None, runtime.control_group
    )
    encode = family_encoder(cfg, family, runtime)
    if runtime.is_main:
        (out / "latents").mkdir(parents=True, exist_ok=True)
        (out / "meta.json").write_text(json.dumps(meta, indent=1))  # before any latent: a rerun checks it
        save_tensors(encode(None, None), out / "empty.safetensors")  # what a dropped caption trains on
        store_training_previews(cfg, family, encode, out)
    runtime.fence()

    from torch.utils.data import DataLoader

    indices = list(range(rank, len(dataset), world_size))
    loader = DataLoader(
        _Shard(dataset, indices, cfg.train.seed), batch_size=None, num_workers=cfg.data.num_workers
    )
    lines, failed = [], {}
    for index, item, error in tqdm(loader, total=len(indices), desc="encode", disable=not runtime.is_main):
        entry, bucket = dataset.entries[index], table.buckets[dataset.bucket_of[index]]
        name = f"latents/{content_key(entry, bucket.name, cfg.train.seed)}.safetensors"
        if error is not None:
            failed[entry["path"]] = error
            continue
        if not (out / name).is_file():
            save_tensors(encode(entry, item), out / name)
        lines.append(
            {
                "index": index,
                "path": name,
                "caption": entry["caption"],
                "frames": bucket.frames,
                "height": bucket.height,
                "width": bucket.width,
                "source": entry["path"],
            }
        )
    (out / f"index.part{rank}.json").write_text(json.dumps({"lines": lines, "failed": failed}))
    runtime.fence()  # every part is written (gloo, long timeout: ranks may finish far apart)
    if runtime.is_main:
        parts = [json.loads((out / f"index.part{r}.json").read_text()) for r in range(world_size)]
        lines = sorted((line for p in parts for line in p["lines"]), key=lambda line: line["index"])
        failed = {k: v for p in parts for k, v in p["failed"].items()}
        tmp = out / "index.jsonl.tmp"
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        os.replace(tmp, out / "index.jsonl")
        for r in range(world_size):
            (out / f"index.part{r}.json").unlink()
        for path, why in failed.items():
            print(f"[precompute] left out {path}: {why}", flush=True)
        print(
            f"[precompute] {len(lines)} samples encoded into {out} ({len(failed)} left out); train with "
            f"data.latents={out}",
            flush=True,
        )
    runtime.fence()


if __name__ == "__main__":
    run_as_process(main)
