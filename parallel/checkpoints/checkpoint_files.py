"""A checkpoint folder on disk: the step_<N> folders and the `latest` pointer, files written durably and
sealed with their sizes and crc32s (checksums.json), DCP's writes watched as they go (WatchedFileSystem),
and the names and hints of the errors that refuse a damaged checkpoint
(parallel/checkpoints/checkpoint_reading.py reads one).
"""

import contextlib
import errno
import io
import json
import os
import re
import shutil
import zlib
from pathlib import Path

CHECKSUMS = "checksums.json"
_POINTER = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    pass


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that names a class or function no tessera checkpoint holds: unpickling it could
    run code, so nothing is read from it."""


def outside(path, file: str, what: str) -> str:
    """The refusal of a checkpoint whose `file` reads `what`, outside its folder."""
    return (
        f"checkpoint {path} was not loaded: {file} {what}, outside the checkpoint; a checkpoint reads its "
        "own files only (this one was moved together from elsewhere, or made to read other files). Copy the "
        "files into its folder if you trust them"
    )


def untrusted(path, file: str, what: str) -> str:
    """The refusal of a checkpoint file that names `what` (a class or function)."""
    return (
        f"checkpoint {path} was not loaded: {file} names {what}, which no tessera checkpoint holds; "
        f"unpickling it could run code. Load only checkpoints you wrote or trust; shared weights are "
        f"safest as the safetensors folder scripts/export.py writes (model.pretrained reads it)"
    )


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


def _damaged(path, what: str) -> CheckpointError:
    """The error refusing the damaged checkpoint `path`, `what` naming the damage."""
    hint = _fallback_hint(path)
    return CheckpointError(f"checkpoint {path} is damaged, nothing was loaded from it: {what}; {hint}")


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


def find_checkpoint(cfg, checkpoint: str | None, random_weights: bool):
    """The checkpoint to sample: --checkpoint (a run or a step), else the recipe's run.output_dir's latest;
    None for random weights, or model.pretrained as it is when no run was named or found."""
    if random_weights:
        return None
    found = resolve_checkpoint(checkpoint or "auto", cfg.run.output_dir)
    if found is None and checkpoint is None and cfg.model.pretrained and cfg.lora.rank:
        raise CheckpointError(  # a LoRA recipe's run not found: the bare base would pass for it
            f"no checkpoint found in {Path(cfg.run.output_dir) / 'checkpoints'}, the run of this LoRA "
            "recipe: train first (train.py with the same recipe, from the same folder), name the run with "
            "--checkpoint, or sample model.pretrained as it is with --checkpoint none"
        )
    if found is None and checkpoint in (None, "none") and cfg.model.pretrained:
        return None  # sample from the pretrained weights themselves
    if found is None:
        raise CheckpointError(
            f"no checkpoint found in {Path(cfg.run.output_dir) / 'checkpoints'}: train first "
            f"(train.py with the same recipe), pass --checkpoint, or use --random-weights"
        )
    return found


class WatchedFileSystem:
    """DCP's file system with `opened(path)` called before a file is opened for writing and `wrote(path,
    size)` before each write to it: the save's guard (_guarded) and the tests' full disk
    (parallel/lifecycle/faults.py). Everything else is DCP's file system's."""

    def __init__(self, fs, opened, wrote):
        self._fs, self._opened, self._wrote = fs, opened, wrote

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            self._opened(path)
        with self._fs.create_stream(path, mode) as stream:
            yield _WatchedStream(stream, lambda size: self._wrote(path, size)) if "w" in mode else stream

    def __getattr__(self, name):
        return getattr(self._fs, name)


class _WatchedStream(io.RawIOBase):
    def __init__(self, stream, wrote):
        super().__init__()
        self.stream, self.wrote = stream, wrote

    def writable(self):
        return True

    def write(self, data):
        self.wrote(len(data))
        return self.stream.write(data)

    def tell(self):
        return self.stream.tell()

    def flush(self):
        self.stream.flush()

    def fileno(self):
        return self.stream.fileno()
