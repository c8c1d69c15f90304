"""Fault injection for the failure tests, off unless TESSERA_FAULT is set, and read once at start-up:

    TESSERA_FAULT="<fault>[@<rank>][:<step>]"   comma-separated; no rank: every rank; no step: every step

At a training step `stop`, `kill`, `hang`, `raise`, `collective`, `term`, `nan`, `loader`, `leak` (each loader
batch keeps 64 MiB: data/loader.py); at a denoising step `sample_stop|kill|hang`; before the groups exist
`prestart_kill`, `rendezvous_kill`, `pginit_kill`; once they exist `startup_stop|kill|hang|raise`; in a
checkpoint save `save_before_shards|after_shards|after_rename` (SIGKILL; `_stop` appended: SIGSTOP) and
`enospc` (a full disk); in PipeFusion `pipefusion_count` and `pipefusion_extra_send`; in the step cache
`cache_plan` and `cache_signal` (parallel/compute/cache.py). docs/internals.md says what each does.
"""

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

_SPEC = re.compile(r"^(\w+)(?:@(\d+))?(?::(\d+))?$")


@dataclass(frozen=True)
class Faults:
    """The faults planned for this rank, parsed once at start-up (a malformed spec fails there, before
    any work). Empty outside the failure tests; every method is then a no-op. Picklable: the data
    loader's workers take it along."""

    rank: int = 0
    specs: tuple = ()  # (fault, rank or None, step or None)

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        specs = []
        for spec in filter(None, os.environ.get("TESSERA_FAULT", "").split(",")):
            match = _SPEC.match(spec.strip())
            if match is None:
                raise ValueError(
                    f"TESSERA_FAULT={spec!r}: expected <fault>[@<rank>][:<step>] "
                    "(see parallel/lifecycle/faults.py)"
                )
            name, at_rank, at_step = match.groups()
            specs.append(
                (name, None if at_rank is None else int(at_rank), None if at_step is None else int(at_step))
            )
        return cls(rank, tuple(specs))

    def planned(self, fault: str, step: int = 0) -> bool:
        return any(
            name == fault and at_rank in (None, self.rank) and at_step in (None, step)
            for name, at_rank, at_step in self.specs
        )

    def named(self, fault: str) -> bool:
        """Whether `fault` is planned at all, on any rank or step."""
        return any(name == fault for name, _, _ in self.specs)

    def _announce(self, fault: str, step: int) -> None:
        print(
            f"[fault] rank {self.rank}: {fault} in step {step}", file=sys.stderr, flush=True
        )  # tests time from here

    def at_step(self, step: int) -> None:
        for fault in ("stop", "kill", "hang", "raise", "collective", "term"):
            if self.planned(fault, step):
                self._announce(fault, step)
                _act(fault, f"step {step}")

    def at_sampling_step(self, step: int, total: int) -> None:
        """`sample_stop`, `sample_kill`, `sample_hang` at the start of denoising step `step` (2 or later)."""
        if step > total:
            return
        for fault in ("stop", "kill", "hang"):
            if self.planned(f"sample_{fault}", step):
                self._announce(f"sample_{fault}", step)
                _act(fault, f"sampling step {step}")

    def at_startup(self) -> None:
        """`startup_stop`, `startup_kill`, `startup_hang`, `startup_raise` once the process groups exist
        (counted as step 0)."""
        for fault in ("stop", "kill", "hang", "raise"):
            if self.planned(f"startup_{fault}", 0):
                self._announce(f"startup_{fault}", 0)
                _act(fault, "start-up")

    def before_start(self, point: str) -> None:
        """`<point>_kill` (SIGKILL) before the process group exists: `prestart` before this rank's first
        heartbeat, `rendezvous` with its heartbeat running but before it arrives, `pginit` once every rank
        has arrived, as the process group forms (parallel/lifecycle/runtime.py)."""
        if self.planned(f"{point}_kill", 0):
            self._announce(f"{point}_kill", 0)
            _act("kill", "start-up")

    def at_save(self, point: str, step: int) -> None:
        """SIGKILL (save_<point>) or SIGSTOP (save_<point>_stop: a job suspended in the middle of a save) at
        `point` (before_shards, after_shards, after_rename) of the save of step `step`."""
        for suffix, signum in (("", signal.SIGKILL), ("_stop", signal.SIGSTOP)):
            if self.planned(f"save_{point}{suffix}", step):
                self._announce(f"save_{point}{suffix}", step)
                os.kill(os.getpid(), signum)

    def loader_should_fail(self, step: int) -> bool:
        return self.planned("loader", step)

    def nan_loss(self, loss, step: int):
        """The loss, or NaN at the step named by nan@<rank>:<step> (a diverging run)."""
        if self.planned("nan", step):
            self._announce("nan", step)
            return loss * float("nan")
        return loss

    def full_disk_writer(self, path, step: int):
        """A DCP storage writer whose files fail with ENOSPC after 4 KiB, for the save named by
        enospc@<rank>:<step>; None (DCP's own writer) otherwise."""
        if not self.planned("enospc", step):
            return None
        self._announce("enospc", step)
        return _full_disk_writer(path)


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

        from parallel.compute import comm

        comm.all_reduce(torch.zeros(3))


def _full_disk_writer(path):
    """DCP's writer into `path` whose files take 4 KiB between them, then fail as a full disk does."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from parallel.checkpoints.checkpoint_files import WatchedFileSystem

    budget = [4096]  # shared by every file of the save

    def wrote(file, size: int) -> None:
        if budget[0] < size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        budget[0] -= size

    writer = FileSystemWriter(path)
    writer.fs = WatchedFileSystem(writer.fs, lambda file: None, wrote)
    return writer
