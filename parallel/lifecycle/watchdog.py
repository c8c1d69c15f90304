"""Heartbeats and a shared abort, outside the collectives: a rank that dies, stalls or waits in another
collective than the others is named within seconds, by every rank.

Every rank runs a small thread that publishes its progress (step, phase, the op in flight) on the c10d
store torchrun already runs, and watches a few peers' heartbeats (on NCCL a dead peer resets no
socket), its own main thread against the phase's deadline, and the shared abort key: the first reason
written there ends every rank within about a second, each printing one `error:` line. Deadlines:
`parallel.timeout_s` for start-up, first steps and decodes; `parallel.stall_timeout_s` for later steps;
`parallel.control_timeout_s` for checkpoints and gloo fences. docs/failures.md has the whole story.
"""

import faulthandler
import os
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from parallel.compute.comm import CommLog
from parallel.lifecycle.exits import (
    NCCL_HINT,
    dump_nccl_trace,
    hard_exit,
    latest_checkpoint,
    one_line,
    print_line,
)
from parallel.lifecycle.heartbeat import STORE_CLOSED_WORDS, HeartbeatChannel, where
from parallel.lifecycle.preemption import Terminated

WATCHED_PEERS = 4  # each rank watches the next few ranks: O(1) store reads per rank, whatever the world size
PUBLISH_EVERY_S = 0.25  # a phase change is published at once, but no more often than this (store load)
# Groups whose waits may last as long as other ranks' long work (their timeout is parallel.control_timeout_s):
# a rank waiting there is judged against that, not against the step's deadline.
FENCE_GROUPS = ("control", "replica-control")
LOST_DIRECTORY = "nowhere: another run took the run directory over, and this one writes nothing there"


@dataclass(frozen=True)
class Deadlines:
    long_s: float  # the first step (compile, warm-up) and previews
    stall_s: float  # every later step
    silence_s: float  # a rank whose heartbeat thread says nothing for this long is gone
    save_s: float = 1800.0  # a checkpoint save (slow storage; the control group's timeout)

    def describe(self) -> str:
        return (
            f"deadlines: {self.long_s:.0f} s for the first step, the first denoising step and a VAE decode "
            f"(parallel.timeout_s); {self.save_s:.0f} s for a checkpoint or a wait for other ranks' "
            "long work "
            f"(parallel.control_timeout_s); {self.stall_s:.0f} s for a later step or denoising step "
            f"(parallel.stall_timeout_s); {self.silence_s:.0f} s of silence from a rank "
            f"(parallel.heartbeat_timeout_s)"
        )


_FAILED = re.compile(r"rank \d+ \([^)]*\) failed ")  # a reason report_failure published


class Watchdog(HeartbeatChannel):
    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        run_dir,
        deadlines: Deadlines,
        backend: str = "gloo",
        interval_s: float | None = None,
        task: str = "train",
        comm: CommLog | None = None,
    ):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.run_dir = Path(run_dir)
        self.deadlines, self.backend = deadlines, backend
        self.task = task  # train | sample | encode: only training has checkpoints to name
        self.comm = comm or CommLog()  # the runtime's record of its ops: the op this rank waits in
        self.interval = interval_s or max(0.05, min(1.0, deadlines.silence_s / 5))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step: int | None = None  # the training step
        self.sampling: tuple[int, int] | None = None  # (denoising step, steps) while sampling
        self._sampled_all = False  # every denoising step is done: the VAE decode and writing follow
        self.phase = "start-up"
        self._long_step = True
        self._in_loop = False  # self-stalls are judged in the training loop and while sampling only
        self._published_at = 0.0
        self._warned_stall = False
        self._progress = time.monotonic()
        self._state = "running"
        self._beat = 0
        # whether failure records may go to run_dir (parallel/lifecycle/runtime.py: not once another run took
        # a training run's directory over)
        self.may_write = lambda: True
        self.memory = None  # a training run's parallel/lifecycle/memory.py HostMemoryWatch, asked every tick
        self._exit_lock = threading.Lock()
        self._exiting = (
            False  # set once: by the thread when it ends the process, or by the main thread's error path
        )
        self._held = threading.Event()  # the main thread is handling an exception and asks for a verdict
        self.verdict: str | None = None
        self._verdict_ready = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._peers: dict[int, tuple[int, float, dict]] = {}  # rank -> (beat, seconds silent, payload)
        self._peers_checked: float | None = None  # when _check_peers last ran
        self._ticked: float | None = None  # when the last tick began
        self._store_failing_since: float | None = None
        self.watched = [(rank + i) % world_size for i in range(1, min(world_size, WATCHED_PEERS + 1))]
        self._thread = threading.Thread(target=self._run, name="tessera-watchdog", daemon=True)

    # ------------------------------------------------------------------------------------------
    # The main thread's side.

    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def begin_step(self, step: int, long: bool = False) -> None:
        """Step number `step` (counted from 1, as in metrics.jsonl and step_<N>) begins; `long` gives it
        the long deadline (the first step: compile, warm-up)."""
        self.step, self._long_step, self._in_loop, self.sampling = step, long, True, None
        self.mark("data")

    def sampling_progress(self, done: int, total: int) -> None:
        """`done` of `total` denoising steps are complete (0: sampling begins). Each step gets the stall
        deadline, the first one the long deadline (compile, warm-up); after the last comes the VAE decode
        (long deadline). During training (previews) the phase stays `preview`."""
        self.sampling, self._in_loop, self._sampled_all = (min(done + 1, total), total), True, done >= total
        self.mark("preview" if self.step is not None else "sampling" if done < total else "decode")
        self._wake.set()  # publish the new step now (at most every PUBLISH_EVERY_S)

    def mark(self, phase: str) -> None:
        """The main thread made progress and is now in `phase`."""
        changed, self.phase = phase != self.phase, phase
        self._progress = time.monotonic()
        if changed:
            # publish the new phase now (at most every PUBLISH_EVERY_S), not at the next beat
            self._wake.set()

    def end_loop(self) -> None:
        """Training is over: what follows (wandb, shutdown) has no step deadline."""
        self._in_loop = False
        self.mark("finishing")

    @property
    def deadline(self) -> float:
        if self.phase == "checkpoint":
            return self.deadlines.save_s
        if self.sampling is not None and self.phase in ("sampling", "preview") and not self._sampled_all:
            return self.deadlines.long_s if self.sampling[0] <= 1 else self.deadlines.stall_s
        if self._long_step or self.phase == "preview" or not self._in_loop or self.sampling is not None:
            return self.deadlines.long_s
        return self.deadlines.stall_s

    def finish(self, state: str = "finished") -> None:
        """This rank leaves on purpose (done, stopped, failed): its silence from now on is no alarm."""
        self._state = state
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._publish_quietly()  # the store may be gone (its host lost): leaving must not raise
        if state == "finished" and not self._exiting:  # a run that ended well: its store stays for the others
            self.outlast_peers(min(self.deadlines.silence_s, 10.0))

    def leave(self, state: str) -> None:
        """This rank is about to exit on a verdict: publish it, so no other rank takes its silence for a
        death (best effort: the store may be gone)."""
        self._state = state
        self._publish_quietly()

    def report_failure(self, error: BaseException) -> str:
        """This rank is about to exit with `error`: tell the others first, so they stop waiting for it.
        Returns the `error:` line for this rank to print."""
        self._exiting = True
        reason = f"rank {self.rank} ({self.host}:{self.pid}) failed {self._where()}: {one_line(error)}"
        self._claim_abort(reason)
        self._state = "failed"
        try:
            self._publish()
        except Exception:
            pass
        return self._line(reason)

    def explain(self, error: BaseException) -> str | None:
        """The main thread caught `error` from a collective: wait (at most the silence deadline and a
        little) for the cause: a reason another rank published, or a rank that went silent. For a stop
        signal (torchrun stopping the survivors, Ctrl-C) a published reason or a heartbeat that stopped
        within a few beats is looked for. Returns the `error:` line to print, or None if no other rank
        is to blame."""
        if self.store is None:  # one process: nobody else to blame
            return None
        self._held.set()
        if isinstance(error, (Terminated, KeyboardInterrupt)):
            reason = self._stopped_peer(wait_s=3 * self.interval)
            return self._line(reason) if reason else None
        deadline = time.monotonic() + self.deadlines.silence_s + 3 * self.interval + 1
        while time.monotonic() < deadline and self._thread.is_alive():
            if self._verdict_ready.wait(timeout=self.interval):
                return self.verdict
        reason = self._read_abort() or self._compare_everyone(own_error=error)
        return self._line(reason) if reason else None

    # ------------------------------------------------------------------------------------------
    # The thread.

    def _run(self) -> None:
        next_tick = time.monotonic() + self.interval
        while not self._stop.is_set():
            if self._wake.wait(timeout=max(0.0, next_tick - time.monotonic())):
                self._wake.clear()
                if self.store is not None and time.monotonic() < next_tick:
                    time.sleep(max(0.0, self._published_at + PUBLISH_EVERY_S - time.monotonic()))
                    self._publish_quietly()
                    continue
            next_tick = time.monotonic() + self.interval
            try:
                self._tick()
            except Exception as e:  # the watchdog must never take a healthy run down
                print(f"[rank {self.rank}] watchdog: {one_line(e)}", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        if self._exiting and not self._held.is_set():
            return
        started = time.monotonic()
        away = self._ticked is not None and started - self._ticked > self.away_cap()
        self._ticked = started
        self._beat += 1
        try:
            self._publish()
            if away or time.monotonic() - started > self.away_cap():
                # this process did not run for a while (suspended, frozen): its own stall starts afresh
                # (its peers' silence is judged on the time it ran: heartbeat.py _check_peers)
                self._progress = time.monotonic()
            reason = self._read_abort() or self._check_peers()
            self._store_failing_since = None
        except Exception as e:  # the store is gone with its host (rank 0 or the first node's agent), or slow
            now = time.monotonic()
            self._store_failing_since = self._store_failing_since or now
            closed = any(word in str(e).lower() for word in STORE_CLOSED_WORDS)  # no server: no point waiting
            if not closed and now - self._store_failing_since < self.deadlines.silence_s:
                return
            reason = self.store_gone(e)
        if reason is None:
            reason = self._check_self()
        if reason is None and self.memory is not None and not self._exiting:
            found = self.memory.check(self.step)
            reason = found and f"rank {self.rank} ({self.host}:{self.pid}) stopped: {found}"
        if reason is not None:
            self._conclude(reason)

    def _check_self(self) -> str | None:
        """No progress for longer than the deadline: stalled outside a collective (judged in the training
        loop and while sampling, where every step marks progress), or waiting in one (judged always).
        Outside those phases long work of one rank, such as reading weights or encoding latents, has no
        progress marks; a peer that dies meanwhile is still found by its silence."""
        age = time.monotonic() - max(self._progress, self.comm.last_activity)
        waiting = self.comm.blocked_in()
        deadline = (
            self.deadlines.save_s if waiting is not None and waiting.group in FENCE_GROUPS else self.deadline
        )
        if self._exiting or self._held.is_set() or age <= deadline:
            self._warned_stall = self._warned_stall and age > deadline
            return None
        if waiting is None:  # not waiting in a collective: this rank itself is stuck
            if self._warned_stall or not self._in_loop:
                return None
            stacks = self._dump_stacks()
            message = (
                f"rank {self.rank} ({self.host}:{self.pid}) made no progress for {age:.0f} s "
                f"{self._where()} outside any collective; its threads' stacks are in {stacks}"
            )
            if self.store is None:  # one process: nobody waits for it, so warn and let it go on
                self._warned_stall = True
                print(f"[tessera] warning: {message}", file=sys.stderr, flush=True)
                return None
            return message
        # Inside a collective: give a stalled peer's own watchdog the first word (it writes its stacks).
        if age > deadline + self.deadlines.silence_s and self.store is not None:
            return self._compare_everyone(waited_s=deadline)
        return None

    def _compare_everyone(
        self, own_error: BaseException | None = None, waited_s: float | None = None
    ) -> str | None:
        """Read every rank's heartbeat once and name the ranks that are not where this one waits."""
        beats = self._read_all()
        waiting = {r: b for r, b in beats.items() if b.get("open")}
        elsewhere = {
            r: b for r, b in beats.items() if not b.get("open") and b["state"] == "running" and r != self.rank
        }
        if (
            elsewhere and self.comm.blocked_in() is not None
        ):  # only a rank that waits in a collective may blame
            r, b = min(elsewhere.items())
            return (
                f"rank {r} ({b['host']}:{b['pid']}) is not in the collective the others wait in: it is "
                f"{where(b)}, {b['age']:.0f} s after its last progress"
            )
        ops = {r: (b["seq"], b["op"][0], b["op"][1]) for r, b in waiting.items() if b.get("op")}
        if len(set(ops.values())) > 1:
            described = "; ".join(
                f"rank {r} in {kind} on {group} (seq {seq})" for r, (seq, kind, group) in sorted(ops.items())
            )
            return (
                f"the ranks wait in different collectives ({described}): one rank issued a collective "
                "the others did not"
            )
        if own_error is None and ops and len(waiting) == len(beats):
            seq, kind, group = next(iter(ops.values()))
            waited = self.deadline if waited_s is None else waited_s
            return (
                f"every rank has waited in {kind} on {group} (seq {seq}) for over {waited:.0f} s. {NCCL_HINT}"
            )
        return None

    def _conclude(self, reason: str) -> None:
        """Publish `reason` (the first one written wins), then end this process, or hand the verdict to
        the main thread if it is already handling an exception."""
        winner = self._claim_abort(reason)
        if _FAILED.match(winner) and not self._held.is_set():
            # Another rank's error, e.g. a refusal every rank raises at once: let this rank's main thread
            # reach its own copy of it first, so each rank prints the error itself.
            time.sleep(2 * self.interval)
        line = self._line(winner)
        if self._held.is_set():
            self.verdict = line
            self._verdict_ready.set()
            self._stop.set()
            return
        with self._exit_lock:
            if self._exiting:
                return
            self._exiting = True
        print_line(line)
        if winner.startswith(f"rank {self.rank} (") and not _FAILED.match(winner):
            # the others named this rank (not in their collective, or silent): where is it?
            self._dump_stacks()
        self.dump(winner)
        if not winner.startswith("the rendezvous store"):  # no store to tell (a call would wait its timeout)
            self.leave("failed" if winner.startswith(f"rank {self.rank} (") else "stopped")
        hard_exit(1, self.backend)

    # ------------------------------------------------------------------------------------------
    # Messages, dumps and the store.

    def _where(self) -> str:
        return where({"step": self.step, "phase": self.phase, "sampling": self.sampling})

    def _line(self, reason: str) -> str:
        op = self.comm.blocked_in()
        if op is not None:
            here = f"this rank (rank {self.rank}) waited in {op.kind} on {op.group} (seq {op.seq})"
        else:
            here = f"this rank (rank {self.rank}) was {self._where()}"
        if reason.startswith(f"rank {self.rank} ("):
            here = f"this is rank {self.rank}"
        resume = f"latest checkpoint: {latest_checkpoint(self.run_dir)}; " if self.task == "train" else ""
        return f"error: {reason}; {here}; {resume}details: python scripts/diagnose.py {self.run_dir}"

    def dump(self, reason: str) -> str:
        """failures/comm_rank<R>.json: the recent ops, where this rank is, and every rank's heartbeat.
        Returns the path, or why nothing was written (it never raises: a full disk is a common cause)."""
        if not self._may_write():
            return LOST_DIRECTORY
        try:
            beats = self._read_all() if self.store is not None else {}
        except Exception:
            beats = {}
        dump_nccl_trace(self.run_dir / "failures", self.rank, self.backend)
        return self.comm.dump_safely(
            self.run_dir / "failures",
            self.rank,
            reason,
            host=self.host,
            step=self.step,
            phase=self.phase,
            heartbeats={str(r): b for r, b in beats.items()},
        )

    def _dump_stacks(self) -> str:
        """Every thread's stack in failures/stacks_rank<R>.txt; returns the path, or why it could not be
        written (a full disk must not stop the report)."""
        path = self.run_dir / "failures" / f"stacks_rank{self.rank}.txt"
        if not self._may_write():
            return LOST_DIRECTORY
        frames = sys._current_frames()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rank {self.rank} ({self.host}:{self.pid}) {self._where()}, {time.ctime()}\n\n")
                for thread in threading.enumerate():  # named, the main thread first
                    if thread.ident in frames:
                        f.write(f"--- thread {thread.name} (most recent call last) ---\n")
                        f.write("".join(traceback.format_stack(frames[thread.ident])) + "\n")
                f.write("--- faulthandler, every thread (most recent call first) ---\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            return f"nowhere: {path} could not be written ({e.strerror or e})"
        return str(path)

    def _may_write(self) -> bool:
        try:
            return self.may_write()
        except Exception:  # a failure report must never fail on this question
            return True

    def _payload(self) -> dict:
        waiting = self.comm.blocked_in()
        op = waiting or self.comm.last_record()
        return {
            "beat": self._beat,
            "state": self._state,
            "step": self.step,
            "phase": self.phase,
            "sampling": self.sampling,
            "deadline": self.deadline,
            "age": time.monotonic() - max(self._progress, self.comm.last_activity),
            "seq": op.seq if op else 0,
            "op": [op.kind, op.group, list(op.shape)] if op else None,
            "open": waiting is not None,
            "host": self.host,
            "pid": self.pid,
            "time": time.time(),
        }
