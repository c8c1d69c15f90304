"""Distributed checkpoints that never lose work.

Layout of a run directory's `checkpoints/`:
    step_<N>/        torch.distributed.checkpoint files of model, EMA and optimizer, plus
                     trainer_rank<R>.pt per rank (step, data position, world size; the same on
                     every rank, so a resume reads rank 0's before any process group exists), and
                     checksums.json: the size and crc32 of every file, as each rank wrote it
    latest           a text file naming the newest complete step_<N>

Every rank writes its shards into a hidden temporary folder, then reads back and fsyncs the files
it wrote and records their sizes and crc32s; only when all ranks have finished does rank 0 rename
the folder to step_<N>, fsync the parent folder, and then replace (and fsync) `latest`. A kill at
any point of a save leaves `latest` naming a complete checkpoint; the hidden leftovers
(.step_<N>.tmp, .step_<N>.old) are removed by the next save, after its `latest` has moved. A load
first checks every file against checksums.json (the work split over the ranks), so a truncated or
corrupted shard is refused by name, with the previous checkpoint suggested, before any weight is
read. The fences use the gloo control group (long timeout): a slow filesystem does not trip the
training watchdog.

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
import errno
import json
import os
import re
import shutil
import zlib
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

from parallel import comm

CHECKSUMS = "checksums.json"
_POINTER = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    pass


class NonFiniteWeights(CheckpointError):
    """A save refused because the weights (or the EMA, or the optimizer state) hold NaN or inf."""


class StorageError(CheckpointError):
    """A save that the file system cannot hold (full, over quota, read-only, not writable)."""


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_of(path: Path) -> int | None:
    """N of a step_<N> folder (or of the hidden .step_<N>.old copy a killed re-save leaves)."""
    match = re.fullmatch(r"\.?step_(\d+)(\.old)?", path.name)
    return int(match.group(1)) if match else None


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def previous_checkpoint(path) -> Path | None:
    """The newest complete step_<N> beside `path` that is older than it (the one to fall back on)."""
    path = Path(path)
    step = _step_of(path)
    older = [
        (n, p)
        for p in path.parent.glob("step_*")
        if (n := _step_of(p)) is not None and (step is None or n < step) and p != path and _is_complete(p)
    ]
    return max(older)[1] if older else None


def _fallback_hint(path) -> str:
    previous = previous_checkpoint(path)
    if previous is None:
        return "no earlier complete checkpoint is left beside it: start fresh with train.resume=none"
    return (
        f"the previous complete checkpoint is {previous}: resume from it with train.resume={previous} "
        f"(infer.py --checkpoint {previous})"
    )


def _follow(pointer: Path) -> Path:
    """The step folder a `latest` pointer file names."""
    try:
        name = pointer.read_text(errors="replace").strip() if pointer.stat().st_size < 1024 else ""
    except OSError as e:
        raise CheckpointError(f"cannot read {pointer}: {e}") from None
    if not _POINTER.fullmatch(name):
        raise CheckpointError(
            f"{pointer} is not a tessera `latest` pointer (a file holding one line, step_<N>)"
        )
    path = pointer.parent / name
    if _is_complete(path):
        return path
    # A re-save of step N killed between moving the old step_N aside and renaming the new one in:
    # the old copy is still complete, under the name the save gave it.
    replaced = pointer.parent / f".{name}.old"
    if _is_complete(replaced):
        return replaced
    raise CheckpointError(f"{pointer} names {name}, which is missing or incomplete; {_fallback_hint(path)}")


def find_latest(run_dir) -> Path | None:
    pointer = checkpoint_dir(run_dir) / "latest"
    return _follow(pointer) if pointer.is_file() else None


def resolve_checkpoint(spec: str, run_dir) -> Path | None:
    """train.resume / --checkpoint: 'auto' (the run's latest, if any), 'none', or a path: a step_<N>
    folder, a `latest` pointer file, a checkpoints/ folder or a run directory (their latest)."""
    if spec == "none":
        return None
    if spec in ("auto", "latest"):
        return find_latest(run_dir)
    path = Path(spec)
    if path.is_file():
        return _follow(path)
    if _is_complete(path):
        return path
    for pointer in (path / "latest", checkpoint_dir(path) / "latest"):
        if pointer.is_file():
            return _follow(pointer)
    raise CheckpointError(
        f"checkpoint '{spec}' is not a complete tessera checkpoint folder (no .metadata in it), nor "
        f"a `latest` pointer, a checkpoints/ folder or a run directory with one"
    )


# The points of a save where the failure tests kill a process (TESSERA_FAULT=save_<point>, parallel/faults.py):
# before_shards (the temporary folder made, nothing written), after_shards (every rank's files written
# and checksummed, not yet renamed), after_rename (step_<N> in place, `latest` not yet moved).
FAULT_POINTS = ("before_shards", "after_shards", "after_rename")


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in a folder durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network filesystems cannot fsync a folder; their renames are synchronous
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _size_and_crc(path: Path, sync: bool = False) -> tuple[int, int]:
    """(size, crc32) of a file, read in 16 MiB pieces; with sync, also fsync it (it was just written,
    so the read comes from the page cache)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
        if sync:
            os.fsync(f.fileno())
    return size, crc


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _seal(folder: Path, rank: int) -> None:
    """fsync the files this rank wrote and record their size and crc32 in a part file of its own
    (DCP names its files __<rank>_<i>.distcp; rank 0 also wrote .metadata)."""
    mine = sorted(folder.glob(f"__{rank}_*")) + [folder / f"trainer_rank{rank}.pt"]
    if rank == 0:
        mine.append(folder / ".metadata")
    files = {p.name: dict(zip(("size", "crc32"), _size_and_crc(p, sync=True))) for p in mine}
    _write_durably(folder / f".checksums_rank{rank}.json", json.dumps(files))


def _merge_checksums(folder: Path, world_size: int) -> None:
    """Rank 0: one checksums.json from every rank's part; a file no rank claimed is hashed here."""
    files = {}
    for rank in range(world_size):
        part = folder / f".checksums_rank{rank}.json"
        files.update(json.loads(part.read_text()))
        part.unlink()
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in files:
            files[p.name] = dict(zip(("size", "crc32"), _size_and_crc(p, sync=True)))
    _write_durably(folder / CHECKSUMS, json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))
    _fsync_dir(folder)


def _clear(path: Path) -> None:
    """Remove a step folder so that it vanishes at once (renamed hidden first): a kill mid-way leaves
    no half-deleted step_<N> that still looks complete."""
    hidden = path.with_name(f".{path.name}.deleted")
    shutil.rmtree(hidden, ignore_errors=True)
    path.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


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


def save_checkpoint(
    runtime, run_dir, step: int, model, ema, optimizer, trainer_state: dict, keep: int
) -> Path:
    """Write step_<N> and move `latest` to it (see the module docstring). Refused before a byte is written,
    alike on every rank: weights that are not finite (NonFiniteWeights) and a checkpoint larger than the
    free space (StorageError). A file system that fails during the save (full, over quota, read-only) is a
    StorageError naming it, the file and the previous checkpoint, which stays `latest`."""
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    state = {
        "model": get_model_state_dict(model),
        "ema": get_model_state_dict(ema),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    if runtime.is_main:  # what killed or failed saves left: never named by `latest`, and it takes space
        for pattern in (".step_*.tmp", ".step_*.deleted"):
            for leftover in root.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    runtime.fence()  # every rank measures the free space after the clean-up
    needed = None
    try:
        needed = _check_before_save(runtime, state, root, step, keep)
        _write(runtime, state, root, final, tmp, step, trainer_state, keep)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if runtime.is_main and isinstance(e, (CheckpointError, CheckpointException)):
            # a refusal or a DCP failure, which every rank shares: give the space back (`latest` still names
            # the previous checkpoint). A failure of one rank's own files leaves the folder to the next
            # save's clean-up: the other ranks may still be reading theirs back.
            shutil.rmtree(tmp, ignore_errors=True)
        problem = storage_problem(e, root) if not isinstance(e, CheckpointError) else None
        if problem is None:
            raise
        raise StorageError(storage_message(problem, root, needed)) from None
    return final


def _write(
    runtime, state, root: Path, final: Path, tmp: Path, step: int, trainer_state: dict, keep: int
) -> None:
    runtime.faults.at_save("before_shards", step)
    writer = runtime.faults.full_disk_writer(tmp, step)  # tests only (TESSERA_FAULT=enospc); else None
    # gloo, long timeout (I/O is slow), on a group of its own (see the docstring); DCP's collectives run inside
    with comm.recorded("checkpoint_save", runtime.control_group, None):
        _on_io_group(
            runtime.control_group,
            lambda group: dcp.save(state, checkpoint_id=tmp, process_group=group, storage_writer=writer),
        )
    torch.save(trainer_state, tmp / f"trainer_rank{runtime.rank}.pt")
    _seal(tmp, runtime.rank)
    runtime.fence()
    if runtime.is_main:
        _merge_checksums(tmp, runtime.world_size)
    runtime.faults.at_save("after_shards", step)
    if runtime.is_main:
        replaced = (
            root / f".step_{step}.old"
        )  # re-saving a step: keep the old copy until the new one is in place
        if (
            final.exists()
        ):  # (without step_<N>, `latest` may resolve to a .old left by a killed re-save: keep it)
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        tmp.rename(final)
        _fsync_dir(root)
        runtime.faults.at_save("after_rename", step)
        pointer_tmp = root / "latest.tmp"
        _write_durably(pointer_tmp, final.name + "\n")
        pointer_tmp.replace(root / "latest")
        _fsync_dir(root)
        # `latest` has moved: what killed saves left behind is no longer needed by anyone.
        for pattern in (".step_*.tmp", ".step_*.old", ".step_*.deleted"):
            for leftover in root.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)
        complete = sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)
        for old in complete[:-keep]:
            if old != final:
                _clear(old)
    runtime.fence()


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


def _check_before_save(runtime, state: dict, root: Path, step: int, keep: int) -> int:
    """One small all-gather on the control group before anything is written: each rank's count of
    non-finite tensors (model, EMA, optimizer), the bytes it will write and the space free where it
    writes. Every rank reaches the same verdict from the same numbers. Returns the checkpoint's bytes.
    The space check assumes, as DCP's resume does, that every rank writes to one shared folder."""
    sections = ("model", "ema", "optimizer")
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
    bad = everyone[:, :3].sum(0).tolist()
    needed, free = int(everyone[:, 3].sum()), int(everyone[:, 4].min())
    latest = find_latest_quietly(root)
    if any(bad):
        which = ", ".join(f"{n} {name} tensor{'s' * (n > 1)}" for n, name in zip(bad, sections) if n)
        raise NonFiniteWeights(
            f"refusing to save step {step}: NaN or inf in {which}; nothing was written, and "
            f"the last good checkpoint is {latest or 'none (no checkpoint was written yet)'}"
        )
    margin = int(0.02 * needed) + (16 << 20)  # the trainer state, checksums and DCP's metadata
    if free < needed + margin:
        raise StorageError(
            f"not enough space to save step {step} in {root} ({_file_system(root)}): "
            f"{_size(free)} free, the checkpoint needs ~{_size(needed)}; nothing was written, and "
            f"{_intact(latest)}. Free space there, or lower train.keep_checkpoints (now {keep}: the "
            f"{keep} newest are kept, and a new one is written before the oldest is removed)"
        )
    return needed


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
    problem: tuple[int, str | None], root: Path, needed: int | None = None, training: bool = True
) -> str:
    """The `error:` text for a write the file system refused. `root`: the run's checkpoints/ folder (for
    a training run, the previous checkpoint is named and resuming advised); the file system named is
    the failing file's."""
    number, file = problem
    where = next((p for p in ([Path(file).parent] if file else []) + [root] if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    need = f", the checkpoint needs ~{_size(needed)}" if needed else ""
    message = f"{_STORAGE_ERRNOS[number]} {_file_system(where)} while writing {file or root}; {_size(free)} free{need}"
    if training:
        message += f"; {_intact(find_latest_quietly(root))}"
    if number in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there" + (" (or lower train.keep_checkpoints)" if training else "")
    else:
        fix = "make it writable, or write elsewhere (run.output_dir" + (")" if training else ", --output)")
    return f"{message}. {fix[0].upper()}{fix[1:]}, then run the same command" + (
        " to resume" if training else ""
    )


def _intact(latest: Path | None) -> str:
    return f"the previous checkpoint {latest} is intact" if latest else "no earlier checkpoint exists"


def find_latest_quietly(root: Path) -> Path | None:
    """The checkpoint `latest` names under a checkpoints/ folder, or None (also if it cannot be read)."""
    try:
        return find_latest(root.parent)
    except CheckpointError:
        return None


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


def _checksums(path: Path) -> dict | None:
    """{file name: {size, crc32}} as written, or None for a checkpoint older than checksums.json."""
    listing = path / CHECKSUMS
    if not listing.is_file():
        return None
    try:
        return json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {listing} cannot be read ({e}); {_fallback_hint(path)}"
        ) from None


def check_checkpoint_files(path) -> None:
    """Cheap checks from file sizes alone, made on every rank before any collective: every file that
    checksums.json lists (or, in a checkpoint written before it, that DCP's .metadata points into) is
    there and at least as long as it must be. The crc32s are read later, shared over the ranks
    (verify_checkpoint). A damaged checkpoint is a CheckpointError naming the file."""
    path = Path(path)
    files = _checksums(path)
    if files is not None:
        needed = {name: entry["size"] for name, entry in files.items()}
    else:
        needed = _sizes_from_metadata(path)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} is truncated ({file.stat().st_size} of at least {size} bytes)")
        elif files is not None and file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, {size} were written")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: {'; '.join(problems)}; "
            f"{_fallback_hint(path)}"
        )


def _sizes_from_metadata(path: Path) -> dict[str, int]:
    """{file: the bytes DCP's .metadata says it holds at least} (a checkpoint without checksums.json)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - a truncated or foreign .metadata
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: its .metadata cannot be read "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
            f"{_fallback_hint(path)}"
        ) from None
    sizes: dict[str, int] = {}
    for info in storage.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


def verify_checkpoint(path, group=None) -> None:
    """Check every file of a checkpoint against the sizes and crc32s recorded when it was written,
    before anything is loaded from it. With a process group, the files are split over its ranks (each
    read once, the largest first to the least loaded rank) and their findings all-reduced, so every
    rank reaches the same verdict; without one, this process checks them all. A damaged checkpoint
    is a CheckpointError naming the files and the previous complete checkpoint. Checkpoints written
    before checksums.json existed are not checked."""
    path = Path(path)
    files = _checksums(path)
    if files is None:  # written before checksums.json: the sizes DCP's metadata implies, at least
        check_checkpoint_files(path)
        return
    names = sorted(files)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    load = [0] * world
    found = torch.zeros(
        len(names), 3, dtype=torch.int64
    )  # per file: checked by a rank, size (-1: missing), crc32
    for i in sorted(range(len(names)), key=lambda i: (-files[names[i]]["size"], names[i])):
        owner = min(range(world), key=lambda r: load[r])
        load[owner] += files[names[i]]["size"]
        if owner != rank:
            continue
        file = path / names[i]
        if not file.is_file():
            found[i] = torch.tensor([1, -1, 0])
        elif file.stat().st_size != files[names[i]]["size"]:
            found[i] = torch.tensor([1, file.stat().st_size, 0])
        else:
            found[i] = torch.tensor([1, *_size_and_crc(file)])
    if group is not None:
        comm.all_reduce(found, group=group)
    problems = []
    for name, (_, size, crc) in zip(names, found.tolist()):
        written = files[name]
        if size < 0:
            problems.append(f"{name} is missing")
        elif size < written["size"]:
            problems.append(f"{name} is truncated ({size} of the {written['size']} bytes written)")
        elif size != written["size"]:
            problems.append(f"{name} has {size} bytes, {written['size']} were written")
        elif crc != written["crc32"]:
            problems.append(f"{name} is corrupt (crc32 {crc:08x}, {written['crc32']:08x} when written)")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: {'; '.join(problems)}; "
            f"{_fallback_hint(path)}"
        )


def _load(state: dict, path: Path, group=None) -> None:
    try:
        with comm.recorded("checkpoint_load", group, None):  # DCP's own collectives run inside
            dcp.load(state, checkpoint_id=path, process_group=group)
    except CheckpointException as e:  # DCP's planning errors (missing keys, size mismatches); a BaseException
        raise CheckpointError(
            f"{path} does not fit this model ({_first_failure(e)}); was it written "
            f"with another model.size, model.patch_size, model.adaln/ffn_dim/qk_norm_across_heads/pooled_text, "
            f"VAE or text encoder? Use the recipe it was "
            f"trained with, or train.resume=none"
        ) from e


def _first_failure(error: CheckpointException) -> str:
    """'KeyError: ...' of the first rank's failure inside a DCP exception, without DCP's tracebacks."""
    for exc, _ in error.failures.values():
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
    return str(error.args[0])[:300] if error.args else type(error).__name__


def read_trainer_state(path) -> dict:
    """The step and data position of a checkpoint, read from files alone: every rank reads the same
    file, so a resume that cannot continue (another dp size, other data) fails on all ranks alike,
    before any process group, model or collective."""
    trainer_file = Path(path) / "trainer_rank0.pt"
    if not trainer_file.is_file():
        raise CheckpointError(
            f"{path} has no trainer_rank0.pt (the step and data position); it is not a complete "
            f"tessera training checkpoint: pick another or start fresh with train.resume=none"
        )
    written = (_checksums(Path(path)) or {}).get(trainer_file.name)
    if written is not None and _size_and_crc(trainer_file) != (written["size"], written["crc32"]):
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: {trainer_file.name} is not "
            f"the file written at save (its size or crc32 differ); {_fallback_hint(path)}"
        )
    try:
        return torch.load(trainer_file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a checkpoint from before checksums.json, damaged
        raise CheckpointError(
            f"{trainer_file} cannot be read ({type(e).__name__}: {e}); {_fallback_hint(path)}"
        ) from e


def check_architecture(path, architecture: dict) -> None:
    """Refuse a checkpoint trained with another DiT (DiT.architecture(), recorded at save). Loading catches
    differences of shape; this also catches the options that hold no weight (model.absolute_positions,
    model.text_mask, model.rope_theta), which would load silently and sample nonsense. Checkpoints from
    before the architecture was recorded are not checked, nor entries added to it since."""
    saved = read_trainer_state(path).get("architecture")
    if saved is None:
        return
    from models.dit import architecture_differences, recipe_key

    differs = [
        f"{recipe_key(k)}: {k}={saved[k]!r} there, {architecture[k]!r} here"
        for k in architecture_differences(architecture, saved)
    ]
    if differs:
        raise CheckpointError(
            f"checkpoint {path} was trained with another model: {'; '.join(differs)}. Use the recipe "
            f"it was trained with (its run's config.yaml), or set these keys to match"
        )


def load_checkpoint(runtime, path, model, ema, optimizer, verified: bool = False) -> None:
    """Restore model, EMA and optimizer in place (resharded by DCP to this run's layout), once every
    file of the checkpoint has been checked (by all ranks together; `verified`: done already)."""
    if not verified:
        verify_checkpoint(path, runtime.control_group)
    state = {
        "model": get_model_state_dict(model),
        "ema": get_model_state_dict(ema),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    _on_io_group(runtime.control_group, lambda group: _load(state, Path(path), group))
    set_model_state_dict(model, state["model"])
    set_model_state_dict(ema, state["ema"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_weights(path, model, use_ema: bool = True) -> None:
    """Load the (EMA) weights of a training checkpoint into an unsharded model, e.g. for sampling."""
    verify_checkpoint(path)  # every file, here: this process has no group to share the reading with
    key = "ema" if use_ema else "model"
    state = {key: model.state_dict()}
    _load(state, Path(path))
    model.load_state_dict(state[key])
