"""Training that diverges: the loss, the gradients or the weights become NaN or inf. train.py checks every
step with NonFiniteGuard and stops, naming the step, before anything non-finite is saved (the save itself
checks the weights too: parallel/checkpoints/checkpoint.py).

A finite checkpoint is not always a good one: saved after the loss left its normal range, or with weights
grown to 1e29, it resumes into the same divergence and samples NaN. So every checkpoint records whether the
loss logged last and its largest trained weight were within train.loss_limit and train.weight_limit
(`health` in its trainer state), and the advice after a divergence names the newest one that was."""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallel.checkpoints.checkpoint_files import CheckpointError, find_latest_quietly, previous_checkpoint
from parallel.checkpoints.checkpoint_reading import read_trainer_state
from parallel.compute import comm


class TrainingDiverged(ArithmeticError):
    """The loss or the weights became non-finite; the message names the step and what to try."""


class NonFiniteGuard:
    """Every step's gradient norm is checked for NaN and inf. The norm is the whole model's (clipping
    all-reduces it), the same on every rank, so every rank decides alike without a collective of its own.

    train.on_nonfinite=stop (the default): the first non-finite step is kept on the device, which costs
    no host sync, and read at log steps and before every checkpoint and preview: the run then stops,
    naming that step, before anything non-finite is saved. skip: the norm is read on the host every step
    (one sync), and a non-finite step changes nothing (no optimizer step, no EMA update); MAX_SKIPPED
    such steps in a row stop the run."""

    MAX_SKIPPED = 20

    def __init__(self, train_cfg, device, run_dir, is_main: bool, bf16: bool):
        self.cfg, self.run_dir, self.is_main, self.bf16 = train_cfg, run_dir, is_main, bf16
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        self.skipped = self.in_a_row = 0
        self.last_loss = None  # (step, loss) last logged: what train.loss_limit judges at a save

    def skip(self, step: int, grad_norm: torch.Tensor) -> bool:
        """Record step `step`'s norm; True: skip this step's update (train.on_nonfinite=skip only)."""
        finite = torch.isfinite(grad_norm)
        if self.cfg.on_nonfinite == "stop":
            self.first_bad = torch.where(finite | (self.first_bad > 0), self.first_bad, step)
            return False
        if bool(finite):
            self.in_a_row = 0
            return False
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        if self.is_main:
            print(
                f"[tessera] step {step}: the gradient norm is {float(grad_norm)}; step skipped "
                f"(train.on_nonfinite=skip; {self.skipped} so far)",
                file=sys.stderr,
                flush=True,
            )
        if self.in_a_row >= self.MAX_SKIPPED:
            raise self.diverged(
                f"the gradient norm was not finite in the last {self.in_a_row} steps (up to step "
                f"{step}), all skipped"
            )
        return True

    def check(self, step: int, loss: float | None = None) -> None:
        """Stop if a step so far had a non-finite gradient norm, or `loss` (the logged loss) is not finite."""
        first = int(self.first_bad)  # the host sync: log steps, checkpoints and previews only
        if first:
            what = f"the gradient norm was not finite at step {first}"
        elif loss is not None and not math.isfinite(loss):
            what = f"the loss was {loss} at step {step}"
        else:
            self.last_loss = (step, loss) if loss is not None else self.last_loss
            return
        raise self.diverged(f"{what}; stopped at step {step} before saving anything non-finite")

    def diverged(self, what: str) -> "TrainingDiverged":
        """The error for `what` went wrong, with the last good checkpoint and what to try."""
        return TrainingDiverged(f"training diverged: {what}; {self.advice()}")

    def health(self, step: int, trained: list, group=None) -> dict:
        """What the trainer state of the checkpoint of `step` records: whether the loss logged last and the
        largest |weight| of `trained` (this rank's shards; the maximum over `group`, so every rank records
        the same) were in range. A checkpoint out of range is said once, and never recommended."""
        tc, largest = self.cfg, largest_weight(trained, group)
        why = []
        if self.last_loss is not None and self.last_loss[1] > tc.loss_limit:
            logged, loss = self.last_loss
            why.append(
                f"the loss logged at step {logged} was {loss:.4g}, above train.loss_limit={tc.loss_limit:g}"
            )
        if not largest <= tc.weight_limit:
            why.append(
                f"its largest trained weight was {largest:.4g}, above train.weight_limit={tc.weight_limit:g}"
            )
        if why and self.is_main:
            print(
                f"[tessera] step {step} is saved out of range ({'; '.join(why)}): a divergence will not "
                "recommend it (raise the limit if this is the model's normal range)",
                file=sys.stderr,
                flush=True,
            )
        loss = self.last_loss[1] if self.last_loss is not None else None
        return {"in_range": not why, "why": "; ".join(why), "loss": loss, "largest_weight": largest}

    def advice(self) -> str:
        tc, root = self.cfg, Path(self.run_dir) / "checkpoints"
        good, passed = recommended_checkpoint(root)
        out = "; ".join(f"{path.name}: {why}" for path, why in passed)
        if good is not None and not passed:
            resume = f"the last good checkpoint is {good} (the same command resumes from it)"
        elif good is not None:
            resume = (
                f"the last good checkpoint is {good}: resume from it with train.resume={good} (the newer "
                f"ones were saved out of range: {out})"
            )
        elif passed:
            resume = f"no checkpoint was saved in range ({out}): train.resume=none starts afresh"
        else:
            resume = "no checkpoint was written before it"
        fp32 = ", train.precision=fp32" if self.bf16 else ""
        return (
            f"{resume}; try a lower train.lr (now {tc.lr:g}) or train.grad_clip (now "
            f"{tc.grad_clip:g}){fp32}, "
            f"or train.on_nonfinite=skip"
        )


def largest_weight(tensors: list, group=None) -> float:
    """The largest |value| of `tensors` (DTensors: this rank's shard), over every rank of `group`: one
    min-max reduction per tensor (no copy), one host read per device, one all-reduce."""
    peaks: dict = {}
    for t in tensors:
        t = t.detach().to_local() if isinstance(t, DTensor) else t.detach()
        if t.numel():
            low, high = t.aminmax()
            peaks.setdefault(t.device, []).append(torch.maximum(-low, high).float())
    largest = max((float(torch.stack(p).max()) for p in peaks.values()), default=0.0)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = torch.tensor([largest], dtype=torch.float64)  # the control group is gloo: on the host
        largest = float(comm.all_reduce(everyone, op=dist.ReduceOp.MAX, group=group)[0])
    return largest


def recommended_checkpoint(root: Path) -> tuple[Path | None, list]:
    """(the newest complete checkpoint under `root` that was saved in range, [(path, why)] of the newer
    ones that were not). A checkpoint that records no health (saved before it was recorded) is taken as
    in range, as it was before."""
    passed, step = [], find_latest_quietly(root)
    while step is not None:
        try:
            health = read_trainer_state(step).get("health") or {}
        except CheckpointError as e:
            health = {"in_range": False, "why": f"its trainer state cannot be read ({e})"}
        if health.get("in_range", True):
            return step, passed
        passed.append((step, health.get("why", "")))
        step = previous_checkpoint(step)
    return None, passed
