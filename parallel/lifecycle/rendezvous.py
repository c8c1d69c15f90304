"""The start-up rendezvous, before any process group exists (parallel/lifecycle/runtime.py): every rank waits
for the others on torchrun's store, polling in Python, so that stop signals are heard and the watchdog
(already beating) names a rank that dies during start-up; rank 0 of a training run takes the run directory's
lock first (configs/runlock.py) and its verdict reaches every rank here, before any collective.
"""

import datetime
import os
import time

import torch.distributed as dist

from configs.runlock import RunDirectoryInUse, RunLock
from parallel.lifecycle.preemption import Terminated
from parallel.lifecycle.watchdog import Watchdog


def connect_store(world_size: int, timeout_s: float):
    """A client of the c10d store that torchrun runs (or rank 0 hosts): the heartbeats' channel, apart
    from the main thread's own client so a slow store call never blocks a collective set-up."""
    if world_size == 1 or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    run = (
        f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    return dist.PrefixStore(f"tessera/{run}/", store)


class StartupError(RuntimeError):
    """A rank did not arrive at start-up in time."""


def rendezvous(
    monitor: Watchdog, run_dir, timeout_s: float, injected, session
) -> tuple[RunLock | None, str | None]:
    """Before any process group: rank 0 of a training run takes the run directory's lock, then every rank
    waits (in Python, polling the store, so stop signals are heard and the watchdog names a rank that dies)
    until all have arrived, and raises rank 0's refusal if there was one: every rank fails alike, before
    any collective. Returns (the lock (rank 0 of a training run) or None, the lock's token on every rank of
    a training run: each asks configs.runlock.holds with it before writing in the run directory)."""
    rank, world_size = monitor.rank, monitor.world_size
    lock, refusal, token = None, "", None
    if rank == 0 and monitor.task == "train" and run_dir is not None:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunDirectoryInUse as e:
            lock, refusal = None, str(e)
        token = lock.token if lock is not None else None
        if session is not None:
            session.lock = lock
    injected.before_start("rendezvous")  # tests only: a rank that dies with its heartbeat running
    if world_size > 1:
        monitor.mark("rendezvous")
        store = connect_store(world_size, max(5.0, timeout_s))  # the main thread's own client
        if rank == 0:
            store.set("rendezvous/token", token or "")
            store.set("rendezvous/refusal", refusal)
        store.set(f"rendezvous/arrived/{rank}", "1")  # who, for the message if some rank never comes
        store.add("rendezvous/arrived", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("rendezvous/arrived", 0) < world_size:
            if time.monotonic() > deadline:
                raise StartupError(_missing_ranks(store, world_size, timeout_s))
            if session is not None and session.stop.signum:  # no refusal of this rank's own is coming:
                raise Terminated(session.stop.signum)  # say at once who is missing (torchrun: a rank died)
            time.sleep(0.05)
        refusal = store.get("rendezvous/refusal").decode()
        token = store.get("rendezvous/token").decode() or None
        monitor.mark("process group")
        injected.before_start("pginit")  # tests only: a rank that dies while the process group forms
    if refusal:
        raise RunDirectoryInUse(refusal)
    if session is not None:
        session.lock_token = token
    return lock, token


def _missing_ranks(store, world_size: int, timeout_s: float) -> str:
    """Which ranks did not arrive, and whether they ever started (a heartbeat) or are busy before it."""
    late = [r for r in range(world_size) if not store.check([f"rendezvous/arrived/{r}"])]
    silent = [r for r in late if not store.check([f"hb/{r}"])]
    busy = [r for r in late if r not in silent]
    parts = []
    if silent:
        ranks = ", ".join(map(str, silent))
        parts.append(f"rank(s) {ranks} never sent a heartbeat (still importing or reading data, or gone)")
    if busy:
        ranks = ", ".join(map(str, busy))
        parts.append(f"rank(s) {ranks} started, did not arrive (rank 0 may be watching run.lock's heartbeat)")
    return (
        f"{'; '.join(parts) or 'some ranks did not arrive'}, within parallel.preflight_timeout_s "
        f"({timeout_s:.0f} s) of this rank: raise it if their start-up is that slow, else see their output"
    )


def finish_line(monitor: Watchdog, flagged: bool) -> int:
    """The last meeting of a run's ranks, on the store: each says whether it is `flagged` (sampling: its
    videos held NaN); returns how many were. No process-group timeout applies (a replica without prompts
    may wait out the others' sampling for hours): a rank that dies, stalls or fails meanwhile is named by
    the watchdog, which ends this one; this rank's own progress is the waiting."""
    if monitor.world_size == 1:
        return int(flagged)
    store = connect_store(monitor.world_size, 60.0)
    if flagged:
        store.add("finish/flagged", 1)
    store.add("finish/arrived", 1)
    while store.add("finish/arrived", 0) < monitor.world_size:
        monitor.mark("finishing")
        time.sleep(0.1)
    return store.add("finish/flagged", 0)
