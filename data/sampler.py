"""A distributed batch sampler whose position is a pure function of (seed, step).

Each epoch is one seeded permutation of the dataset, the same on every rank, cut into global
batches of dp * batch_size; rank r takes slice r of each. Every data-parallel rank therefore takes
the same number of steps per epoch, and resuming at step s starts there directly: no sample is
read to get there (O(1), unlike fast-forwarding a loader through every consumed batch).
"""

import torch


class DistributedEpochSampler:
    def __init__(self, dataset_size: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 start_step: int = 0):
        global_batch = batch_size * dp_size
        if dataset_size < global_batch:
            raise ValueError(f"the dataset has {dataset_size} samples, fewer than one global batch "
                             f"({dp_size} data-parallel ranks x train.batch_size={batch_size}); lower train.batch_size "
                             f"or add data")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.steps_per_epoch = dataset_size // global_batch  # the remainder of each epoch is dropped
        self.start_step = start_step

    def epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def batch_at(self, step: int, order: torch.Tensor | None = None) -> list[int]:
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch) if order is None else order
        start = (in_epoch * self.dp_size + self.dp_rank) * self.batch_size
        return order[start:start + self.batch_size].tolist()

    def __iter__(self):
        step = self.start_step
        while True:  # endless: the training loop decides when to stop
            epoch = step // self.steps_per_epoch
            order = self.epoch_order(epoch)
            while step // self.steps_per_epoch == epoch:
                yield self.batch_at(step, order)
                step += 1

    def state_dict(self, step: int) -> dict:
        return dict(seed=self.seed, step=step, epoch=step // self.steps_per_epoch, dataset_size=self.dataset_size,
                    batch_size=self.batch_size, dp_size=self.dp_size)

    def check_resume(self, state: dict) -> None:
        """Refuse a resume that would silently change which samples come next."""
        for key in ("seed", "dataset_size", "batch_size", "dp_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data position: the checkpoint was written with {key}={state[key]} and this "
                    f"run has {key}={getattr(self, key)}; resume with the same data, batch size and GPU count, "
                    f"or start fresh with train.resume=none")


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of one sample's randomness (noise, timestep, text dropout) at one step: independent of
    the batch size, the rank and the parallel layout, and recomputed exactly on resume."""
    return ((seed * 1_000_003 + step) * 1_000_003 + index) % (2**63 - 1)
