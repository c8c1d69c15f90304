"""The distributed bucket sampler: one global plan per epoch, the same on every rank.

The plan of epoch e is a pure function of (seed, e, the samples' buckets, the batch sizes): each
bucket shuffled and cut into batches, the batches shuffled, then padded with whole batches (or cut,
`data.epoch_remainder=drop`) to a multiple of the data-parallel size; batch i*dp + r goes to rank r.
Every rank takes the same number of steps in every epoch, whatever the buckets, and a resume starts
at step s in O(1), without reading a sample. docs/internals.md has the details.
"""

import hashlib

import numpy as np

REMAINDER_MODES = ("pad", "drop")
PLAN_CHANGE_MODES = ("error", "new_epoch")


class Plan:
    """One epoch's global batches: batch k is `samples[starts[k]:ends[k]]` (sample indices of one bucket)."""

    def __init__(self, samples: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.samples, self.starts, self.ends = samples, starts, ends
        lengths = ends - starts
        # the plan's samples in batch order, gathered without a Python loop over batches
        flat = (
            np.arange(lengths.sum())
            - np.repeat(np.cumsum(lengths) - lengths, lengths)
            + np.repeat(starts, lengths)
        )
        digest = hashlib.sha1(lengths.astype(np.int64).tobytes())
        digest.update(samples[flat].astype(np.int64).tobytes())
        self.hash = digest.hexdigest()[:16]

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, k: int) -> np.ndarray:
        return self.samples[self.starts[k] : self.ends[k]]


class BucketSampler:
    def __init__(
        self,
        bucket_of,
        batch_sizes: list[int],
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        remainder: str = "pad",
        start_step: int = 0,
    ):
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
            raise ValueError(
                f"data.epoch_remainder=drop: the dataset makes {self.num_batches} batches per epoch, "
                f"fewer than the {dp_size} data-parallel ranks; use data.epoch_remainder=pad or add data"
            )
        self.dataset_size, self.dp_rank, self.dp_size = len(bucket_of), dp_rank, dp_size
        self.seed, self.remainder, self.start_step = seed, remainder, start_step
        whole = self.num_batches // dp_size if remainder == "drop" else -(-self.num_batches // dp_size)
        self.steps_per_epoch = whole
        self.padding_batches = whole * dp_size - self.num_batches  # negative: dropped
        # Step `origin_step` is the start of epoch `origin_epoch`: (0, 0) unless a resume re-planned the data.
        self.origin_step, self.origin_epoch = 0, 0
        self._plans = {}  # two epochs: loader prefetch crosses an epoch boundary before a checkpoint asks

    def plan(self, epoch: int) -> Plan:
        """The epoch's global list of batches (steps_per_epoch * dp of them)."""
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, epoch])
            shuffled = [members[rng.permutation(len(members))] for members in self.members]
            starts, ends, offset = [], [], 0
            for members, size in zip(shuffled, self.batch_sizes):
                cuts = np.arange(0, len(members), size)
                starts.append(offset + cuts)
                ends.append(offset + np.minimum(cuts + size, len(members)))
                offset += len(members)
            starts, ends = np.concatenate(starts), np.concatenate(ends)
            order = rng.permutation(len(starts))
            order = order[
                np.arange(self.steps_per_epoch * self.dp_size) % len(order)
            ]  # pad by wrapping, or drop
            if len(self._plans) >= 2:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = Plan(np.concatenate(shuffled), starts[order], ends[order])
        return self._plans[epoch]

    def padding_note(self) -> str:
        """How the epoch was fitted to the ranks, for the start-up line ('' when it divided evenly)."""
        if self.padding_batches > 0:
            return f" + {self.padding_batches} repeated to fill every rank"
        if self.padding_batches < 0:
            return f", {-self.padding_batches} dropped to fit every rank"
        return ""

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step in epoch) of a global step."""
        epochs, in_epoch = divmod(step - self.origin_step, self.steps_per_epoch)
        return self.origin_epoch + epochs, in_epoch

    def batch_at(self, step: int) -> list[tuple[int, int]]:
        """This rank's batch at a global step, as (sample index, epoch) pairs."""
        epoch, in_epoch = self.position(step)
        batch = self.plan(epoch)[in_epoch * self.dp_size + self.dp_rank]
        return [(int(i), epoch) for i in batch]

    def __iter__(self):
        step = self.start_step
        while True:  # endless: the training loop decides when to stop
            yield self.batch_at(step)
            step += 1

    def fingerprint(self, step: int) -> tuple[int, str]:
        """(steps per epoch, plan hash at this step's epoch): equal on every rank or the data differs."""
        return self.steps_per_epoch, self.plan(self.position(step)[0]).hash

    def state_dict(self, step: int) -> dict:
        epoch, in_epoch = self.position(step)
        return dict(
            seed=self.seed,
            epoch=epoch,
            step_in_epoch=in_epoch,
            step=step,
            plan_hash=self.plan(epoch).hash,
            dp_size=self.dp_size,
            steps_per_epoch=self.steps_per_epoch,
            dataset_size=self.dataset_size,
            origin_step=self.origin_step,
            origin_epoch=self.origin_epoch,
        )

    def load_state_dict(self, state: dict, on_change: str = "error") -> tuple[int, str]:
        """Continue from a checkpoint's data position: returns (the step to start at, '' or why the plan
        was changed). If the plan is the checkpoint's (same seed, dp size, data, buckets and batch sizes)
        training continues at the exact batch. If not, continuing would silently repeat or skip samples:
        on_change='error' refuses; 'new_epoch' starts the next epoch under this run's plan, at the
        checkpoint's step (the rest of the interrupted epoch is skipped)."""
        if on_change not in PLAN_CHANGE_MODES:
            raise ValueError(f"data.on_plan_change must be one of {PLAN_CHANGE_MODES}, got {on_change!r}")
        if "step" not in state:
            raise ValueError("the checkpoint's sampler state has no step; start fresh with train.resume=none")
        step = int(state["step"])
        missing = [k for k in ("seed", "epoch", "step_in_epoch", "plan_hash", "dp_size") if k not in state]
        if missing:
            why = f"its data position lacks {missing} (it was written by an older tessera)"
        elif state["dp_size"] != self.dp_size:
            why = (
                f"it was written with {state['dp_size']} data-parallel ranks and this run has {self.dp_size}"
            )
        elif state["seed"] != self.seed:
            why = f"it used train.seed={state['seed']} and this run {self.seed}"
        elif state.get("steps_per_epoch") != self.steps_per_epoch:
            why = (
                f"an epoch had {state.get('steps_per_epoch')} steps then and has {self.steps_per_epoch} now "
                "(the data, buckets or batch sizes changed)"
            )
        else:
            self.origin_step, self.origin_epoch = state.get("origin_step", 0), state.get("origin_epoch", 0)
            if (
                self.position(step) == (state["epoch"], state["step_in_epoch"])
                and self.plan(state["epoch"]).hash == state["plan_hash"]
            ):
                return step, ""
            why = (
                f"epoch {state['epoch']}'s batch plan differs from the checkpoint's (the data, "
                "bucket assignment or batch sizes changed)"
            )
        epoch = int(state.get("epoch", 0))
        if on_change == "error":
            raise ValueError(
                f"cannot resume the data position: {why}. Resume with the same data, recipe and number of "
                f"data-parallel ranks; or set data.on_plan_change=new_epoch to start epoch {epoch + 1} "
                f"under the new plan (the rest of epoch {epoch} is skipped); or start fresh with "
                f"train.resume=none"
            )
        self.origin_step, self.origin_epoch = step, epoch + 1
        return step, f"{why}: epoch {self.origin_epoch} starts at step {step} under the new plan"


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of one sample's randomness (noise, timestep, text dropout) at one step: independent of
    the batch size, the rank and the parallel layout, and recomputed exactly on resume."""
    return ((seed * 1_000_003 + step) * 1_000_003 + index) % (2**63 - 1)
