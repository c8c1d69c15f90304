"""Fault injection for the failure tests (tests/test_failures.py, tests/test_checkpoint.py), off unless
TESSERA_FAULT is set:

    TESSERA_FAULT="<fault>[@<rank>][:<step>]"      several comma-separated; no rank: every rank; no step: every step
    e.g. "stop@1:3": rank 1 sends itself SIGSTOP in step 3 (steps counted from 1, as in metrics.jsonl)

At the start of a training step: `stop` (SIGSTOP: a hung process), `kill` (SIGKILL), `hang` (the main
thread sleeps forever, its watchdog alive: a deadlocked loader, a stuck read), `raise` (an exception),
`collective` (an extra all-reduce the other ranks never issue), `term` (SIGTERM to itself: a
preemption notice). `sample_stop`, `sample_kill`, `sample_hang`: the same at the start of a denoising
step of infer.py; `startup_stop`, `startup_kill`, `startup_hang`, `startup_raise`: once the process
groups exist (step 0). `loader`: the data loader raises a DataError while loading that step's batch.
`save_before_shards`, `save_after_shards`, `save_after_rename`: SIGKILL at that point of the checkpoint
save of that step, as a power cut or the OOM killer would. `enospc`: the checkpoint save of that step
fails with "No space left on device" after its first 4 KiB, as a disk that fills up during the save.
`nan`: the loss of that step is NaN.
"""

import os
import re
import signal
import sys
import time

_SPEC = re.compile(r"^(\w+)(?:@(\d+))?(?::(\d+))?$")


def planned(fault: str, rank: int, step: int) -> bool:
    for spec in filter(None, os.environ.get("TESSERA_FAULT", "").split(",")):
        match = _SPEC.match(spec.strip())
        if match is None:
            raise ValueError(
                f"TESSERA_FAULT={spec!r}: expected <fault>[@<rank>][:<step>] (see parallel/faults.py)"
            )
        name, at_rank, at_step = match.groups()
        if name == fault and at_rank in (None, str(rank)) and at_step in (None, str(step)):
            return True
    return False


def _announce(fault: str, rank: int, step: int) -> None:
    print(
        f"[fault] rank {rank}: {fault} in step {step}", file=sys.stderr, flush=True
    )  # the tests time from here


def at_step(rank: int, step: int) -> None:
    if "TESSERA_FAULT" not in os.environ:
        return
    for fault in ("stop", "kill", "hang", "raise", "collective", "term"):
        if planned(fault, rank, step):
            _announce(fault, rank, step)
            _act(fault, f"step {step}")


def at_sampling_step(rank: int, step: int, total: int) -> None:
    """`sample_stop`, `sample_kill`, `sample_hang` at the start of denoising step `step` (2 or later)."""
    if "TESSERA_FAULT" not in os.environ or step > total:
        return
    for fault in ("stop", "kill", "hang"):
        if planned(f"sample_{fault}", rank, step):
            _announce(f"sample_{fault}", rank, step)
            _act(fault, f"sampling step {step}")


def at_startup(rank: int) -> None:
    """`startup_stop`, `startup_kill`, `startup_hang`, `startup_raise` once the process groups exist
    (counted as step 0)."""
    if "TESSERA_FAULT" not in os.environ:
        return
    for fault in ("stop", "kill", "hang", "raise"):
        if planned(f"startup_{fault}", rank, 0):
            _announce(f"startup_{fault}", rank, 0)
            _act(fault, "start-up")


def _act(fault: str, where: str) -> None:
    if fault == "term":  # a preemption notice (SLURM, a spot reclaim) arriving during this step
        os.kill(os.getpid(), signal.SIGTERM)
        return
    time.sleep(0.5)  # a real hang comes at any moment, after the watchdog has published the step
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "hang":
        while True:
            time.sleep(1)
    elif fault == "raise":
        raise RuntimeError(f"injected fault in {where}")
    else:
        import torch

        from parallel import comm

        comm.all_reduce(torch.zeros(3))


def at_save(point: str, rank: int, step: int) -> None:
    """SIGKILL at `point` (before_shards, after_shards, after_rename) of the save of step `step`."""
    if "TESSERA_FAULT" in os.environ and planned(f"save_{point}", rank, step):
        _announce(f"save_{point}", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def loader_should_fail(rank: int, step: int) -> bool:
    return "TESSERA_FAULT" in os.environ and planned("loader", rank, step)


def nan_loss(loss, rank: int, step: int):
    """The loss, or NaN at the step named by TESSERA_FAULT=nan@<rank>:<step> (a diverging run)."""
    if "TESSERA_FAULT" in os.environ and planned("nan", rank, step):
        _announce("nan", rank, step)
        return loss * float("nan")
    return loss


def full_disk_writer(path, rank: int, step: int):
    """A DCP storage writer whose files fail with ENOSPC after 4 KiB, for the save named by
    TESSERA_FAULT=enospc@<rank>:<step>; None (DCP's own writer) otherwise."""
    if "TESSERA_FAULT" not in os.environ or not planned("enospc", rank, step):
        return None
    import contextlib
    import errno
    import io

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    _announce("enospc", rank, step)

    class FillingStream(io.RawIOBase):
        """A file that takes `budget` bytes, then fails as a full disk does."""

        budget = 4096  # shared by every file of the save

        def __init__(self, stream, name):
            self.stream, self.name = stream, name

        def writable(self):
            return True

        def write(self, data):
            if FillingStream.budget < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.name))
            FillingStream.budget -= len(data)
            return self.stream.write(data)

        def tell(self):
            return self.stream.tell()

        def flush(self):
            self.stream.flush()

        def fileno(self):
            return self.stream.fileno()

    class FullDisk(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield FillingStream(stream, path) if "w" in mode else stream

    writer = FileSystemWriter(path)
    writer.fs = FullDisk()
    return writer
