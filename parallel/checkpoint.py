"""Distributed checkpoints that never lose work.

Layout of a run directory's `checkpoints/`:
    step_<N>/        torch.distributed.checkpoint files of model, EMA and optimizer, plus
                     trainer_rank<R>.pt per rank (step, data position, world size; the same on
                     every rank, so a resume reads rank 0's before any process group exists)
    latest           a text file naming the newest complete step_<N>

Every rank writes its shards into a hidden temporary folder; only when all ranks have finished
does rank 0 rename it to step_<N> and then replace `latest`, so a crash mid-save leaves the
previous checkpoint intact and `latest` never names a partial one. The fences use the gloo
control group (long timeout): a slow filesystem does not trip the training watchdog.

DCP's planning collectives run on a gloo group made for the one save or load and destroyed after
it. Gloo runs its collectives on its own worker threads, and its gather copies the pickled plans
there with an ATen op large enough to open an OpenMP region; libgomp then gives each of those
threads its own team, which lives as long as the thread. On a machine with no spare cores that
leaves more OpenMP threads than CPUs, libgomp cuts every team's spin-wait to ~100 iterations
(GOMP_SPINCOUNT's "throttled" value), and each training op after the checkpoint paid a futex
wake-up: steps were 30-70% slower for the rest of the run (BENCHMARKS.md, issue 12). Destroying
the group joins its threads, libgomp frees their teams, and spinning comes back.
"""

import contextlib
import datetime
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class CheckpointError(RuntimeError):
    pass


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def find_latest(run_dir) -> Path | None:
    pointer = checkpoint_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir(run_dir) / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete; point 'latest' at a "
                              f"complete step_<N> folder or start fresh with train.resume=none")
    return path


def resolve_checkpoint(spec: str, run_dir) -> Path | None:
    """train.resume / --checkpoint: 'auto' (latest if any), 'none', or a folder."""
    if spec == "none":
        return None
    if spec in ("auto", "latest"):
        return find_latest(run_dir)
    path = Path(spec)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint '{spec}' is not a complete tessera checkpoint folder (no .metadata in it)")
    return path


def _on_io_group(control_group, call):
    """call(group) with a short-lived gloo group like `control_group` (same ranks and timeout). The
    group is destroyed and its last reference dropped on return: that is what ends its threads."""
    if not dist.is_initialized():
        return call(None)
    timeout = datetime.timedelta(minutes=30)
    with contextlib.suppress(Exception):  # private API; the 30-minute default is fine without it
        timeout = control_group._get_backend(torch.device("cpu")).options._timeout
    group = dist.new_group(dist.get_process_group_ranks(control_group), backend="gloo", timeout=timeout)
    try:
        return call(group)
    finally:
        dist.destroy_process_group(group)
        del group


def save_checkpoint(runtime, run_dir, step: int, model, ema, optimizer, trainer_state: dict, keep: int) -> Path:
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    runtime.fence()
    state = {"model": get_model_state_dict(model), "ema": get_model_state_dict(ema),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    # gloo, long timeout (I/O is slow), on a group of its own: see the docstring
    _on_io_group(runtime.control_group, lambda group: dcp.save(state, checkpoint_id=tmp, process_group=group))
    torch.save(trainer_state, tmp / f"trainer_rank{runtime.rank}.pt")
    runtime.fence()
    if runtime.is_main:
        replaced = root / f".step_{step}.old"  # re-saving a step: keep the old copy until the new one is in place
        shutil.rmtree(replaced, ignore_errors=True)
        if final.exists():
            final.rename(replaced)
        tmp.rename(final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name + "\n")
        pointer_tmp.replace(root / "latest")
        shutil.rmtree(replaced, ignore_errors=True)
        complete = sorted((p for p in root.glob("step_*") if (p / ".metadata").is_file()),
                          key=lambda p: int(p.name.split("_")[1]))
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    runtime.fence()
    return final


def _load(state: dict, path: Path, group=None) -> None:
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except CheckpointException as e:  # DCP's planning errors (missing keys, size mismatches); a BaseException
        raise CheckpointError(f"{path} does not fit this model ({type(e).__name__}: {str(e)[:300]}); was it written "
                              f"with another model.size, model.patch_size, VAE or text encoder? Use the recipe it was "
                              f"trained with, or train.resume=none") from e


def read_trainer_state(path) -> dict:
    """The step and data position of a checkpoint, read from files alone: every rank reads the same
    file, so a resume that cannot continue (another dp size, other data) fails on all ranks alike,
    before any process group, model or collective."""
    trainer_file = Path(path) / "trainer_rank0.pt"
    if not trainer_file.is_file():
        raise CheckpointError(f"{path} has no trainer_rank0.pt (the step and data position); it is not a complete "
                              f"tessera training checkpoint: pick another or start fresh with train.resume=none")
    return torch.load(trainer_file, weights_only=True)


def load_checkpoint(runtime, path, model, ema, optimizer) -> None:
    """Restore model, EMA and optimizer in place (resharded by DCP to this run's layout)."""
    state = {"model": get_model_state_dict(model), "ema": get_model_state_dict(ema),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    _on_io_group(runtime.control_group, lambda group: _load(state, Path(path), group))
    set_model_state_dict(model, state["model"])
    set_model_state_dict(ema, state["ema"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_weights(path, model, use_ema: bool = True) -> None:
    """Load the (EMA) weights of a training checkpoint into an unsharded model, e.g. for sampling."""
    key = "ema" if use_ema else "model"
    state = {key: model.state_dict()}
    _load(state, Path(path))
    model.load_state_dict(state[key])
