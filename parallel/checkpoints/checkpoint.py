"""Distributed checkpoints that never lose work: save and load.

Each rank writes its shards into a hidden temporary folder and seals them (sizes and crc32s,
parallel/checkpoints/checkpoint_files.py); when every rank is done rank 0 renames it to step_<N> and moves
`latest`. A kill at any point leaves `latest` naming a complete checkpoint. A save is refused
before a byte is written when the weights are not finite or the disk cannot hold it
(parallel/lifecycle/storage.py); a load checks every file first. DCP's planning runs on a short-lived gloo
group (docs/internals.md: long-lived gloo threads slowed training by 30-70%).
"""

import contextlib
import datetime
import functools
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from configs.runlock import RunDirectoryInUse
from parallel.checkpoints.checkpoint_files import (
    CheckpointError,
    UnsafeCheckpoint,
    WatchedFileSystem,
    _clear,
    _fsync_dir,
    _is_complete,
    _merge_checksums,
    _seal,
    _step_of,
    _write_durably,
    checkpoint_dir,
    untrusted,
)
from parallel.checkpoints.checkpoint_reading import (
    check_inside,
    newest_in_range,
    read_metadata,
    rotation_aware,
    verify_checkpoint,
)
from parallel.compute import comm
from parallel.lifecycle.storage import StorageError, check_before_save, storage_message, storage_problem

# The points of a save where the failure tests kill a process (TESSERA_FAULT=save_<point>,
# parallel/lifecycle/faults.py):
# before_shards (the temporary folder made, nothing written), after_shards (every rank's files written
# and checksummed, not yet renamed), after_rename (step_<N> in place, `latest` not yet moved).
FAULT_POINTS = ("before_shards", "after_shards", "after_rename")


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


class TrainingState:
    """What a checkpoint holds of a full fine-tuning: the model, its EMA and AdamW's state (sharded DTensors;
    DCP reshards them to the layout that loads them). parallel/build/lora.py's LoRAState holds the adapters
    only. `critic`: a distillation's full critic (its model, its AdamW), kept beside the student."""

    def __init__(self, model, ema, optimizer, critic: tuple | None = None):
        self.model, self.ema, self.optimizer, self.critic = model, ema, optimizer, critic

    def state_dict(self) -> dict:
        state = {
            "model": get_model_state_dict(self.model),
            "ema": get_model_state_dict(self.ema),
            "optimizer": optimizer_state_dict(self.model, self.optimizer),
        }
        if self.critic is not None:
            critic, optimizer = self.critic
            state["critic"] = get_model_state_dict(critic)
            state["critic_optimizer"] = optimizer_state_dict(critic, optimizer)
        return state

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])
        set_model_state_dict(self.ema, state["ema"])
        set_optimizer_state(self.model, self.optimizer, state["optimizer"])
        if self.critic is not None:
            critic, optimizer = self.critic
            set_model_state_dict(critic, state["critic"])
            set_optimizer_state(critic, optimizer, state["critic_optimizer"])


def set_optimizer_state(model, optimizer, state: dict) -> None:
    """set_optimizer_state_dict, keeping the optimizer's implementation (fused, foreach, capturable): the
    checkpoint's param_groups carry the one it was saved with, so a run saved with the foreach AdamW would
    stay on it for good. A fused group's `step` lives on its parameter's device, in float32."""
    kept = [{k: group.get(k) for k in ("fused", "foreach", "capturable")} for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state)
    for group, implementation in zip(optimizer.param_groups, kept, strict=True):
        group.update(implementation)
        for p in group["params"] if group.get("fused") else ():
            entry = optimizer.state.get(p, {})
            if "step" in entry:
                entry["step"] = entry["step"].to(device=p.device, dtype=torch.float32)


@torch.no_grad()
def optimizer_state_dict(model, optimizer) -> dict:
    """AdamW's state with an entry for every parameter: one no gradient has reached yet (Qwen-Image's last
    block's text layers feed no output) gets the state AdamW itself would create at its first gradient
    (step 0, zero moments), as a resume's optimizer expects every entry. AdamW skips it while its gradient
    is None, as it skips a parameter without state: the steps are the same."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # torch keeps `step` beside the weight
        for p in group["params"]:
            if not optimizer.state.get(p):
                device = p.device if on_device else "cpu"
                state = {"step": torch.zeros((), dtype=torch.float32, device=device)}
                moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
                state.update({k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in moments})
                optimizer.state[p] = state
    return get_optimizer_state_dict(model, optimizer)


def save_checkpoint(
    runtime, run_dir, step: int, training: TrainingState, trainer_state: dict, keep: int
) -> Path:
    """Write step_<N> and move `latest` to it (see the module docstring). Refused before a byte is written,
    alike on every rank: weights that are not finite (NonFiniteWeights) and a checkpoint larger than the
    free space (StorageError). A file system that fails during the save (full, over quota, read-only) is a
    StorageError naming it, the file and the previous checkpoint, which stays `latest`.

    A run that another run took the directory over from (configs/runlock.py) abandons the save: its
    temporary folder carries its lock's token (two runs never write into one), and the rename, `latest`
    and the rotation each happen only after rank 0 found the lock still its own."""
    root = checkpoint_dir(run_dir)
    token = getattr(runtime, "lock_token", None)
    final = root / f"step_{step}"
    tmp = root / (f".step_{step}.{token[:12]}.tmp" if token else f".step_{step}.tmp")
    state = training.state_dict()
    if runtime.is_main:  # what killed or failed saves left: never named by `latest`, and it takes space
        _ensure_directory(runtime)
        for pattern in (".step_*.tmp", ".step_*.deleted"):
            for leftover in root.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    runtime.fence()  # every rank measures the free space after the clean-up
    needed = None
    try:
        needed = check_before_save(runtime, state, root, step, keep)
        _write(runtime, state, root, final, tmp, step, trainer_state, keep)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, RunDirectoryInUse) or not _holds_directory(runtime):
            # taken over meanwhile: the folder is the other run's now; this one touches nothing more there
            raise _lost(runtime, e) from None
        if runtime.is_main and isinstance(e, (CheckpointError, CheckpointException)):
            # a refusal or a DCP failure, which every rank shares: give the space back (`latest` still names
            # the previous checkpoint). A failure of one rank's own files leaves the folder to the next
            # save's clean-up: the other ranks may still be reading theirs back.
            shutil.rmtree(tmp, ignore_errors=True)
        problem = storage_problem(e, root) if not isinstance(e, CheckpointError) else None
        if problem is None:
            raise
        raise StorageError(storage_message(problem, root, needed, keep=keep)) from None
    return final


def _ensure_directory(runtime) -> None:
    """Raise RunDirectoryInUse if the run lost its directory (Runtime.ensure_directory; a runtime made by a
    test without it never loses one)."""
    ensure = getattr(runtime, "ensure_directory", None)
    if ensure is not None:
        ensure()


def _holds_directory(runtime) -> bool:
    holds = getattr(runtime, "holds_directory", None)
    return holds is None or holds()


def _lost(runtime, error: BaseException) -> RunDirectoryInUse:
    if isinstance(error, RunDirectoryInUse):
        return error
    try:
        _ensure_directory(runtime)
    except RunDirectoryInUse as lost:
        return lost
    return RunDirectoryInUse("this run lost its run directory to another run during a save; it stops")


def _write(
    runtime, state, root: Path, final: Path, tmp: Path, step: int, trainer_state: dict, keep: int
) -> None:
    runtime.faults.at_save("before_shards", step)
    writer = _guarded(runtime, runtime.faults.full_disk_writer(tmp, step) or FileSystemWriter(tmp))
    # gloo, long timeout (I/O is slow), on a group of its own (see the docstring); DCP's collectives run
    # inside
    with comm.recorded("checkpoint_save", runtime.control_group, None):
        _on_io_group(
            runtime.control_group,
            lambda group: dcp.save(state, checkpoint_id=tmp, process_group=group, storage_writer=writer),
        )
    _ensure_directory(runtime)  # the rest of the save, too, only while the directory is this run's
    torch.save(trainer_state, tmp / f"trainer_rank{runtime.rank}.pt")
    _ensure_directory(runtime)
    _seal(tmp, runtime.rank)
    runtime.fence()
    if runtime.is_main:
        _merge_checksums(tmp, runtime.world_size, getattr(runtime, "lock_token", None))
    runtime.faults.at_save("after_shards", step)
    if runtime.is_main:
        _put_in_place(runtime, root, final, tmp, step, keep)
    runtime.fence()


def _put_in_place(runtime, root: Path, final: Path, tmp: Path, step: int, keep: int) -> None:
    """Rank 0: rename the sealed folder to step_<N>, move `latest` to it, rotate the old ones; each change
    only while the run directory is still this run's (`held()`, checked just before it)."""
    held = functools.partial(_ensure_directory, runtime)
    replaced = root / f".step_{step}.old"  # re-saving a step: keep the old copy until the new one is in place
    held()
    if final.exists():  # (without step_<N>, `latest` may resolve to a .old left by a killed re-save: keep it)
        shutil.rmtree(replaced, ignore_errors=True)
        held()
        final.rename(replaced)
    held()
    tmp.rename(final)
    _fsync_dir(root)
    runtime.faults.at_save("after_rename", step)
    token = getattr(runtime, "lock_token", None)
    pointer_tmp = root / (f"latest.{token[:12]}.tmp" if token else "latest.tmp")  # one per run, too
    _write_durably(pointer_tmp, final.name + "\n")
    held()
    pointer_tmp.replace(root / "latest")
    _fsync_dir(root)
    # `latest` has moved: what killed saves left behind is no longer needed by anyone.
    for pattern in (".step_*.tmp", ".step_*.old", ".step_*.deleted"):
        for leftover in root.glob(pattern):
            held()
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob("latest.*.tmp"):
        leftover.unlink(missing_ok=True)
    complete = sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)
    kept = {final, newest_in_range(complete)}  # a divergence's advice must find a good one left
    for old in complete[:-keep]:
        if old not in kept:
            held()
            _clear(old)


def _guarded(runtime, writer):
    """`writer` (DCP's FileSystemWriter) asking Runtime.ensure_directory before it opens each file and every
    CHECK_BYTES it writes: DCP writes one file per rank, gigabytes of it, and a run woken in the middle of
    one stops there, not after filling a directory that is another run's now (whose free-space check did
    not count it)."""
    ensure = getattr(runtime, "ensure_directory", None)
    if ensure is None:
        return writer
    since = [0]

    def wrote(file, size: int) -> None:
        since[0] += size
        if since[0] >= CHECK_BYTES:
            ensure()
            since[0] = 0

    writer.fs = WatchedFileSystem(writer.fs, lambda file: ensure(), wrote)
    return writer


CHECK_BYTES = 256 << 20


class _SafeReader(FileSystemReader):
    """DCP's file reader, with .metadata read by checkpoint_reading.read_metadata: DCP's own unpickles it with
    a plain pickle.load, which calls whatever a crafted file names. `refused`: its refusal, which DCP
    reports only as text (and then tries __<rank>.metadata, refused too)."""

    refused: UnsafeCheckpoint | None = None

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self.known = metadata  # read (and checked) by _load already: not read a second time

    def read_metadata(self, *args, **kwargs):
        if self.refused is not None:
            raise self.refused
        rank = kwargs.get("rank")  # DCP's per-rank metadata, when it has no global one
        file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            metadata = (
                self.known if rank is None and self.known is not None else read_metadata(self.path, file)
            )
        except UnsafeCheckpoint as e:
            self.refused = e
            raise
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with the items that are not tensors (AdamW's param_groups: numbers, flags, a
    tuple, names) read by torch.load(weights_only=True): DCP's own reads them with weights_only=False,
    which calls whatever a crafted .distcp names. Tensors DCP reads with weights_only=True already.
    `refused`: its refusal, which DCP wraps in a CheckpointException."""

    refused: UnsafeCheckpoint | None = None

    def __init__(self, path):
        super().__init__()
        self.checkpoint_path = path

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            file = self.metadata.storage_data[read_item.storage_index].relative_path
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = named.group(1) if named else "what torch.load(weights_only=True) refuses"
            self.refused = UnsafeCheckpoint(untrusted(self.checkpoint_path, f"{file} (item {fqn})", what))
            raise self.refused from None
        # where DefaultLoadPlanner.load_bytes puts it
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


@rotation_aware
def _load(path: Path, state: dict, group=None) -> None:
    """Load `state` in place from a checkpoint; nothing in it is unpickled but DCP's metadata classes,
    tensors and plain values (_SafeReader, _SafePlanner). A file that names anything else is an
    UnsafeCheckpoint on every rank: its own refusal, or another rank's, which DCP gathers."""
    check_inside(path)  # every file one run's, none a link out of the folder
    metadata = read_metadata(path)  # refused here, by name, before DCP starts
    reader, planner = _SafeReader(path, metadata), _SafePlanner(path)
    try:
        with comm.recorded("checkpoint_load", group, None):  # DCP's own collectives run inside
            dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=planner, process_group=group)
    except CheckpointException as e:  # DCP's planning errors (missing keys, size mismatches); a BaseException
        theirs = (failure for failure, _ in e.failures.values() if isinstance(failure, UnsafeCheckpoint))
        refused = reader.refused or planner.refused or next(theirs, None)  # another rank's, if not this one's
        if refused is not None:
            raise refused from None
        raise CheckpointError(
            f"{path} does not fit this model ({_first_failure(e)}); was it written "
            "with another model.size, model.patch_size, "
            "model.adaln/ffn_dim/qk_norm_across_heads/pooled_text, "
            f"VAE or text encoder? Use the recipe it was "
            f"trained with, or train.resume=none"
        ) from e


def _first_failure(error: CheckpointException) -> str:
    """'KeyError: ...' of the first rank's failure inside a DCP exception, without DCP's tracebacks."""
    for exc, _ in error.failures.values():
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
    return str(error.args[0])[:300] if error.args else type(error).__name__


def load_checkpoint(runtime, path, training: TrainingState, verified: bool = False) -> None:
    """Restore the training state in place (resharded by DCP to this run's layout), once every file of
    the checkpoint has been checked (by all ranks together; `verified`: done already)."""
    if not verified:
        verify_checkpoint(path, runtime.control_group)
    state = training.state_dict()
    _on_io_group(runtime.control_group, lambda group: _load(Path(path), state, group))
    training.load_state_dict(state)


def load_base_weights(runtime, path, model) -> None:
    """Fill the base weights of a sharded model (every parameter but its adapters) with the EMA weights of
    a tessera checkpoint (model.pretrained naming a tessera run), resharded by DCP to this layout."""
    from models.lora import is_adapter

    weights = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
    state = {"ema": weights}
    _on_io_group(runtime.control_group, lambda group: _load(Path(path), state, group))
    set_model_state_dict(model, state["ema"], options=StateDictOptions(strict=False))


def read_tensors(path, key: str, shapes: dict, verified: bool = False) -> dict:
    """Some tensors of a checkpoint's `key` section ("model" or "ema") as whole float32 host tensors
    {name: tensor}, without building the model (a LoRA run's adapters, for sampling and export)."""
    if not verified:
        verify_checkpoint(path)
    state = {key: {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}}
    _load(Path(path), state)
    return state[key]


def load_weights(path, model, use_ema: bool = True, select=None, verified: bool = False) -> None:
    """Load the (EMA) weights of a training checkpoint into an unsharded model, e.g. for sampling;
    `select(key)`: only the state-dict keys it accepts (the rest keep their values)."""
    if not verified:
        verify_checkpoint(path)  # every file, here: this process has no group to share the reading with
    key = "ema" if use_ema else "model"
    state = {key: {k: v for k, v in model.state_dict().items() if select is None or select(k)}}
    _load(Path(path), state)
    model.load_state_dict(state[key], strict=select is None)
