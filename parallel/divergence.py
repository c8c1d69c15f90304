"""Training that diverges: the loss, the gradients or the weights become NaN or inf. train.py checks every
step with NonFiniteGuard and stops, naming the step, before anything non-finite is saved (the save itself
checks the weights too: parallel/checkpoint.py)."""

import math
import sys
from pathlib import Path

import torch

from parallel.checkpoint_files import find_latest_quietly


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
            return
        raise self.diverged(f"{what}; stopped at step {step} before saving anything non-finite")

    def diverged(self, what: str) -> "TrainingDiverged":
        """The error for `what` went wrong, with the last good checkpoint and what to try."""
        return TrainingDiverged(f"training diverged: {what}; {self.advice()}")

    def advice(self) -> str:
        tc, latest = self.cfg, find_latest_quietly(Path(self.run_dir) / "checkpoints")
        resume = (
            f"the last good checkpoint is {latest} (the same command resumes from it)"
            if latest
            else "no checkpoint was written before it"
        )
        fp32 = ", train.precision=fp32" if self.bf16 else ""
        return (
            f"{resume}; try a lower train.lr (now {tc.lr:g}) or train.grad_clip (now "
            f"{tc.grad_clip:g}){fp32}, "
            f"or train.on_nonfinite=skip"
        )
