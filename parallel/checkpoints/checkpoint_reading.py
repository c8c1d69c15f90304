"""Reading a checkpoint folder safely: every file checked against what was written (sizes and crc32s,
split over the ranks), one run's (none unlisted, none a link out of the folder), DCP's .metadata read
without running code (parallel/checkpoints/dcp_metadata.py), the trainer state read, and a folder that
vanished while it was read (a live run's rotation) named as such. parallel/checkpoints/checkpoint_files.py
holds the folder's layout.
"""

import functools
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist

from parallel.checkpoints.checkpoint_files import (
    CheckpointError,
    UnsafeCheckpoint,
    _checksums,
    _damaged,
    _fallback_hint,
    _mixed,
    _size_and_crc,
    outside,
    unlisted_files,
    untrusted,
)
from parallel.compute import comm


def rotation_aware(read):
    """`read(path, ...)` of a checkpoint folder, whose failure, when the folder no longer exists meanwhile,
    says so: the run that writes it rotated it away (train.keep_checkpoints) while it was read. Reading a
    live run (infer.py on its `latest`, a LoRA on a base still training) meets this; bf7d40d called such a
    checkpoint incomplete and advised train.resume=none."""

    @functools.wraps(read)
    def reading(path, *args, **kwargs):
        try:
            return read(path, *args, **kwargs)
        except (CheckpointError, OSError) as e:
            if not rotated_away(path) or getattr(e, "rotated", False):
                raise
            error = CheckpointError(
                f"checkpoint {path} was removed while it was read: the run writing {Path(path).parent} keeps "
                f"its newest train.keep_checkpoints and rotated this one away (a newer one is its `latest` "
                "now). Run the same command again to read the newest; a run that saves every few seconds may "
                "rotate each one away before it is read: copy a step_<N> folder elsewhere and name the copy"
            )
            error.rotated = True
            raise error from None

    return reading


def rotated_away(path) -> bool:
    """Whether the step folder `path` is gone while its checkpoints/ folder is still there."""
    path = Path(path)
    return not path.exists() and path.parent.is_dir()


@rotation_aware
def check_checkpoint_files(path) -> None:
    """Cheap checks from file sizes alone, made on every rank before any collective: every file that
    checksums.json lists (or, in a checkpoint written before it, that DCP's .metadata points into) is
    there and at least as long as it must be; and DCP's .metadata is read without running code
    (read_metadata). The crc32s are read later, shared over the ranks (verify_checkpoint). A damaged
    checkpoint is a CheckpointError naming the file, one that names code an UnsafeCheckpoint."""
    path = Path(path)
    check_inside(path)
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
        raise _damaged(path, "; ".join(problems))
    if files is not None:  # (without checksums.json, _sizes_from_metadata has read it)
        _check_metadata(path, files.get(".metadata"))


def check_inside(path: Path) -> None:
    """Every file of the checkpoint is one run's and lies inside its folder: none that checksums.json does
    not list, no symbolic link leading out of it."""
    if unlisted_files(path):
        raise CheckpointError(_mixed(path))
    try:
        entries = list(path.iterdir())
    except OSError:
        return  # a missing folder: named where its files are looked for
    for entry in entries:
        if entry.is_symlink() and not _within(entry.resolve(), path.resolve()):
            raise UnsafeCheckpoint(outside(path, entry.name, f"is a symbolic link to {entry.resolve()}"))


def _within(target: Path, folder: Path) -> bool:
    return target == folder or folder in target.parents


def _check_metadata(path: Path, written: dict | None) -> None:
    """Read .metadata as read_metadata does, before DCP ever sees it (a file that names code is refused
    here, by name); its crc32 first (it is small), so that a damaged file is called damaged."""
    if written is not None and _size_and_crc(path / ".metadata") != (written["size"], written["crc32"]):
        raise _damaged(path, ".metadata is corrupt (its crc32 is not the one written)")
    read_metadata(path)


@rotation_aware
def read_metadata(path, file=None):
    """DCP's metadata of the checkpoint folder `path` (its .metadata, or `file`), read without running code
    or changing anything in the process (parallel/checkpoints/dcp_metadata.py): a file that names anything but
    DCP's metadata classes, or sets attributes on them, is an UnsafeCheckpoint naming the file and what it
    did; one that is not DCP's metadata (another structure, a file it points into outside the folder) is
    refused by name as well."""
    from torch.distributed.checkpoint.metadata import Metadata

    from parallel.checkpoints import dcp_metadata

    file = Path(file) if file is not None else Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = dcp_metadata.load(f)
    except dcp_metadata.Forbidden as e:
        raise UnsafeCheckpoint(untrusted(path, file.name, str(e))) from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign .metadata
        text = str(e).splitlines()[0][:200] if str(e) else ""
        raise _damaged(path, f"its {file.name} cannot be read ({type(e).__name__}: {text})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {path}: its {file.name} holds a {type(metadata).__name__}, not DCP's metadata; "
            f"it is not a tessera checkpoint: {_fallback_hint(path)}"
        )
    _check_structure(path, file.name, metadata)
    return metadata


def _check_structure(path, name: str, metadata) -> None:
    """DCP's metadata as DCP writes it: a dict of tensors and byte items, and a dict of storage entries each
    naming a file inside the folder (its path resolved there, symbolic links followed)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = getattr(metadata, "storage_data", None)  # a Metadata built without them is no metadata
    tensors = getattr(metadata, "state_dict_metadata", None)
    problem = None
    if not isinstance(tensors, dict):
        problem = f"its state_dict_metadata is a {type(tensors).__name__}, not a dict"
    elif not isinstance(storage, dict):
        problem = f"its storage_data is a {type(storage).__name__}, not a dict"
    else:
        for key, info in storage.items():
            fields = (
                getattr(info, "relative_path", None),
                getattr(info, "offset", None),
                getattr(info, "length", None),
            )
            if not (isinstance(key, MetadataIndex) and isinstance(info, _StorageInfo)):
                problem = f"a storage entry is a {type(info).__name__} under a {type(key).__name__}"
            elif not (isinstance(fields[0], str) and all(type(n) is int and n >= 0 for n in fields[1:])):
                problem = f"the storage entry of {key.fqn} is not a file, offset and length"
            if problem:
                break
    if problem:
        raise _damaged(path, f"its {name} is not DCP's metadata ({problem})")
    folder = Path(path).resolve()
    for relative in {info.relative_path for info in storage.values()}:
        target = (folder / relative).resolve()
        if (
            not relative
            or PurePosixPath(relative).is_absolute()
            or not _within(target, folder)
            or target == folder
        ):
            raise UnsafeCheckpoint(outside(path, name, f"names the file {relative!r}"))


def _sizes_from_metadata(path: Path) -> dict[str, int]:
    """{file: the bytes DCP's .metadata says it holds at least} (a checkpoint without checksums.json)."""
    storage = read_metadata(path).storage_data
    sizes: dict[str, int] = {}
    for info in storage.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


@rotation_aware
def verify_checkpoint(path, group=None) -> None:
    """Check every file of a checkpoint against the sizes and crc32s recorded when it was written,
    before anything is loaded from it. With a process group, the files are split over its ranks (each
    read once, the largest first to the least loaded rank) and their findings all-reduced, so every
    rank reaches the same verdict; without one, this process checks them all. A damaged checkpoint
    is a CheckpointError naming the files and the previous complete checkpoint. Checkpoints written
    before checksums.json existed are not checked."""
    path = Path(path)
    check_inside(path)
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
        raise _damaged(path, "; ".join(problems))


@rotation_aware
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
        raise _damaged(path, "trainer_rank0.pt is not the file written at save (its size or crc32 differ)")
    try:
        return torch.load(trainer_file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a checkpoint from before checksums.json, damaged
        raise CheckpointError(
            f"{trainer_file} cannot be read ({type(e).__name__}: {e}); {_fallback_hint(path)}"
        ) from e


def newest_in_range(complete: list) -> Path | None:
    """The newest of `complete` (step folders, oldest first) saved with its loss and weights in range (its
    trainer state's `health`, parallel/lifecycle/divergence.py; one without the record counts as in range):
    kept by the rotation however many out-of-range saves follow it."""
    for path in reversed(complete):
        try:
            if (read_trainer_state(path).get("health") or {}).get("in_range", True):
                return path
        except CheckpointError:  # damaged: no use to anyone
            continue
    return None
