"""The distributed bucket sampler: one global plan per epoch, the same on every rank.

For epoch e the plan is a pure function of (seed, e, the samples' buckets, the batch sizes):
shuffle each bucket, cut it into that bucket's batches (the last one may be short), shuffle the
list of batches, then pad it with whole batches from its start (or drop its tail, with
`data.epoch_remainder=drop`) to a multiple of the data-parallel size. Batch i*dp + r goes to rank r.
Every data-parallel rank therefore takes exactly the same number of steps in every epoch, for any
bucket distribution and any world size (Sana's per-rank greedy grouping does not, and its jobs
hang in the second epoch). All ranks of a sequence-parallel group share a dp rank and get the
same batch.

The number of batches per epoch does not depend on e, so step s is batch s mod steps_per_epoch of
epoch s div steps_per_epoch: resuming computes one plan and starts there, in O(1) steps, without
reading or decoding a sample.
"""

import hashlib

import numpy as np

REMAINDER_MODES = ("pad", "drop")


class BucketSampler:
    def __init__(self, bucket_of, batch_sizes: list[int], dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 remainder: str = "pad", start_step: int = 0):
        """bucket_of[i] is sample i's bucket; batch_sizes[b] is bucket b's per-rank batch size."""
        if remainder not in REMAINDER_MODES:
            raise ValueError(f"data.epoch_remainder must be one of {REMAINDER_MODES}, got {remainder!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        bucket_of = np.asarray(bucket_of, dtype=np.int64)
        if bucket_of.size == 0:
            raise ValueError("the dataset has no samples that fit a bucket")
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.members = [np.flatnonzero(bucket_of == b) for b in range(len(self.batch_sizes))]
        self.batches_per_bucket = [-(-len(m) // bs) for m, bs in zip(self.members, self.batch_sizes)]
        self.num_batches = sum(self.batches_per_bucket)  # before padding or dropping, the same every epoch
        if remainder == "drop" and self.num_batches < dp_size:
            raise ValueError(f"data.epoch_remainder=drop: the dataset makes {self.num_batches} batches per epoch, "
                             f"fewer than the {dp_size} data-parallel ranks; use data.epoch_remainder=pad or add data")
        self.dataset_size, self.dp_rank, self.dp_size = len(bucket_of), dp_rank, dp_size
        self.seed, self.remainder, self.start_step = seed, remainder, start_step
        whole = self.num_batches // dp_size if remainder == "drop" else -(-self.num_batches // dp_size)
        self.steps_per_epoch = whole
        self.padding_batches = whole * dp_size - self.num_batches  # negative: dropped
        self._plan_epoch, self._plan = None, None

    def plan(self, epoch: int) -> tuple[list[np.ndarray], str]:
        """The epoch's global list of batches (steps_per_epoch * dp of them) and its hash."""
        if self._plan_epoch == epoch:
            return self._plan
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for members, size in zip(self.members, self.batch_sizes):
            shuffled = members[rng.permutation(len(members))]
            batches.extend(shuffled[i:i + size] for i in range(0, len(shuffled), size))
        order = rng.permutation(len(batches))
        total = self.steps_per_epoch * self.dp_size
        plan = [batches[order[i % len(batches)]] for i in range(total)]  # pad by wrapping, or drop the tail
        digest = hashlib.sha1(np.array([len(b) for b in plan], dtype=np.int64).tobytes())
        digest.update(np.concatenate(plan).astype(np.int64).tobytes())
        self._plan_epoch, self._plan = epoch, (plan, digest.hexdigest()[:16])
        return self._plan

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step in epoch) of a global step."""
        return divmod(step, self.steps_per_epoch)

    def batch_at(self, step: int) -> list[tuple[int, int]]:
        """This rank's batch at a global step, as (sample index, epoch) pairs."""
        epoch, in_epoch = self.position(step)
        batch = self.plan(epoch)[0][in_epoch * self.dp_size + self.dp_rank]
        return [(int(i), epoch) for i in batch]

    def __iter__(self):
        step = self.start_step
        while True:  # endless: the training loop decides when to stop
            yield self.batch_at(step)
            step += 1

    def fingerprint(self, step: int) -> tuple[int, str]:
        """(steps per epoch, plan hash at this step's epoch): equal on every rank or the data differs."""
        return self.steps_per_epoch, self.plan(self.position(step)[0])[1]

    def state_dict(self, step: int) -> dict:
        epoch, in_epoch = self.position(step)
        return dict(seed=self.seed, epoch=epoch, step_in_epoch=in_epoch, step=step, plan_hash=self.plan(epoch)[1],
                    dp_size=self.dp_size, steps_per_epoch=self.steps_per_epoch, dataset_size=self.dataset_size)

    def load_state_dict(self, state: dict) -> int:
        """Check that the checkpoint's data position means the same here, and return the step to start at.

        A different dp size or a different plan (other data, buckets, batch sizes or seed) is an
        error: continuing would silently repeat or skip samples."""
        missing = [k for k in ("seed", "epoch", "step_in_epoch", "plan_hash", "dp_size") if k not in state]
        if missing:
            raise ValueError(f"the checkpoint's sampler state lacks {missing} (written by an older tessera); "
                             f"start fresh with train.resume=none")
        hint = "resume with the same data, recipe and GPU count, or start fresh with train.resume=none"
        if state["dp_size"] != self.dp_size:
            raise ValueError(f"cannot resume the data position: the checkpoint was written with {state['dp_size']} "
                             f"data-parallel ranks and this run has {self.dp_size}; {hint}")
        if state["seed"] != self.seed:
            raise ValueError(f"cannot resume the data position: the checkpoint used train.seed={state['seed']}, "
                             f"this run {self.seed}; {hint}")
        if state.get("steps_per_epoch", self.steps_per_epoch) != self.steps_per_epoch:
            raise ValueError(f"cannot resume the data position: an epoch had {state['steps_per_epoch']} steps when "
                             f"the checkpoint was written and has {self.steps_per_epoch} now (the data, buckets or "
                             f"batch sizes changed); {hint}")
        if self.plan(state["epoch"])[1] != state["plan_hash"]:
            raise ValueError(f"cannot resume the data position: epoch {state['epoch']}'s batch plan differs from the "
                             f"checkpoint's (the data, bucket assignment or batch sizes changed); {hint}")
        return state["epoch"] * self.steps_per_epoch + state["step_in_epoch"]


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of one sample's randomness (noise, timestep, text dropout) at one step: independent of
    the batch size, the rank and the parallel layout, and recomputed exactly on resume."""
    return ((seed * 1_000_003 + step) * 1_000_003 + index) % (2**63 - 1)
