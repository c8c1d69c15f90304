"""What must hold before a checkpoint is written, and what the file system refused when it could not be:
no NaN or inf in the weights, the EMA or the optimizer, enough free space for the whole checkpoint
(one small all-gather, so every rank reaches the same verdict), and a full, over-quota, read-only
or unwritable file system named with the file, the free space and the checkpoint that stays intact.
"""

import errno
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from parallel.checkpoints.checkpoint_files import (
    CheckpointError,
    _is_complete,
    _step_of,
    find_latest_quietly,
)
from parallel.checkpoints.checkpoint_reading import newest_in_range
from parallel.compute import comm


class NonFiniteWeights(CheckpointError):
    """A save refused because the weights (or the EMA, or the optimizer state) hold NaN or inf."""


class StorageError(CheckpointError):
    """A save that the file system cannot hold (full, over quota, read-only, not writable)."""


def local_tensors(state):
    """Every tensor of a (nested) state dict, as this rank holds it (a DTensor's local shard)."""
    if isinstance(state, dict):
        for value in state.values():
            yield from local_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from local_tensors(value)
    elif isinstance(state, torch.Tensor):
        yield state.to_local() if hasattr(state, "to_local") else state


def _count_non_finite(tensors) -> int:
    """How many of `tensors` hold a NaN or an inf: one flag per tensor, stacked per device (AdamW keeps
    its `step` on the CPU beside CUDA moments, and tensors of two devices cannot be stacked), one host
    read per device."""
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(~torch.isfinite(t).all())
    return sum(int(torch.stack(flags).sum()) for flags in by_device.values())


def check_before_save(runtime, state: dict, root: Path, step: int, keep: int) -> int:
    """One small all-gather on the control group before anything is written: each rank's count of
    non-finite tensors (model, EMA, optimizer; a distillation's critic and its optimizer), the bytes it will
    write and the space free where it writes. Every rank reaches the same verdict from the same numbers.
    Returns the checkpoint's bytes. The space check assumes, as DCP's resume does, that every rank writes
    to one shared folder."""
    sections = tuple(state)  # model, ema, optimizer (a distillation's critic, critic_optimizer too)
    counts, written = [], 0
    for section in sections:
        tensors = list(local_tensors(state[section]))
        written += sum(t.numel() * t.element_size() for t in tensors)
        counts.append(_count_non_finite([t for t in tensors if t.is_floating_point() and t.numel()]))
    mine = torch.tensor([*counts, written, shutil.disk_usage(root).free], dtype=torch.int64)
    everyone = mine.view(1, -1)
    if runtime.world_size > 1:
        everyone = torch.empty((runtime.world_size, len(mine)), dtype=torch.int64)
        comm.all_gather_into_tensor(everyone, mine, runtime.control_group)
    n = len(sections)
    bad = everyone[:, :n].sum(0).tolist()
    needed, free = int(everyone[:, n].sum()), int(everyone[:, n + 1].min())
    latest = find_latest_quietly(root)
    if any(bad):
        which = ", ".join(f"{k} {name} tensor{'s' * (k > 1)}" for k, name in zip(bad, sections) if k)
        what = f"refusing to save step {step}: NaN or inf in {which}; nothing was written"
        complete = sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)
        good = newest_in_range(
            complete
        )  # saved with its loss and weights in range (parallel/lifecycle/divergence.py)
        error = NonFiniteWeights(
            f"{what}, and the last good checkpoint is {good or 'none (no checkpoint was written yet)'}"
        )
        error.what = what  # train.py words the advice itself
        raise error
    if free < needed + _margin(needed):
        fix = _space_fix(root, keep)
        raise StorageError(
            f"not enough space to save step {step} in {root} ({_file_system(root)}): "
            f"{_size(free)} free, {_required(needed)}; nothing was written, and "
            f"{_intact(latest)}. {fix[0].upper()}{fix[1:]}"
        )
    return needed


def _margin(needed: int) -> int:
    """What a save writes beyond its tensors (the trainer state, checksums and DCP's metadata), generously."""
    return int(0.02 * needed) + (16 << 20)


def _required(needed: int) -> str:
    margin = _margin(needed)
    return (
        f"{_size(needed + margin)} required (the tensors' ~{_size(needed)} plus a {_size(margin)} margin "
        f"for the metadata, checksums and trainer state)"
    )


def _space_fix(root: Path, keep: int | None) -> str:
    """'free space there', naming the complete checkpoints beside `latest` that a resume does not need
    when there are any: only then would a lower train.keep_checkpoints help (a first save has none)."""
    latest = find_latest_quietly(root)
    complete = sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)
    good = newest_in_range(complete)  # what a divergence's advice would name: never suggested for removal
    older = [p.name for p in complete[:-1] if p not in (latest, good)]
    if not older:
        return "free space there"
    fix = f"free space there, e.g. by removing older checkpoints a resume does not need ({', '.join(older)})"
    if keep != 1:  # 1 is the lowest
        now = f" (now {keep})" if keep else ""
        fix += (
            f"; a lower train.keep_checkpoints{now} keeps fewer of them (each save is written before the "
            f"oldest is removed)"
        )
    return fix


# errno -> how a message names what the file system refused
_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on",
    errno.EDQUOT: "disk quota exceeded on",
    errno.EROFS: "read-only file system at",
    errno.EACCES: "permission denied on",
    errno.EPERM: "operation not permitted on",
}


def storage_problem(error: BaseException, folder: Path | None = None) -> tuple[int, str | None] | None:
    """(errno, file) when `error` (or what it wraps: its cause, DCP's per-rank failures) is the file system
    refusing a write: full, over quota, read-only, not writable. Some writers lose the errno (torch's
    zip writer on a full disk says 'unexpected pos ...'): then a `folder` with almost no free space is taken
    as full. None: not a storage problem."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return e.errno, e.filename
        if "No space left on device" in str(e.args[0] if isinstance(e, CheckpointException) else e):
            return errno.ENOSPC, None
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
    if folder is not None:
        try:
            if shutil.disk_usage(folder).free < (1 << 20):
                return errno.ENOSPC, None
        except OSError:
            pass
    return None


def storage_message(
    problem: tuple[int, str | None],
    root: Path,
    needed: int | None = None,
    training: bool = True,
    keep: int | None = None,
) -> str:
    """The `error:` text for a write the file system refused. `root`: the run's checkpoints/ folder (for
    a training run, the previous checkpoint is named and resuming advised); the file system named is
    the failing file's. `needed`: the checkpoint's bytes; `keep`: train.keep_checkpoints, if known."""
    number, file = problem
    where = next((p for p in ([Path(file).parent] if file else []) + [root] if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    need = f", {_required(needed)}" if needed else ""
    what = f"{_STORAGE_ERRNOS[number]} {_file_system(where)}"
    message = f"{what} while writing {file or root}; {_size(free)} free{need}"
    if training:
        message += f"; {_intact(find_latest_quietly(root))}"
    if number in (errno.ENOSPC, errno.EDQUOT):
        fix = _space_fix(root, keep) if training else "free space there"
    else:
        fix = "make it writable, or write elsewhere (run.output_dir" + (")" if training else ", --output)")
    return f"{message}. {fix[0].upper()}{fix[1:]}, then run the same command" + (
        " to resume" if training else ""
    )


def _intact(latest: Path | None) -> str:
    return f"the previous checkpoint {latest} is intact" if latest else "no earlier checkpoint exists"


def _file_system(path: Path) -> str:
    """'/mnt/data (/dev/sdb1)': the mount point holding `path`, and its device when /proc/mounts says."""
    mount = Path(os.path.abspath(path))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, point = line.split()[:2]
            if point == str(mount):
                return f"{mount} ({device})"
    except OSError:
        pass
    return str(mount)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
