"""The training data pipeline: buckets -> dataset -> global-plan sampler -> DataLoader."""

import hashlib
from collections import defaultdict

import torch
from torch.utils.data import DataLoader

from data.buckets import BucketTable
from data.dataset import BucketedDataset, collate
from data.media import to_model_range
from data.sampler import BucketSampler
from models import tiling

# How the start-up summary counts the files a manifest or folder lists but training cannot use
# (anything else that failed to probe is 'unreadable').
LEFT_OUT_CATEGORIES = (
    ("unsupported file type", "unsupported file type"),
    ("no caption file", "no caption"),
    ("caption file", "caption not UTF-8"),
    ("FileNotFoundError", "missing"),
)


def build_buckets(cfg) -> BucketTable:
    from models.vae import vae_latent_space

    return BucketTable(cfg.data, vae_latent_space(cfg.vae), cfg.model.patch_size, cfg.train.batch_size)


def build_dataset(cfg, table: BucketTable) -> BucketedDataset:
    """Latents (data.latents), media (data.manifest: a JSONL file or a captioned folder), or the
    synthetic demo generator. Every rank builds the same dataset from the same files."""
    dc = cfg.data
    if dc.latents:
        from data.dataset import LatentDataset
        from data.latents import read_latent_index

        return LatentDataset(
            read_latent_index(dc.latents, cfg), table, cfg.text_encoder.max_length, cfg.train.seed
        )
    if dc.manifest:
        from data.dataset import MediaDataset
        from data.manifest import complete_metadata, read_manifest

        skipped = {}  # a folder's files without a caption or that could not be probed
        entries, unreadable = complete_metadata(
            read_manifest(dc.manifest, skipped), need_fps=dc.fps is not None
        )
        unreadable.update(skipped)
        if not entries:
            named = "; ".join(f"{p}: {why}" for p, why in list(unreadable.items())[:3])
            raise ValueError(
                f"data.manifest='{dc.manifest}': none of its {len(unreadable)} files can be read "
                f"({named} ...)"
            )
        dataset = MediaDataset(entries, table, dc.fps, cfg.train.seed)
        for path, why in unreadable.items():
            category = next(
                (name for prefix, name in LEFT_OUT_CATEGORIES if why.startswith(prefix)), "unreadable"
            )
            dataset.leave_out(path, category, why)
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

    from parallel import comm

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


class _FaultyCollate:
    """collate, raising a DataError in the worker at the step named by TESSERA_FAULT=loader@<rank>:<step>
    (parallel/faults.py; the failure tests run one worker, so its batches are the steps in order)."""

    def __init__(self, start_step: int, faults):
        self.step = start_step + 1  # counted from 1, as in metrics.jsonl
        self.faults = faults

    def __call__(self, samples):
        from data.dataset import DataError

        step, self.step = self.step, self.step + 1
        if self.faults.loader_should_fail(step):
            raise DataError(f"injected loader fault in step {step}")
        return collate(samples)


def build_loader(
    dataset: BucketedDataset, sampler: BucketSampler, num_workers: int, faults=None
) -> DataLoader:
    """`faults` (parallel/faults.py, the failure tests): a loader fault planned there wraps the collate."""
    faulty = faults is not None and faults.named("loader")
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


def encode_batch(batch, dropped: list[bool], text_encoder, vae, device):
    """(x0 latents, text embeddings, text mask) of a batch: encoded now from pixels and captions, or read
    from precomputed latents (data.latents), where a dropped caption becomes the empty prompt's embedding."""
    if "latent" in batch:
        y, y_mask = batch["text"].to(device), batch["text_mask"].to(device)
        if any(dropped):
            empty, empty_mask = text_encoder([""], device)
            y[torch.tensor(dropped)], y_mask[torch.tensor(dropped)] = empty, empty_mask
        return batch["latent"].to(device), y, y_mask
    y, y_mask = text_encoder(["" if d else c for d, c in zip(dropped, batch["caption"])], device)
    video = to_model_range(batch["video"].to(device, non_blocking=True))
    # in the tiles precompute_latents.py uses, so media and precomputed latents are the same latents
    return tiling.encode(vae, video, vae.tile_latent, vae.tile_overlap), y, y_mask
