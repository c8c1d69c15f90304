"""The entry point of train.py, infer.py and the scripts that start process groups: run `main`, turn
what it raised into one `error:` line (the rank to blame first, then a traceback for bugs) and an exit
code, and end the process without waiting on what a failure left behind (DataLoader workers, a
communicator waiting on a dead peer). A Session carries the run's state from here to `main` and back:
the stop request whose handler is installed, and the Runtime once init_runtime made it.
"""

import errno
import gc
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

import torch.distributed as dist

from parallel.compute.comm import log_of
from parallel.lifecycle.exits import error_message, hard_exit, is_peer_error, one_line, print_line
from parallel.lifecycle.preemption import Stopped, StopRequest, Terminated
from parallel.lifecycle.runtime import world_from_env


class Session:
    """One process's run, as the entry point sees it: `stop`, whose handler run_entrypoint installs,
    and what init_runtime makes (None before, or for a main that starts no process group)."""

    def __init__(self):
        self.stop = StopRequest()
        # Set by init_runtime as each comes to exist, so that a failure during start-up is reported
        # with them too: the run directory, the comm log (once a process group exists), the watchdog.
        self.run_dir = self.comm = self.watchdog = None
        self.lock = None  # rank 0 of a training run: the run directory's lock (configs/runlock.py)
        self.lock_token = None  # every rank of a training run: that lock's token

    def failure_dir(self) -> Path | None:
        """Where this rank's failure records go: the run's failures/, unless another run took the
        directory over while this one was frozen (it then writes nothing there)."""
        if self.run_dir is None or not self.owns_directory():
            return None
        return Path(self.run_dir) / "failures"

    def owns_directory(self) -> bool:
        from configs.runlock import owns

        return owns(self.lock, self.run_dir, self.lock_token)

    def close(self) -> None:
        """Stop the watchdog (this rank leaves on purpose) and destroy the process groups."""
        if self.watchdog is not None:
            self.watchdog.finish()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.release_lock()

    def release_lock(self) -> None:
        """The run directory is free for the next run (a process that exits without this leaves a lock
        whose dead pid the next start takes over)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# Errors a user can fix from the message alone: printed without a traceback, exit code 2.
def _user_errors():
    from configs import ConfigError
    from configs.runlock import RunDirectoryInUse
    from models.attention import AttentionBackendUnavailable
    from parallel.checkpoints.checkpoint_files import CheckpointError
    from parallel.compute.layout import LayoutError
    from parallel.compute.pipefusion_plan import PipeFusionError
    from parallel.lifecycle.divergence import TrainingDiverged

    return (
        ConfigError,
        LayoutError,
        CheckpointError,
        AttentionBackendUnavailable,
        FileNotFoundError,
        ValueError,
        PipeFusionError,
        TrainingDiverged,
        RunDirectoryInUse,
    )


SHUTDOWN_S = 20.0  # a failed process that has not finished shutting down after this long exits anyway


def run_entrypoint(main, argv=None, hold_to_exit: bool = False) -> int:
    """Run an entry point and return its exit code; it never raises, so nothing (a traceback's frames
    holding DataLoader workers, a stop signal, a full disk) stands between a failure and its `error:` line.
    0: done; 2: a user error, one `error:` line on every rank; 1: any other failure, the `error:` line
    first (with several ranks it names the rank that caused it, parallel/lifecycle/watchdog.py), then this
    rank's traceback, and its recent collectives in the run's failures/ folder; 128 + signal: stopped by a
    signal. From the first exception on, stop signals are only noted: torchrun's SIGTERM, which follows
    another rank's failure within milliseconds, cannot pre-empt the line. A shutdown that hangs (a
    communicator waiting on a dead peer) ends the process after SHUTDOWN_S. `hold_to_exit` (run_as_process):
    after a failure the signals stay held, since the process ends right after."""
    rank, session = world_from_env()[0], Session()
    stop = session.stop
    restore_signals = stop.install()
    code = 1
    try:
        try:
            main(argv, session)
            code = 0
        except BaseException as e:
            stop.held = True  # first, as a plain store: no signal handler runs before it
            stop.hold()
            code = _report_failure(e, rank, session)
            traceback.clear_frames(e.__traceback__)  # its frames hold the data loader (and its workers) alive
            del e
        stop.hold()  # the shutdown too: torchrun's SIGTERM, after a peer's exit, must not change the code
        deadline = None
        if code != 0:  # a failed run's communicators may wait on a dead peer
            deadline = threading.Timer(SHUTDOWN_S, _exit_now, args=(code, rank))
            deadline.daemon = True
            deadline.start()
        try:
            session.close()
        except BaseException as e:  # the run's outcome is decided: report, keep its code
            _print(f"[rank {rank}] warning: shutting down failed ({one_line(e)})")
        finally:
            if deadline is not None:
                deadline.cancel()
    finally:
        if not (hold_to_exit and code != 0):
            restore_signals()
    # a data loader iterator in a reference cycle ends its workers now, not at exit; only where workers live
    # (a collection costs a third of a second in a process that holds many objects: the suite's)
    if multiprocessing.active_children():
        gc.collect()
    return code


def _report_failure(e: BaseException, rank: int, session: Session) -> int:
    """Print the `error:` (or `stopped:`) line for `e` and return the exit code (see run_entrypoint)."""
    if isinstance(e, Stopped):
        return 128 + e.signum
    if isinstance(e, SystemExit):  # argparse: its own message is printed already
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    e = _as_storage_error(e, session)
    monitor, stop = session.watchdog, session.stop
    several = monitor is not None and monitor.world_size > 1
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    if isinstance(e, _user_errors()):
        if monitor is not None:
            monitor.report_failure(e)  # the other ranks stop waiting for this one
        _print(f"{prefix}error: {error_message(e)}")
        if os.environ.get("TESSERA_DEBUG"):
            traceback.print_exception(e)
        return 2
    if isinstance(e, (Terminated, KeyboardInterrupt)):
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        blamed = monitor.explain(e) if several else None  # torchrun stops every rank when one failed or died
        if blamed is None:  # stopped from outside, nobody failed
            if monitor is not None:
                monitor.finish("stopped")
            _print(f"[rank {rank}] stopped: received {signal.Signals(signum).name}")
            return 128 + signum
        _print(blamed)
        _dump_on_failure(rank, e, session, blamed)
        monitor.leave("stopped")  # not taken for another dead rank by the others
        session.release_lock()
        hard_exit(128 + signum, monitor.backend)  # its communicators may wait on the failed rank
    if not several:
        _print(f"{prefix}error: {one_line(e)} (a failure inside tessera or a library: the traceback follows)")
        _dump_on_failure(rank, e, session, repr(e))
        traceback.print_exception(e)
        return 1
    stopping = (stop.signum and not stop.accepting) or monitor.peers_stopped()
    if is_peer_error(e) and stopping:
        # A stop signal outside the training loop reached the ranks at different moments (a user's stop
        # during start-up): a peer that left on it broke this collective. A stop, not a failure, unless a
        # rank is to blame after all. (In the loop a stop is agreed at a step boundary: a collective that
        # fails there is a failure, reported below.)
        return _report_failure(Terminated(stop.signum or signal.SIGTERM), rank, session)
    # Several ranks: the first line printed names the rank that caused the failure.
    blamed = monitor.explain(e) if is_peer_error(e) else None
    line = blamed or monitor.report_failure(e)
    _print(line)
    _dump_on_failure(rank, e, session, line)
    if blamed is None or os.environ.get("TESSERA_DEBUG"):
        traceback.print_exception(e)  # this rank's own failure: its traceback follows the line
    if blamed is not None:
        # Another rank's failure: this rank's communicators may still wait on the peer: abort them rather
        # than shut down cleanly.
        session.release_lock()
        hard_exit(1, monitor.backend)
    return 1


_print = print_line


def _as_storage_error(e: BaseException, session: Session) -> BaseException:
    """A full, over-quota or read-only file system anywhere (metrics, samples, outputs, failure records;
    checkpoints say so themselves, with permissions too) becomes a StorageError naming the file system,
    the file and the free space. (A permission error elsewhere may be a read: it keeps its own message.)"""
    from parallel.lifecycle.storage import StorageError, storage_message, storage_problem

    problem = storage_problem(e) if isinstance(e, OSError) else None
    if problem is None or problem[0] not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return e
    failures = session.failure_dir()
    root = failures.parent / "checkpoints" if failures is not None else Path(problem[1] or ".").parent
    monitor = session.watchdog
    return StorageError(
        storage_message(problem, root, training=monitor is not None and monitor.task == "train")
    )


def _exit_now(code: int, rank: int) -> None:
    _print(f"[rank {rank}] shutting down took over {SHUTDOWN_S:.0f} s: exiting without waiting for it")
    hard_exit(code, dist.get_backend() if dist.is_initialized() else "gloo")


def run_as_process(main) -> None:
    """The `__main__` of train.py, infer.py and the scripts that start process groups: run_entrypoint, then
    exit with its code. After a failure or a stop (its line and records are out) the process ends at once
    (hard_exit kills the DataLoader workers first): the workers ignore stop signals (the main process owns
    them), so multiprocessing's exit hook, which terminates and joins them, would wait forever, and library
    exit hooks (wandb) may wait on a network. The stop signals stay held until then: torchrun's SIGTERM,
    which follows a peer's exit, must not turn this rank's code into -15 in between."""
    code = run_entrypoint(main, hold_to_exit=True)
    if code == 0:
        sys.exit(0)
    hard_exit(code, "gloo")  # the process group is destroyed by now


def _dump_on_failure(rank: int, error: BaseException, session: Session, line: str = "") -> None:
    folder, monitor = session.failure_dir(), session.watchdog
    if folder is None or not dist.is_initialized() or isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    where = (
        monitor.dump(line)
        if monitor is not None
        else (session.comm or log_of(None)).dump_safely(folder, rank, line or repr(error))
    )
    _print(f"[rank {rank}] recent collectives written to {where}")
