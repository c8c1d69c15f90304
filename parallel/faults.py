"""Fault injection for the failure tests (tests/test_failures.py, tests/test_checkpoint.py), off unless
TESSERA_FAULT is set:

    TESSERA_FAULT="<fault>[@<rank>][:<step>]"      several comma-separated; no rank: every rank; no step: every step
    e.g. "stop@1:3": rank 1 sends itself SIGSTOP in step 3 (steps counted from 1, as in metrics.jsonl)

At the start of a training step: `stop` (SIGSTOP: a hung process), `kill` (SIGKILL), `hang` (the main
thread sleeps forever, its watchdog alive: a deadlocked loader, a stuck read), `raise` (an exception),
`collective` (an extra all-reduce the other ranks never issue). `loader`: the data loader raises a
DataError while loading that step's batch. `save_before_shards`, `save_after_shards`,
`save_after_rename`: SIGKILL at that point of the checkpoint save of that step, as a power cut or
the OOM killer would.
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
            raise ValueError(f"TESSERA_FAULT={spec!r}: expected <fault>[@<rank>][:<step>] (see parallel/faults.py)")
        name, at_rank, at_step = match.groups()
        if name == fault and at_rank in (None, str(rank)) and at_step in (None, str(step)):
            return True
    return False


def _announce(fault: str, rank: int, step: int) -> None:
    print(f"[fault] rank {rank}: {fault} in step {step}", file=sys.stderr, flush=True)  # the tests time from here


def at_step(rank: int, step: int) -> None:
    if "TESSERA_FAULT" not in os.environ:
        return
    for fault in ("stop", "kill", "hang", "raise", "collective"):
        if not planned(fault, rank, step):
            continue
        _announce(fault, rank, step)
        time.sleep(0.5)  # a real hang comes at any moment, after the watchdog has published the step
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "hang":
            while True:
                time.sleep(1)
        elif fault == "raise":
            raise RuntimeError(f"injected fault in step {step}")
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
