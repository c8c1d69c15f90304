"""Every collective in tessera goes through here.

- Messages above `parallel.max_message_mb` are split into chunks, and each chunk is waited on before
  the next is queued: the watchdog clock starts when an op is queued, so chunks queued back to back
  would share one deadline.
- Each op is recorded (sequence number, kind, group, shape, dtype, bytes, start, end) in a small
  per-rank ring buffer, written out by `dump_records` when a run fails, so that the ranks' histories
  can be compared to find the first op where they disagree or the rank that never arrived.
- Bytes and op counts per kind are kept for benchmarks.
"""

import collections
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class OpRecord:
    seq: int
    kind: str
    group: str
    shape: tuple
    dtype: str
    bytes: int
    start: float
    end: float | None = None


class _State:
    max_message_bytes = 256 * 2**20
    records: collections.deque = collections.deque(maxlen=256)
    seq = 0
    bytes_by_kind: collections.Counter = collections.Counter()
    ops_by_kind: collections.Counter = collections.Counter()
    failure_dir: Path | None = None


def set_failure_dir(folder) -> None:
    """Where `dump_records` writes when an entry point fails (the run directory's failures/)."""
    _State.failure_dir = Path(folder)


def failure_dir() -> Path | None:
    return _State.failure_dir


def configure(max_message_mb: float, history: int = 256) -> None:
    _State.max_message_bytes = max(1, int(max_message_mb * 2**20))
    _State.records = collections.deque(maxlen=history)


def stats() -> dict:
    return {"bytes": dict(_State.bytes_by_kind), "ops": dict(_State.ops_by_kind)}


def _group_name(group) -> str:
    if group is None:
        return "world"
    return getattr(group, "group_desc", None) or str(dist.get_process_group_ranks(group))


class _recorded:
    """Context manager that records one op and its duration."""

    def __init__(self, kind, group, tensor: torch.Tensor | None):
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        _State.seq += 1
        self.record = OpRecord(_State.seq, kind, _group_name(group), tuple(tensor.shape) if tensor is not None else (),
                               str(tensor.dtype) if tensor is not None else "", nbytes, time.time())
        _State.records.append(self.record)
        _State.bytes_by_kind[kind] += nbytes
        _State.ops_by_kind[kind] += 1

    def __enter__(self):
        return self.record

    def __exit__(self, *exc):
        self.record.end = time.time()
        return False


def _chunks(flat: torch.Tensor):
    per_chunk = max(1, _State.max_message_bytes // flat.element_size())
    return flat.split(per_chunk)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce, chunked above the message cap."""
    with _recorded("all_reduce", group, tensor):
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        for chunk in _chunks(flat):
            dist.all_reduce(chunk, op=op, group=group, async_op=True).wait()
            if chunk.is_cuda:  # wait() only orders the CUDA stream; the host must wait before queueing more
                torch.cuda.current_stream().synchronize()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    return tensor


def barrier(group=None) -> None:
    with _recorded("barrier", group, None):
        dist.barrier(group=group)


def dump_records(folder, rank: int, reason: str) -> Path:
    """Write this rank's recent ops (the last is the one in flight if it has no end time)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"comm_rank{rank}.json"
    with open(path, "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "reason": reason, "time": time.time(),
                   "records": [asdict(r) for r in _State.records]}, f, indent=1)
    return path
