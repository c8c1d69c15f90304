"""Every collective and point-to-point op in tessera goes through here.

- Messages above `parallel.max_message_mb` go in chunks, each waited on before the next is queued
  (chunks queued back to back would share one watchdog deadline).
- Each op is recorded (seq, kind, group, shape, bytes, start, end) in the runtime's CommLog, dumped to
  failures/ when a run fails, so the ranks' histories show where they disagree or who never arrived.
- Bytes and op counts per kind are kept for benchmarks (`stats`).
FSDP2's collectives (parallel/compute/fsdp.py) and DCP saves and loads (parallel/checkpoints/checkpoint.py)
are recorded too.
"""

import collections
import json
import os
import threading
import time
import weakref
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
    error: str | None = None  # the op raised (a peer gone, a timeout)
    posted: bool = False  # a transfer posted to complete later (exchange, post): waited on in PendingOps.wait


# torch 2.13 renamed these (the old names warn); keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommLog:
    """One runtime's record of its ops: the ring buffer of recent ops, the op the main thread waits in,
    the byte counters, the group names and the message cap. The Runtime owns one
    (parallel/lifecycle/runtime.py) and adopts its groups into it; an op finds the log through the group it
    runs on (`log_of`), so two runtimes in one process keep apart. The watchdog thread reads it while the main
    thread appends."""

    def __init__(self, max_message_mb: float = 256, history: int = 1024, failure_dir=None):
        self.max_message_bytes = max(1, int(max_message_mb * 2**20))
        self.records: collections.deque = collections.deque(maxlen=history)
        self.lock = threading.Lock()
        self.seq = 0
        self.last_activity = time.monotonic()  # when an op last started or ended (the watchdog's progress)
        self.waiting: OpRecord | None = None  # the posted transfer the main thread waits for
        self.group_names = weakref.WeakKeyDictionary()
        self.bytes_by_kind: collections.Counter = collections.Counter()
        self.sent_by_kind: collections.Counter = collections.Counter()
        self.ops_by_kind: collections.Counter = collections.Counter()
        self.failure_dir = Path(failure_dir) if failure_dir is not None else None

    def adopt(self, group, name: str | None = None) -> None:
        """Record `group`'s ops here, under `name` (groups from a device mesh have none of their own).
        None: the default group, whose ops say `world` when called without a group."""
        group = _default_group() if group is None else group
        if group is not None:
            _LOGS[group] = self
            if name is not None:
                self.group_names[group] = name

    def last_record(self) -> "OpRecord | None":
        """The newest op; it is still in flight (waited in, or queued) when its `end` is None."""
        with self.lock:
            return self.records[-1] if self.records else None

    def blocked_in(self) -> "OpRecord | None":
        """The op this rank's main thread waits in, if any: a collective it is inside, posted transfers it
        waits for, an op that failed (the rank stopped there), or on CUDA an op the stream has not passed
        yet (ops return once queued there: the host blocks later). Transfers posted ahead of time, which
        the rank computes beside, are not waited in (PipeFusion posts its receives early)."""
        waiting = self.waiting
        if waiting is not None:
            return waiting
        with self.lock:
            recent = list(self.records)[-8:]
        failed = [record for record in recent if record.error is not None]
        if failed:  # the run is failing there (a transfer posted earlier may be the one that raised)
            return failed[-1]
        if recent and recent[-1].end is None and not recent[-1].posted:
            return recent[-1]
        for record in reversed(recent):
            event = getattr(record, "done_event", None)
            if event is not None and not event.query():
                return record
        return None

    def snapshot(self) -> list:
        with self.lock:
            return list(self.records)

    def stats(self) -> dict:
        return {
            "bytes": dict(self.bytes_by_kind),
            "sent": dict(self.sent_by_kind),
            "ops": dict(self.ops_by_kind),
        }

    def reset_stats(self) -> None:
        self.bytes_by_kind.clear()
        self.sent_by_kind.clear()
        self.ops_by_kind.clear()

    def group_name(self, group) -> str:
        if group is None:
            return "world"
        if group in self.group_names:  # FSDP's mesh group may be the default group: it says `fsdp`
            return self.group_names[group]
        if group is dist.GroupMember.WORLD:
            return "world"
        desc = getattr(group, "group_desc", None)
        return desc if desc and desc != "undefined" else str(dist.get_process_group_ranks(group))

    def dump(self, folder, rank: int, reason: str, **extra) -> Path:
        """Write this rank's recent ops (the last is the one in flight if it has no end time), with
        whatever else the caller knows (the watchdog adds the step, the phase and every rank's heartbeat)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"comm_rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        waiting = self.blocked_in()
        with open(tmp, "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "pid": os.getpid(),
                    "reason": reason,
                    "time": time.time(),
                    **extra,
                    "waiting_seq": waiting.seq if waiting is not None else None,
                    "records": [asdict(r) for r in self.snapshot()],
                },
                f,
                indent=1,
                default=str,
            )
        tmp.replace(path)  # diagnose.py never reads half a file
        return path

    def dump_safely(self, folder, rank: int, reason: str, **extra) -> str:
        """`dump` for failure paths: the path written, or why nothing could be (never raises)."""
        try:
            return str(self.dump(folder, rank, reason, **extra))
        except OSError as e:
            return (
                f"nowhere: {Path(folder) / f'comm_rank{rank}.json'} could not be written ({e.strerror or e})"
            )


# group -> the CommLog that adopted it. Weak: a destroyed group's entry goes with it.
_LOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _default_group():
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def log_of(group=None) -> CommLog:
    """The log `group`'s ops record into: the one that adopted it, else the default group's (a group
    made outside a runtime, in a test or a benchmark), created on first use; before any process group
    exists, a new one that nothing keeps."""
    default = _default_group()
    for key in (group, default):
        if key is not None and key in _LOGS:
            return _LOGS[key]
    return CommLog() if default is None else _LOGS.setdefault(default, CommLog())


def configure(max_message_mb: float, group=None) -> None:
    """Set the message cap of `group`'s log and clear its records (benchmarks and tests)."""
    log = log_of(group)
    log.max_message_bytes = max(1, int(max_message_mb * 2**20))
    with log.lock:
        log.records.clear()


def stats(group=None) -> dict:
    return log_of(group).stats()


def reset_stats(group=None) -> None:
    log_of(group).reset_stats()


def _sent_fraction(kind: str, peers: int) -> float:
    """Bytes sent to other ranks per byte of the op's input, for a group of `peers + 1` ranks."""
    size = peers + 1
    return {
        "all_to_all": peers / size,
        "all_gather": peers,
        "reduce_scatter": peers / size,
        "all_reduce": 2 * peers / size,
        "send_recv": 1.0,
        "send": 1.0,
    }.get(kind, 0.0)


class recorded:
    """Context manager that records one op and its duration in `group`'s log (ops that bypass the
    functions below, such as FSDP2's collectives or a checkpoint save, are recorded with it too)."""

    def __init__(self, kind, group, tensor: torch.Tensor | None, log: CommLog | None = None):
        self.log = log = log or log_of(group)
        self.on_cuda = tensor is not None and tensor.is_cuda
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        shape, dtype = (tuple(tensor.shape), str(tensor.dtype)) if tensor is not None else ((), "")
        with log.lock:
            log.seq += 1
            self.record = OpRecord(log.seq, kind, log.group_name(group), shape, dtype, nbytes, time.time())
            log.records.append(self.record)
        log.last_activity = time.monotonic()
        log.bytes_by_kind[kind] += nbytes
        if nbytes and dist.is_initialized():
            log.sent_by_kind[kind] += int(nbytes * _sent_fraction(kind, dist.get_world_size(group) - 1))
        log.ops_by_kind[kind] += 1

    def __enter__(self):
        return self.record

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.record.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        elif self.on_cuda:  # queued, not done: the watchdog asks this event whether the stream got past it
            self.record.done_event = torch.cuda.Event()
            self.record.done_event.record()
        self.record.end = time.time()
        self.log.last_activity = time.monotonic()
        return False


def _chunks(flat: torch.Tensor, group):
    per_chunk = max(1, log_of(group).max_message_bytes // flat.element_size())
    return flat.split(per_chunk)


def _column_ranges(columns: int, rows: int, element_size: int, group):
    """Split a (rows, columns) message by columns so that each piece stays under the cap. Used for
    all-to-all / all-gather / reduce-scatter, where row i is the block that goes to (or comes from) rank i."""
    per_piece = max(1, log_of(group).max_message_bytes // max(1, rows * element_size))
    return [(start, min(columns, start + per_piece)) for start in range(0, columns, per_piece)]


def _wait(work, tensor: torch.Tensor, between_chunks: bool = False) -> None:
    """Order the stream after `work` (on CUDA, wait() does only that; the host runs on). Between the
    chunks of an oversized message the host waits too, so that the next chunk is queued, and its
    watchdog clock started, only once this one is done. A message under the cap is never waited on by
    the host: the next kernels queue behind it, and a ring exchange overlaps the compute after it."""
    work.wait()
    if between_chunks:
        _host_sync(tensor)


def _host_sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.current_stream().synchronize()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce, chunked above the message cap."""
    with recorded("all_reduce", group, tensor):
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        chunks = _chunks(flat, group)
        for chunk in chunks:
            _wait(dist.all_reduce(chunk, op=op, group=group, async_op=True), chunk, len(chunks) > 1)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    return tensor


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    """Block i of `input` (split along dim 0 into group-size equal blocks) goes to rank i; block j of
    `output` comes from rank j. Above the cap, the exchange runs as group-size - 1 pairwise rounds
    (round i: send to rank + i, receive from rank - i), each cut into contiguous pieces under the cap
    and waited on: no copies, and the same bytes as one all-to-all."""
    size = dist.get_world_size(group)
    if input.shape[0] % size or output.shape != input.shape:
        raise ValueError(
            f"all_to_all_single: dim 0 of {tuple(input.shape)} must split into {size} equal blocks "
            f"and the output must have the same shape, got {tuple(output.shape)}"
        )
    with recorded("all_to_all", group, input):
        send, recv = input.contiguous().view(size, -1), output.view(size, -1)
        if send.numel() * send.element_size() <= log_of(group).max_message_bytes:
            _wait(dist.all_to_all_single(recv, send, group=group, async_op=True), recv)
            return output
        me = dist.get_rank(group)
        recv[me] = send[me]
        for shift in range(1, size):
            to, source = (me + shift) % size, (me - shift) % size
            to_global, source_global = (_global_rank(group, r) for r in (to, source))
            _exchange_in_pieces(send[to], to_global, recv[source], source_global, group)
    return output


def _post_pair(send: torch.Tensor, to_rank: int, recv: torch.Tensor, from_rank: int, group):
    """One send and its matching receive in a single batch (a lone send may block until the peer's
    receive is posted)."""
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to_rank, group), dist.P2POp(dist.irecv, recv, from_rank, group)]
    )


def _exchange_in_pieces(send: torch.Tensor, to_rank: int, recv: torch.Tensor, from_rank: int, group) -> None:
    """Contiguous 1-D send/recv, cut into pieces under the cap, each waited on before the next."""
    for out_piece, in_piece in zip(_chunks(send, group), _chunks(recv, group)):
        for work in _post_pair(out_piece, to_rank, in_piece, from_rank, group):
            _wait(work, in_piece, between_chunks=True)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    """output (size * input.numel() elements) = the inputs of every rank, in rank order."""
    size = dist.get_world_size(group)
    with recorded("all_gather", group, input):
        flat, out = input.reshape(-1), output.view(size, -1)
        ranges = _column_ranges(flat.numel(), size, input.element_size(), group)
        if len(ranges) == 1:
            _wait(_all_gather(output.view(-1), flat.contiguous(), group=group, async_op=True), output)
        else:
            for start, end in ranges:
                piece = torch.empty(size * (end - start), dtype=out.dtype, device=out.device)
                _wait(
                    _all_gather(piece, flat[start:end].contiguous(), group=group, async_op=True), piece, True
                )
                out[:, start:end] = piece.view(size, -1)
    return output


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, group, op=dist.ReduceOp.SUM
) -> torch.Tensor:
    """output = block `rank` of the element-wise reduction of every rank's input (size blocks along dim 0)."""
    size = dist.get_world_size(group)
    with recorded("reduce_scatter", group, input):
        send, out = input.reshape(size, -1), output.view(-1)
        ranges = _column_ranges(send.shape[1], size, input.element_size(), group)
        if len(ranges) == 1:
            _wait(_reduce_scatter(out, send.reshape(-1).contiguous(), op=op, group=group, async_op=True), out)
        else:
            for start, end in ranges:
                _wait(
                    _reduce_scatter(
                        out[start:end],
                        send[:, start:end].contiguous().view(-1),
                        op=op,
                        group=group,
                        async_op=True,
                    ),
                    out,
                    True,
                )
    return output


def exchange(send: torch.Tensor, to_rank: int, recv: torch.Tensor, from_rank: int, group) -> "PendingOps":
    """Send `send` to global rank `to_rank` while receiving `recv` from `from_rank`, in one
    batch_isend_irecv (a lone send may block until its receive is posted). Returns at once when the
    message is under the cap, so the caller can compute while it travels; above the cap the message
    goes piece by piece, each waited on, and the exchange is complete on return."""
    if send.shape != recv.shape:
        raise ValueError(f"exchange: sent {tuple(send.shape)} and received {tuple(recv.shape)} shapes differ")
    record = recorded("send_recv", group, send).record
    flat_send, flat_recv = send.reshape(-1).contiguous(), recv.view(-1)
    if flat_send.numel() * flat_send.element_size() <= log_of(group).max_message_bytes:
        record.posted = True  # in flight while the caller computes; waited in only in PendingOps.wait
        pairs = _post_pair(flat_send, to_rank, flat_recv, from_rank, group)
        return PendingOps(pairs, [record], log_of(group), send.is_cuda)
    _exchange_in_pieces(flat_send, to_rank, flat_recv, from_rank, group)
    record.end = time.time()
    return PendingOps([], [record], log_of(group))


class PendingOps:
    """Point-to-point transfers in flight (`exchange`, `post`); `wait()` before reading what was received
    (on CUDA it orders the stream after them; the host runs on)."""

    def __init__(self, works, records, log: CommLog, on_cuda: bool = False):
        self.works, self.records, self.log, self._on_cuda = works, records, log, on_cuda

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        self.log.waiting = self.records[0] if self.works and self.records else None
        try:
            for work in self.works:
                work.wait()
        except BaseException as e:
            for record in self.records:
                record.error = record.error or f"{type(e).__name__}: {str(e)[:200]}"
            raise
        finally:
            self.log.waiting = None
        now = time.time()
        for record in self.records:
            if record.end is None:
                record.end = now
                if self._on_cuda and self.works:
                    record.done_event = torch.cuda.Event()  # the stream waits for the transfer from here
                    record.done_event.record()
        self.works = []
        self.log.last_activity = time.monotonic()


def post(sends=(), recvs=(), group=None) -> PendingOps:
    """Post sends [(tensor, global rank)] and receives [(tensor, global rank)] together, in one
    batch_isend_irecv, and return at once. Each message above the cap goes as several pieces (every piece
    its own op in the same batch), so no single op is larger than `parallel.max_message_mb`. Batching a
    send with the receive posted next keeps them from waiting on each other (a lone NCCL send may block
    until the peer's receive is posted). Receives of one peer match its sends in posting order."""
    ops, records = [], []
    for kind, op, pairs in (("send", dist.isend, sends), ("recv", dist.irecv, recvs)):
        for tensor, peer in pairs:
            if not tensor.is_contiguous():
                raise ValueError(f"post: {kind} buffers must be contiguous, got {tuple(tensor.shape)}")
            records.append(recorded(kind, group, tensor).record)
            records[-1].posted = True
            ops += [dist.P2POp(op, piece, peer, group) for piece in _chunks(tensor.view(-1), group)]
    on_cuda = any(tensor.is_cuda for tensor, _ in (*sends, *recvs))
    return PendingOps(dist.batch_isend_irecv(ops) if ops else [], records, log_of(group), on_cuda)


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """In-place broadcast from global rank `src`, chunked above the message cap."""
    with recorded("broadcast", group, tensor):
        flat = tensor.view(-1)
        chunks = _chunks(flat, group)
        for chunk in chunks:
            _wait(dist.broadcast(chunk, src=src, group=group, async_op=True), chunk, len(chunks) > 1)
    return tensor


def barrier(group=None) -> None:
    with recorded("barrier", group, None):
        dist.barrier(group=group)
