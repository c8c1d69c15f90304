"""A checkpoint folder on disk: the step_<N> folders and the `latest` pointer, files written durably and
sealed with their sizes and crc32s (checksums.json), and the checks that refuse a damaged checkpoint
by name, with the previous one suggested, before anything is read from it.
"""

import errno
import functools
import json
import os
import re
import shutil
import zlib
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist

from parallel import comm

CHECKSUMS = "checksums.json"
_POINTER = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    pass


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that names a class or function no tessera checkpoint holds: unpickling it could
    run code, so nothing is read from it."""


def untrusted(path, file: str, what: str) -> str:
    """The refusal of a checkpoint file that names `what` (a class or function)."""
    return (
        f"checkpoint {path} was not loaded: {file} names {what}, which no tessera checkpoint holds; "
        f"unpickling it could run code. Load only checkpoints you wrote or trust; shared weights are "
        f"safest as the safetensors folder scripts/export.py writes (model.pretrained reads it)"
    )


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
                f"now). Run the same command again to read the newest, or name a checkpoint that stays"
            )
            error.rotated = True
            raise error from None

    return reading


def rotated_away(path) -> bool:
    """Whether the step folder `path` is gone while its checkpoints/ folder is still there."""
    path = Path(path)
    return not path.exists() and path.parent.is_dir()


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_of(path: Path) -> int | None:
    """N of a step_<N> folder (or of the hidden .step_<N>.old copy a killed re-save leaves)."""
    match = re.fullmatch(r"\.?step_(\d+)(\.old)?", path.name)
    return int(match.group(1)) if match else None


def _is_complete(path: Path) -> bool:
    """A step folder that DCP finished (.metadata) and whose checksums.json lists every file it holds (a
    file it does not list was written by another run, or added since: such a folder is not one run's
    checkpoint). A folder written before checksums.json existed counts by its .metadata alone."""
    return (path / ".metadata").is_file() and not unlisted_files(path)


def unlisted_files(path: Path) -> list[str]:
    """The files of a step folder that its checksums.json does not list (none for a folder without a
    readable one: verification names a damaged listing itself). NFS's .nfs* placeholders are not files of
    the checkpoint."""
    try:
        listed = set(json.loads((path / CHECKSUMS).read_text())["files"])
        present = [p.name for p in path.iterdir()]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(n for n in present if n not in listed and n != CHECKSUMS and not n.startswith(".nfs"))


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


def _fallback_hint(path, which: str = "previous") -> str:
    """Where to go on from instead of `path`: the newest complete step_<N> beside it and older than it
    (for a `latest` pointer, which has no step, the newest of all: `which` says so)."""
    previous = previous_checkpoint(path)
    if previous is None:
        return "no other complete checkpoint is left beside it: start fresh with train.resume=none"
    return (
        f"the {which} complete checkpoint is {previous}: resume from it with train.resume={previous} "
        f"(infer.py --checkpoint {previous})"
    )


def _follow(pointer: Path) -> Path:
    """The step folder a `latest` pointer file names. A pointer that cannot be read or holds something
    else is refused with the newest complete step_<N> beside it (a pointer is not a step: every one is
    a candidate)."""
    try:
        name = pointer.read_text(errors="replace").strip() if pointer.stat().st_size < 1024 else ""
    except OSError as e:
        raise CheckpointError(f"cannot read {pointer}: {e}; {_fallback_hint(pointer, 'newest')}") from None
    if not _POINTER.fullmatch(name):
        raise CheckpointError(
            f"{pointer} is not a tessera `latest` pointer (a file holding one line, step_<N>); "
            f"{_fallback_hint(pointer, 'newest')}"
        )
    path = pointer.parent / name
    if _is_complete(path):
        return path
    # A re-save of step N killed between moving the old step_N aside and renaming the new one in:
    # the old copy is still complete, under the name the save gave it.
    replaced = pointer.parent / f".{name}.old"
    if _is_complete(replaced):
        return replaced
    if (path / ".metadata").is_file():
        raise CheckpointError(f"{pointer} names {name}: {_mixed(path)}")
    raise CheckpointError(f"{pointer} names {name}, which is missing or incomplete; {_fallback_hint(path)}")


def _mixed(path: Path) -> str:
    files = unlisted_files(path)
    named = ", ".join(files[:4]) + (", ..." if len(files) > 4 else "")
    return (
        f"checkpoint {path} holds files its {CHECKSUMS} does not list ({named}): it is not one run's "
        f"complete checkpoint (two runs wrote into it, or files were added since), so nothing is loaded "
        f"from it; {_fallback_hint(path)}"
    )


def find_latest(run_dir) -> Path | None:
    pointer = checkpoint_dir(run_dir) / "latest"
    return _follow(pointer) if pointer.is_file() else None


def find_latest_quietly(root: Path) -> Path | None:
    """The checkpoint `latest` names under a checkpoints/ folder, or None (also if it cannot be read)."""
    try:
        return find_latest(root.parent)
    except CheckpointError:
        return None


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
    if (path / ".metadata").is_file():  # DCP's metadata, with files the checkpoint's listing does not hold
        raise CheckpointError(_mixed(path))
    for pointer in (path / "latest", checkpoint_dir(path) / "latest"):
        if pointer.is_file():
            return _follow(pointer)
    raise CheckpointError(
        f"checkpoint '{spec}' is not a complete tessera checkpoint folder (no .metadata in it), nor "
        f"a `latest` pointer, a checkpoints/ folder or a run directory with one"
    )


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


def _merge_checksums(folder: Path, world_size: int, run: str | None = None) -> None:
    """Rank 0: one checksums.json from every rank's part; a file no rank claimed is hashed here. `run`:
    the token of the run directory's lock (configs/runlock.py), which says which run wrote it."""
    files = {}
    for rank in range(world_size):
        part = folder / f".checksums_rank{rank}.json"
        files.update(json.loads(part.read_text()))
        part.unlink()
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in files:
            files[p.name] = dict(zip(("size", "crc32"), _size_and_crc(p, sync=True)))
    listing = {"format": 1, "files": files} | ({"run": run} if run else {})
    _write_durably(folder / CHECKSUMS, json.dumps(listing, indent=1, sort_keys=True))
    _fsync_dir(folder)


def _clear(path: Path) -> None:
    """Remove a step folder so that it vanishes at once (renamed hidden first): a kill mid-way leaves
    no half-deleted step_<N> that still looks complete."""
    hidden = path.with_name(f".{path.name}.deleted")
    shutil.rmtree(hidden, ignore_errors=True)
    path.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


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
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: {'; '.join(problems)}; "
            f"{_fallback_hint(path)}"
        )
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
            raise UnsafeCheckpoint(
                untrusted(path, entry.name, f"a symbolic link to {entry.resolve()}, outside the checkpoint")
            )


def _within(target: Path, folder: Path) -> bool:
    return target == folder or folder in target.parents


def _check_metadata(path: Path, written: dict | None) -> None:
    """Read .metadata as read_metadata does, before DCP ever sees it (a file that names code is refused
    here, by name); its crc32 first (it is small), so that a damaged file is called damaged."""
    if written is not None and _size_and_crc(path / ".metadata") != (written["size"], written["crc32"]):
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: .metadata is corrupt (its crc32 "
            f"is not the one written); {_fallback_hint(path)}"
        )
    read_metadata(path)


@rotation_aware
def read_metadata(path, file=None):
    """DCP's metadata of the checkpoint folder `path` (its .metadata, or `file`), read without running code
    or changing anything in the process (parallel/dcp_metadata.py): a file that names anything but DCP's
    metadata classes, or sets attributes on them, is an UnsafeCheckpoint naming the file and what it did;
    one that is not DCP's metadata (another structure, a file it points into outside the folder) is
    refused by name as well."""
    from torch.distributed.checkpoint.metadata import Metadata

    from parallel import dcp_metadata

    file = Path(file) if file is not None else Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = dcp_metadata.load(f)
    except dcp_metadata.Forbidden as e:
        raise UnsafeCheckpoint(untrusted(path, file.name, str(e))) from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign .metadata
        text = str(e).splitlines()[0][:200] if str(e) else ""
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: its {file.name} cannot be read "
            f"({type(e).__name__}: {text}); {_fallback_hint(path)}"
        ) from None
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

    storage, tensors = metadata.storage_data, metadata.state_dict_metadata
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
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: its {name} is not DCP's metadata "
            f"({problem}); {_fallback_hint(path)}"
        )
    folder = Path(path).resolve()
    for relative in {info.relative_path for info in storage.values()}:
        target = (folder / relative).resolve()
        if (
            not relative
            or PurePosixPath(relative).is_absolute()
            or not _within(target, folder)
            or target == folder
        ):
            outside = f"a file outside the checkpoint ({relative!r})"
            raise UnsafeCheckpoint(untrusted(path, name, outside))


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
        raise CheckpointError(
            f"checkpoint {path} is damaged, nothing was loaded from it: {'; '.join(problems)}; "
            f"{_fallback_hint(path)}"
        )


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


def newest_in_range(complete: list) -> Path | None:
    """The newest of `complete` (step folders, oldest first) saved with its loss and weights in range (its
    trainer state's `health`, parallel/divergence.py; one without the record counts as in range): kept by
    the rotation however many out-of-range saves follow it."""
    for path in reversed(complete):
        try:
            if (read_trainer_state(path).get("health") or {}).get("in_range", True):
                return path
        except CheckpointError:  # damaged: no use to anyone
            continue
    return None


def find_checkpoint(cfg, checkpoint: str | None, random_weights: bool):
    """The checkpoint to sample: --checkpoint (a run or a step), else the recipe's run.output_dir's latest;
    None for random weights, or model.pretrained as it is when no run was named or found."""
    if random_weights:
        return None
    found = resolve_checkpoint(checkpoint or "auto", cfg.run.output_dir)
    if found is None and checkpoint in (None, "none") and cfg.model.pretrained:
        return None  # sample from the pretrained weights themselves
    if found is None:
        raise CheckpointError(
            f"no checkpoint found in {Path(cfg.run.output_dir) / 'checkpoints'}: train first "
            f"(train.py with the same recipe), pass --checkpoint, or use --random-weights"
        )
    return found
