"""The training data pipeline: buckets -> dataset -> global-plan sampler -> DataLoader."""

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from data.buckets import BucketTable
from data.dataset import BucketedDataset, collate
from data.media import to_model_range
from data.sampler import BucketSampler
from models.family import REFERENCES

# How the start-up summary counts the files a manifest or folder lists but training cannot use
# (anything else that failed to probe is 'unreadable').
LEFT_OUT_CATEGORIES = (
    ("unsupported file type", "unsupported file type"),
    ("no caption file", "no caption"),
    ("caption file", "caption not UTF-8"),
    ("FileNotFoundError", "missing"),
)


def build_buckets(cfg) -> BucketTable:
    from models.families import family_named

    space, patch = family_named(cfg.model.family).geometry(cfg)
    return BucketTable(cfg.data, space, patch, cfg.train.batch_size)


def build_dataset(cfg, table: BucketTable) -> BucketedDataset:
    """Latents (data.latents), media (data.manifest: a JSONL file or a captioned folder), or the
    synthetic demo generator. Every rank builds the same dataset from the same files. data.audio: each
    sample carries its clip's sound too, at the family's sound_format (data.fps required)."""
    dc = cfg.data
    if dc.audio and not (dc.latents or dc.manifest):
        raise ValueError(
            "data.audio=true trains on clips with sound, read from data.manifest (or data.latents "
            "precomputed with it); the synthetic demo (no data.manifest) carries none"
        )
    if dc.audio and not dc.fps:  # before any file is read: a bucket's sound must have one length
        from data.dataset import AUDIO_NEEDS_FPS

        raise ValueError(AUDIO_NEEDS_FPS)
    if dc.latents:
        from data.dataset import LatentDataset
        from data.latents import read_latent_index

        return LatentDataset(read_latent_index(dc.latents, cfg), table, cfg.train.seed)
    if dc.manifest:
        from data.dataset import MediaDataset
        from data.manifest import complete_metadata, missing_files, read_manifest
        from models.families import family_named

        family = family_named(cfg.model.family)
        frames = family.given_frames(cfg)
        skipped = {}  # a folder's files without a caption or that could not be probed
        listed = read_manifest(dc.manifest, skipped, references=REFERENCES in frames)
        count = len(listed) + len(skipped)
        entries, unreadable = complete_metadata(listed, need_fps=dc.fps is not None)
        unreadable.update(skipped)
        if REFERENCES in frames:  # each line's input images: named now, a missing one as a missing file
            entries = check_references(family, dc.manifest, entries, unreadable)
        # listed with their sizes (never opened), deleted or moved since: a sample of them is checked
        gone, checked = missing_files(entries)
        check_missing(cfg, count, unreadable, gone, len(entries) / max(checked, 1))
        if not entries:
            named = "; ".join(f"{p}: {why}" for p, why in list(unreadable.items())[:3])
            raise ValueError(
                f"data.manifest='{dc.manifest}': none of its {len(unreadable)} files can be read "
                f"({named} ...)"
            )
        sound = None
        if dc.audio:
            check_sound(dc.manifest, entries)
            # None for a family whose training reads no sound, refused by name in check_family_inputs
            sound = family.sound_format(cfg)
        say_unread_frames(cfg, family, entries, frames)
        dataset = MediaDataset(entries, table, dc.fps, cfg.train.seed, audio=sound, frames=frames)
        for path, why in unreadable.items():
            dataset.leave_out(path, left_out_category(why), why)
        dataset.gone = gone  # kept: each is replaced when loaded, as a file deleted during the run
        dataset.gone_checked = checked
        return dataset
    from data.dataset import SyntheticDataset
    from data.synthetic import SyntheticVideoDataset, train_combos

    generator = SyntheticVideoDataset(
        dc.synthetic_samples,
        max(table.frame_counts),
        dc.height,
        dc.width,
        seed=dc.synthetic_seed,
        min_frames=min(table.frame_counts),
        combos=train_combos(dc.synthetic_colors),
    )
    return SyntheticDataset(generator, table, cfg.train.seed)


def check_references(family, manifest, entries: list[dict], unreadable: dict) -> list[dict]:
    """The lines of an edit family's manifest: each names 1 to its max_references input images (else
    refused, naming the line's file); a line whose reference does not exist is left out as a missing
    file (check_missing's share then applies)."""
    from data.manifest import reference_paths

    kept = []
    for entry in entries:
        references = reference_paths(entry)
        most = family.capabilities.max_references
        if not 1 <= len(references) <= most:
            raise ValueError(
                f"data.manifest={manifest}: the line of {entry['path']} names {len(references)} references; "
                f"{family.title} trains on edit pairs of 1 to {most} input images"
            )
        missing = next((r for r in references if not os.path.isfile(r)), None)
        if missing is None:
            kept.append(entry)
        else:
            unreadable[entry["path"]] = f"FileNotFoundError: its reference {missing} does not exist"
    return kept


def say_unread_frames(cfg, family, entries: list[dict], frames: tuple) -> None:
    """A warning where the manifest names image-to-video frames (image, last_image) or an edit pair's
    references that this training does not condition on (Family.given_frames: model.task, the folder):
    they are not read, never silently."""
    from data.manifest import IMAGE_KEYS

    for key in (*IMAGE_KEYS, REFERENCES):
        named = sum(1 for e in entries if e.get(key))
        if named and key not in frames:
            takes = f"conditions on {', '.join(frames)} only" if frames else "conditions on no frame"
            warn_on_main(
                f"data.manifest names `{key}` on {named} of its {len(entries)} lines, and {family.title} "
                f"with model.task={cfg.model.task} (model.pretrained={cfg.model.pretrained}) {takes}: "
                f"those frames are not read"
            )


def check_sound(manifest, entries: list[dict], named: int = 3) -> None:
    """data.audio=true: every clip must carry sound, as its manifest line says ("audio", written by
    scripts/index_folder.py). Refused at start-up, before any process group, naming the first few: a
    clip without sound would otherwise fail only when its batch comes, hours into the run."""
    unknown = [e["path"] for e in entries if e.get("audio") is None]
    silent = [e["path"] for e in entries if e.get("audio") is False]
    for paths, why in (
        (
            unknown,
            "do not say whether their clip carries sound: the manifest predates audio indexing; re-run "
            "scripts/index_folder.py on its folder to record each clip's sound track",
        ),
        (
            silent,
            "name a clip without a sound track; LTX-2's audio training needs sound in every clip: "
            "leave them out of the manifest, or set data.audio=false",
        ),
    ):
        if paths:
            listed = ", ".join(paths[:named]) + (", ..." if len(paths) > named else "")
            raise ValueError(
                f"data.audio=true, but {len(paths)} of the {len(entries)} lines of "
                f"data.manifest='{manifest}' {why} ({listed})"
            )


def left_out_category(why: str) -> str:
    """The summary's category of a file left out for `why` (complete_metadata's reason)."""
    return next((name for prefix, name in LEFT_OUT_CATEGORIES if why.startswith(prefix)), "unreadable")


def check_missing(cfg, count: int, unreadable: dict, gone: list, scale: float = 1.0) -> None:
    """One rule for a manifest's missing files, whether its lines carry sizes (`gone`: found by a stat of
    a sample of them, which stands for `scale` times as many) or not (`unreadable`: probed,
    FileNotFoundError): a share above data.max_missing_fraction of the `count` files listed is a wrong path
    or a disk not mounted, refused on every rank before any process group, with the files found listed in
    the run's data report (written by rank 0, unless another run trains in the directory)."""
    limit, manifest = cfg.data.max_missing_fraction, cfg.data.manifest  # in [0, 1]: configs.validate
    probed = [path for path, why in unreadable.items() if left_out_category(why) == "missing"]
    missing = probed + gone
    share = (len(probed) + scale * len(gone)) / count if count else 0.0
    if share <= limit:
        return
    report = write_refusal_report(cfg.run.output_dir, unreadable, gone)
    where = f"listed in {report}" if report else "not listed: another run trains in run.output_dir"
    named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    about = "about " if scale > 1 else ""  # lines with sizes: a sample was checked
    raise ValueError(
        f"data.manifest='{manifest}': {about}{round(share * count)} of its {count} files ({share:.2%}) are "
        f"missing, more than data.max_missing_fraction={limit:g} allows ({named}; the files found are "
        f"{where}). A path relative to the manifest's folder that no longer leads there, or a disk not "
        f"mounted? Fix the paths, or raise data.max_missing_fraction to train on the rest"
    )


def write_refusal_report(output_dir, unreadable: dict, gone: list) -> Path | None:
    """data_report.jsonl as a start writes it (configs/rundir.py), for a start refused over its data: the
    files left out (missing first), then the files earlier processes of the run replaced (every one, the
    ranks' files merged into it). Only rank 0 writes; every rank names the file. None: not written, since
    a live run holds the directory (this start has not taken its lock, and must not write there)."""
    from configs.rundir import read_data_report
    from configs.runlock import live_holder
    from parallel.lifecycle.runtime import world_from_env

    folder = Path(output_dir)
    report = folder / "data_report.jsonl"
    if live_holder(folder) is not None:
        return None
    if world_from_env()[0] != 0:
        return report
    left = [(path, left_out_category(why), why) for path, why in unreadable.items()]
    left += [(path, "missing", "FileNotFoundError: listed with its sizes, not found") for path in gone]
    left.sort(key=lambda item: item[1] != "missing")  # stable: the manifest's order within
    lines = [{"kind": "left_out", "path": p, "category": c, "reason": why} for p, c, why in left]
    lines += [r for r in read_data_report(folder) if r.get("kind") == "replaced"]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "data_report.jsonl.tmp"
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines), errors="surrogateescape")
    os.replace(tmp, report)
    for merged in folder.glob("data_report_rank*.jsonl"):
        merged.unlink()
    return report


def build_sampler(
    cfg, dataset: BucketedDataset, table: BucketTable, dp_rank: int, dp_size: int
) -> BucketSampler:
    return BucketSampler(
        dataset.bucket_of, table.batch_sizes, dp_rank, dp_size, cfg.train.seed, cfg.data.epoch_remainder
    )


def check_same_plan(
    sampler: BucketSampler, dataset: BucketedDataset, resume_step: int | None, group=None, base: str = ""
) -> None:
    """One small all-gather: every rank must have the same steps per epoch, the same plan, the same
    data, the same checkpoint to resume from (None: none) and the same frozen base (`base`: a LoRA base's
    folder and fingerprint; a tessera base still training may write a new `latest` between two ranks'
    reads), or the job would hang later in a collective that one rank never reaches (or train each rank
    on other samples or weights). A mismatch is an error on every rank that names the ranks."""
    import torch.distributed as dist

    from parallel.compute import comm

    steps, plan_hash = sampler.fingerprint(resume_step or 0)
    world = dist.get_world_size(group)
    mine = torch.tensor(
        [
            steps,
            int(plan_hash[:15], 16),
            int(dataset.digest()[:15], 16),
            -1 if resume_step is None else resume_step,
            int(hashlib.sha256(base.encode()).hexdigest()[:15], 16),
        ],
        dtype=torch.int64,
    )
    everyone = comm.all_gather_into_tensor(torch.empty(5 * world, dtype=torch.int64), mine, group).view(
        world, 5
    )
    variants = defaultdict(list)
    for rank, row in enumerate(everyone.tolist()):
        variants[tuple(row)].append(rank)
    if len(variants) > 1:
        described = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {s} steps per epoch, plan "
            f"{p:015x}, data {d:015x}, base {b:015x}, "
            f"{'no checkpoint' if at < 0 else f'resuming at step {at}'}"
            for (s, p, d, at, b), r in variants.items()
        )
        raise ValueError(
            f"the data, the checkpoint or the LoRA base differs between ranks ({described}). Every rank must "
            f"read the same manifest with the same recipe and see the same run directory; a file that only "
            f"some ranks could probe changes their buckets; a base run still writing checkpoints moves its "
            f"`latest` (name its step_<N>)"
        )


def _worker_init(_):
    import signal

    torch.set_num_threads(1)  # workers resize on the CPU; N workers x all cores would oversubscribe
    # A stop signal (Ctrl-C reaches the whole terminal's process group, SLURM every process) is the
    # training process's to handle, at a step boundary; the workers end with it.
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


_KEPT: list = []  # what TESSERA_FAULT=leak keeps, in each worker


class _FaultyCollate:
    """collate, raising a DataError in the worker at the step named by TESSERA_FAULT=loader@<rank>:<step>
    (parallel/lifecycle/faults.py; the failure tests run one worker, so its batches are the steps in order);
    with TESSERA_FAULT=leak, each batch also keeps 64 MiB of the worker's memory for good (a leaking
    dataset)."""

    def __init__(self, start_step: int, faults):
        self.step = start_step + 1  # counted from 1, as in metrics.jsonl
        self.faults = faults

    def __call__(self, samples):
        from data.dataset import DataError

        step, self.step = self.step, self.step + 1
        if self.faults.loader_should_fail(step):
            raise DataError(f"injected loader fault in step {step}")
        if self.faults.named("leak"):
            _KEPT.append(bytearray(b"\x01") * (64 << 20))  # every page written: resident
        return collate(samples)


def build_loader(
    dataset: BucketedDataset, sampler: BucketSampler, num_workers: int, faults=None
) -> DataLoader:
    """`faults` (parallel/lifecycle/faults.py, the failure tests): a loader fault planned there wraps the
    collate."""
    faulty = faults is not None and (faults.named("loader") or faults.named("leak"))
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_FaultyCollate(sampler.start_step, faults) if faulty else collate,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=2 if num_workers > 0 else None,
        worker_init_fn=_worker_init,
    )


def encode_family_batch(run, batch, dropped: list, device) -> list:
    """A family's loader batch encoded (`run`: parallel/drive/family_training.py FamilyRun): [latents, the
    conditioning's tensors (parallel/drive/family_training.py shared_fields; None where absent)]; a dropped
    caption becomes the empty prompt. Precomputed (data.latents): the stored latents and conditioning, the
    empty prompt's from the folder."""
    from models.family import shared_fields

    if "stored" in batch:
        # a dropped caption's text is the empty prompt's (or what the sample stored as dropped_<name>: an
        # edit pair's empty instruction read with its images); what else the sample stored stays
        stored = [dropped_stored(s, run.empty) if d else s for d, s in zip(dropped, batch["stored"])]
        cond = run.family.load_conditioning(stored, run.max_length)
        x0 = batch["latent"].to(device)
    else:
        prompts = ["" if d else c for d, c in zip(dropped, batch["caption"])]
        cond = run.family.encode_batch(run.parts, prompts, run.max_length, batch)
        sound = batch["audio"].to(device) if "audio" in batch else None
        videos = to_model_range(batch["video"].to(device))
        given = [to_model_range(batch[k].to(device)) if k in batch else None for k in ("image", "last_image")]
        x0, cond = run.family.encode_clips(run.parts, videos, sound, cond, given)
    tensors = (getattr(cond, name) for name in shared_fields(run.family.conditioning))
    return [x0, *(None if t is None else t.to(device) for t in tensors)]


def dropped_stored(sample: dict, empty: dict) -> dict:
    """A stored sample with its caption dropped: the empty prompt's conditioning over it, then the sample's
    own dropped_<name> tensors (Family.dropped_conditioning) as <name>."""
    own = {name[len("dropped_") :]: t for name, t in sample.items() if name.startswith("dropped_")}
    return {**sample, **empty, **own}


def warn_on_main(line: str) -> None:
    """A warning every rank would reach alike (before any process group), printed by rank 0 alone."""
    from parallel.lifecycle.runtime import world_from_env

    if world_from_env()[0] == 0:
        print(f"[tessera] warning: {line}", flush=True)
