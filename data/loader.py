"""The training data pipeline: dataset -> distributed sampler -> DataLoader."""

import torch
from torch.utils.data import DataLoader

from data.sampler import DistributedEpochSampler


def build_dataset(data_cfg):
    if data_cfg.manifest:
        from data.manifest import ManifestDataset

        return ManifestDataset(data_cfg.manifest, data_cfg.frames, data_cfg.height, data_cfg.width, data_cfg.fps)
    from data.synthetic import SyntheticVideoDataset

    return SyntheticVideoDataset(data_cfg.synthetic_samples, data_cfg.frames, data_cfg.height, data_cfg.width,
                                 seed=data_cfg.synthetic_seed)


def collate(samples: list[dict]) -> dict:
    return {"video": torch.stack([s["video"] for s in samples]), "caption": [s["caption"] for s in samples],
            "index": [s["index"] for s in samples]}


def build_loader(dataset, sampler: DistributedEpochSampler, num_workers: int) -> DataLoader:
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      prefetch_factor=2 if num_workers > 0 else None)
