"""Fault injection for the failure tests (tests/test_failures.py), off unless TESSERA_FAULT is set.

    TESSERA_FAULT="<fault>@<rank>:<step>"    e.g. "stop@1:3": rank 1 sends itself SIGSTOP in step 3

Steps are counted from 1, as in metrics.jsonl.
Faults, at the start of the step in train.py: `stop` (SIGSTOP: a hung process), `kill` (SIGKILL),
`hang` (the main thread sleeps forever: a deadlocked loader or a stuck read, its watchdog alive),
`raise` (an exception), `collective` (an extra all-reduce that the other ranks never issue).
`loader`: the data loader raises a DataError while loading the batch of that step.
"""

import os
import signal
import sys
import time

import torch


def _planned():
    spec = os.environ.get("TESSERA_FAULT")
    if not spec:
        return None
    fault, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    return fault, int(rank), int(step)


def at_step(rank: int, step: int) -> None:
    planned = _planned()
    if planned is None or planned[1:] != (rank, step):
        return
    fault = planned[0]
    print(f"[fault] rank {rank}: {fault} in step {step}", file=sys.stderr, flush=True)  # the tests time from here
    # A real hang comes at any moment, after the watchdog has published the step: let it publish.
    time.sleep(0.5)
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "hang":
        while True:
            time.sleep(1)
    elif fault == "raise":
        raise RuntimeError(f"injected fault in step {step}")
    elif fault == "collective":
        from parallel import comm

        comm.all_reduce(torch.zeros(3))


def loader_should_fail(rank: int, step: int) -> bool:
    planned = _planned()
    return planned is not None and planned == ("loader", rank, step)
