"""Heartbeats and a shared abort, outside the collectives; stop requests agreed at a step boundary.

A collective cannot say who is missing: a rank waiting in one learns only, when its timeout expires,
that somebody did not come. So every rank runs a small thread that, each second and at each phase
change (at most every PUBLISH_EVERY_S), publishes its progress (step, phase, the comm layer's op in
flight) on the c10d store torchrun already runs, a channel that no training collective depends on, and
watches three things:

- a few peers' heartbeats: a rank silent for `parallel.heartbeat_timeout_s` is gone (killed, stopped,
  its host lost). On NCCL this is the only way to learn it: a dead peer resets no socket.
- its own main thread: no progress (no phase change, no comm op) for longer than the phase's deadline
  while outside any collective is a stall. It writes every thread's stack to failures/ and tells the
  others. A rank that has waited inside one collective that long compares every rank's heartbeat: the
  ranks that are elsewhere, or waiting in another collective, are named.
- the shared abort key: the first reason written there (a rank that failed, a silent or stalled rank,
  ranks waiting in different collectives) ends every rank within about a second, each printing one
  `error:` line that names the rank, the step, the phase and the op this rank waited in.

Deadlines: `parallel.timeout_s` through start-up, the first training step and the first denoising step
(compile), and a VAE decode; `parallel.stall_timeout_s` for every later training or denoising step;
`parallel.control_timeout_s` for a checkpoint and for a wait in a gloo fence (other ranks' long work).

Stop signals: SIGTERM, SIGUSR1 or SIGINT during training only sets a flag (`StopRequest`); the train
loop exchanges it once per step on the gloo control group, so every rank stops after the same step,
saves a checkpoint and exits. Outside the loop a signal stops the process (SIGTERM after a short
delay), and while a failure is being reported signals are only noted: see StopRequest.
"""

import faulthandler
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from parallel import comm, startup

WATCHED_PEERS = 4  # each rank watches the next few ranks: O(1) store reads per rank, whatever the world size
PUBLISH_EVERY_S = 0.25  # a phase change is published at once, but no more often than this (store load)
# Groups whose waits may last as long as other ranks' long work (their timeout is parallel.control_timeout_s):
# a rank waiting there is judged against that, not against the step's deadline.
FENCE_GROUPS = ("control", "replica-control")


@dataclass(frozen=True)
class Deadlines:
    long_s: float  # the first step (compile, warm-up) and previews
    stall_s: float  # every later step
    silence_s: float  # a rank whose heartbeat thread says nothing for this long is gone
    save_s: float = 1800.0  # a checkpoint save (slow storage; the control group's timeout)

    def describe(self) -> str:
        return (
            f"deadlines: {self.long_s:.0f} s for the first step, the first denoising step and a VAE decode "
            f"(parallel.timeout_s); {self.save_s:.0f} s for a checkpoint or a wait for other ranks' long work "
            f"(parallel.control_timeout_s); {self.stall_s:.0f} s for a later step or denoising step "
            f"(parallel.stall_timeout_s); {self.silence_s:.0f} s of silence from a rank "
            f"(parallel.heartbeat_timeout_s)"
        )


# Errors that mean "a collective failed", most often because of another rank: the watchdog is asked
# who, before anything is printed. (Not plain "timed out": a DataLoader timeout is this rank's own.)
PEER_ERROR_WORDS = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "gloo",
    "nccl",
)
_FAILED = re.compile(r"rank \d+ \([^)]*\) failed ")  # a reason report_failure published
# A store call that failed this way found no server: the store's host process is gone (not slow).
STORE_CLOSED_WORDS = (
    "broken pipe",
    "connection reset",
    "connection refused",
    "got 0 bytes",
    "connection was likely closed",
)


class Watchdog:
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
    ):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.run_dir = Path(run_dir)
        self.deadlines, self.backend = deadlines, backend
        self.task = task  # train | sample | encode: only training has checkpoints to name
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
        self._exit_lock = threading.Lock()
        self._exiting = (
            False  # set once: by the thread when it ends the process, or by the main thread's error path
        )
        self._held = threading.Event()  # the main thread is handling an exception and asks for a verdict
        self.verdict: str | None = None
        self._verdict_ready = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._peers: dict[int, tuple[int, float, dict]] = {}  # rank -> (beat, when it last changed, payload)
        self._store_failing_since: float | None = None
        self.watched = [(rank + i) % world_size for i in range(1, min(world_size, WATCHED_PEERS + 1))]
        self._thread = threading.Thread(target=self._run, name="tessera-watchdog", daemon=True)

    # ------------------------------------------------------------------------------------------
    # The main thread's side.

    def start(self) -> "Watchdog":
        global _active
        _active = self
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
            self._wake.set()  # publish the new phase now (at most every PUBLISH_EVERY_S), not at the next beat

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
        global _active
        self._state = state
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._publish_quietly()  # the store may be gone (its host lost): leaving must not raise
        if _active is self:
            _active = None

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

    def peers_stopped(self) -> bool:
        """Whether another rank left on a stop signal (its state `stopped`): a collective that fails then is
        a user's stop reaching the ranks at different moments, not a failure."""
        try:
            return any(b["state"] == "stopped" for r, b in self._read_all().items() if r != self.rank)
        except Exception:
            return False

    def _stopped_peer(self, wait_s: float) -> str | None:
        """torchrun stopped this rank, which it does to every rank when one failed or died: the reason a
        failed rank published, or a rank whose heartbeat did not advance for `wait_s` while every live
        rank beats each interval (a killed rank publishes nothing). None: nobody failed."""
        try:
            before, deadline = self._read_all(), time.monotonic() + wait_s
            while time.monotonic() < deadline:
                reason = self._read_abort()
                if reason:
                    return reason
                time.sleep(self.interval / 2)
            reason, after = self._read_abort(), self._read_all()
        except Exception as e:  # the store went with its host
            return self._store_gone(e)
        if reason:
            return reason
        frozen = [
            (beat.get("time", 0.0), r, beat)
            for r, beat in after.items()
            if r != self.rank and beat["state"] == "running" and before.get(r, {}).get("beat") == beat["beat"]
        ]
        if not frozen:
            return None
        _, r, beat = min(frozen)  # the heartbeat that stopped first
        return (
            f"rank {r} ({beat['host']}:{beat['pid']}) stopped responding {_where(beat)}: its heartbeat "
            f"stopped (killed, or its host lost), and torchrun then stopped the other ranks"
        )

    @staticmethod
    def _store_gone(error: BaseException) -> str:
        host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
        return (
            f"the rendezvous store at {host}:{port} stopped answering ({one_line(error)}); it runs in "
            f"the torchrun agent of the first node (or in rank 0): that node or process is gone"
        )

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
        self._beat += 1
        try:
            self._publish()
            reason = self._read_abort() or self._check_peers()
            self._store_failing_since = None
        except Exception as e:  # the store is gone with its host (rank 0 or the first node's agent), or slow
            now = time.monotonic()
            self._store_failing_since = self._store_failing_since or now
            closed = any(word in str(e).lower() for word in STORE_CLOSED_WORDS)  # no server: no point waiting
            if not closed and now - self._store_failing_since < self.deadlines.silence_s:
                return
            reason = self._store_gone(e)
        if reason is None:
            reason = self._check_self()
        if reason is not None:
            self._conclude(reason)

    def _check_peers(self) -> str | None:
        """A watched peer whose heartbeat has not changed for the silence deadline."""
        now = time.monotonic()
        keys = [f"hb/{r}" for r in self.watched]
        present = [r for r, k in zip(self.watched, keys) if self.store.check([k])]
        if not present:
            return None
        for r, raw in zip(present, self.store.multi_get([f"hb/{r}" for r in present])):
            beat = json.loads(raw)
            seen = self._peers.get(r)
            if seen is None or seen[0] != beat["beat"]:
                self._peers[r] = (beat["beat"], now, beat)
            elif beat["state"] == "running" and now - seen[1] > self.deadlines.silence_s:
                return (
                    f"rank {r} ({beat['host']}:{beat['pid']}) stopped responding {_where(beat)}: its "
                    f"heartbeat has been silent for {now - seen[1]:.0f} s (killed, stopped or its host lost)"
                )
        return None

    def _check_self(self) -> str | None:
        """No progress for longer than the deadline: stalled outside a collective (judged in the training
        loop and while sampling, where every step marks progress), or waiting in one (judged always).
        Outside those phases long work of one rank, such as reading weights or encoding latents, has no
        progress marks; a peer that dies meanwhile is still found by its silence."""
        age = time.monotonic() - max(self._progress, comm.last_activity())
        waiting = comm.blocked_in()
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
        if elsewhere and comm.blocked_in() is not None:  # only a rank that waits in a collective may blame
            r, b = min(elsewhere.items())
            return (
                f"rank {r} ({b['host']}:{b['pid']}) is not in the collective the others wait in: it is "
                f"{_where(b)}, {b['age']:.0f} s after its last progress"
            )
        ops = {r: (b["seq"], b["op"][0], b["op"][1]) for r, b in waiting.items() if b.get("op")}
        if len(set(ops.values())) > 1:
            described = "; ".join(
                f"rank {r} in {kind} on {group} (seq {seq})" for r, (seq, kind, group) in sorted(ops.items())
            )
            return f"the ranks wait in different collectives ({described}): one rank issued a collective the others did not"
        if own_error is None and ops and len(waiting) == len(beats):
            seq, kind, group = next(iter(ops.values()))
            from parallel.runtime import NCCL_HINT

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
            self._dump_stacks()  # the others named this rank (not in their collective, or silent): where is it?
        self.dump(winner)
        if not winner.startswith("the rendezvous store"):  # no store to tell (a call would wait its timeout)
            self.leave("failed" if winner.startswith(f"rank {self.rank} (") else "stopped")
        hard_exit(1, self.backend)

    # ------------------------------------------------------------------------------------------
    # Messages, dumps and the store.

    def _where(self) -> str:
        return _where({"step": self.step, "phase": self.phase, "sampling": self.sampling})

    def _line(self, reason: str) -> str:
        op = comm.blocked_in()
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
        try:
            beats = self._read_all() if self.store is not None else {}
        except Exception:
            beats = {}
        dump_nccl_trace(self.run_dir / "failures", self.rank, self.backend)
        return comm.dump_records_safely(
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

    def _payload(self) -> dict:
        waiting = comm.blocked_in()
        op = waiting or comm.last_record()
        return {
            "beat": self._beat,
            "state": self._state,
            "step": self.step,
            "phase": self.phase,
            "sampling": self.sampling,
            "deadline": self.deadline,
            "age": time.monotonic() - max(self._progress, comm.last_activity()),
            "seq": op.seq if op else 0,
            "op": [op.kind, op.group, list(op.shape)] if op else None,
            "open": waiting is not None,
            "host": self.host,
            "pid": self.pid,
            "time": time.time(),
        }

    def _publish(self) -> None:
        if self.store is not None:
            self._published_at = time.monotonic()
            self.store.set(f"hb/{self.rank}", json.dumps(self._payload()))

    def _publish_quietly(self) -> None:
        try:
            self._publish()
        except Exception:  # the next beat reports a store that stays unreachable
            pass

    def _read_all(self) -> dict[int, dict]:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        present = [r for r, k in zip(range(self.world_size), keys) if self.store.check([k])]
        return {r: json.loads(v) for r, v in zip(present, self.store.multi_get([f"hb/{r}" for r in present]))}

    def _read_abort(self) -> str | None:
        if self.store is None or not self.store.check(["abort"]):
            return None
        return self.store.get("abort").decode()

    def _claim_abort(self, reason: str) -> str:
        """Write `reason` unless another rank's is there already; return the one that stands."""
        if self.store is None:
            return reason
        try:
            return self.store.compare_set("abort", "", reason).decode() or reason
        except Exception:
            return reason


_active: Watchdog | None = None


def active() -> Watchdog | None:
    """The running watchdog of this process, if any (run_entrypoint asks it about failures)."""
    return _active


def _where(beat: dict) -> str:
    """Where a rank is, for messages: 'at step 5 (phase: forward)', 'during sampling (step 3 of 30)',
    'at step 200 (phase: preview, sampling step 3 of 30)', 'at start-up (phase: ...)'."""
    step, phase, sampling = beat.get("step"), beat.get("phase"), beat.get("sampling")
    if step is None and sampling:
        k, n = sampling
        return (
            f"during sampling ({f'step {k} of {n}' if phase == 'sampling' else f'{phase}, after step {n}'})"
        )
    if step is None:
        return f"at start-up (phase: {phase})"
    return f"at step {step} (phase: {phase}{f', sampling step {sampling[0]} of {sampling[1]}' if sampling else ''})"


def error_message(error: BaseException) -> str:
    """The message of `error`; for one re-raised from a DataLoader worker, the worker's own error
    (its last line) rather than the wrapper and the worker's traceback."""
    message = str(error)
    if "Original Traceback" in message:
        last = [line for line in message.splitlines() if line.strip()][-1]
        return re.sub(r"^[\w.]*(Error|Exception): ", "", last)
    return message


def one_line(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error_message(error)}".split())
    return text if len(text) <= 400 else text[:397] + "..."


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is a failed collective or store call, likely caused by another rank."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in PEER_ERROR_WORDS)


def latest_checkpoint(run_dir) -> str:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    try:
        return str(pointer.parent / pointer.read_text().strip())
    except OSError:
        return "none yet (this run starts from scratch again)"


def dump_nccl_trace(folder: Path, rank: int, backend: str) -> None:
    """On NCCL, PyTorch's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE, set by the runtime) holds
    every collective of every group with its state: write it beside the comm layer's records."""
    if backend != "nccl":
        return
    try:
        import torch

        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace  # renamed in 2.x
        (Path(folder) / f"nccl_trace_rank{rank}.pkl").write_bytes(dump())
    except Exception:
        pass


def print_line(line: str) -> None:
    """An error line on a line of its own: a progress bar's unfinished line (tqdm) is ended first, and the
    bars are silenced so that closing them later does not draw them again below the error. Ranks share
    one terminal and only rank 0 draws a bar, so the other ranks start their line with a newline."""
    bars = []
    try:
        from tqdm import tqdm

        bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not bar.disable]
        for bar in bars:
            bar.disable = True
    except Exception:
        pass
    others_bar = int(os.environ.get("WORLD_SIZE", 1)) > 1 and int(os.environ.get("RANK", 0)) != 0
    print(("\n" if bars or others_bar else "") + line, file=sys.stderr, flush=True)


def hard_exit(code: int, backend: str) -> None:
    """End the process now, from any thread, with its child processes (DataLoader workers). The main
    thread may be blocked inside a collective: on NCCL the communicators are aborted first so that no
    kernel stays blocked on the GPU; on gloo the process exit closes the sockets, which wakes the peers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:  # DataLoader workers ignore stop signals (their parent owns them) and would outlive it by seconds
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
    except Exception:
        pass
    if backend == "nccl":
        threading.Timer(10.0, os._exit, args=(code,)).start()  # an abort that hangs must not keep us here
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception:
            pass
    os._exit(code)


# ---------------------------------------------------------------------------------------------------
# Stop requests (preemption).


class StopRequest:
    """SIGTERM / SIGUSR1 / SIGINT while training: remember the signal and let the train loop stop after
    the step it is in, with a checkpoint. Outside the loop a signal stops the process: SIGINT (Ctrl-C) at
    once, SIGTERM after DEFER_S, because torchrun sends SIGTERM to every rank when one of them failed,
    and a rank that is about to reach the same refusal, or to learn which rank failed, must print that
    first. A second signal more than a few seconds after the first stops at once: the user insists.
    While a failure is being reported (`hold`), signals are only noted: nothing pre-empts the error line."""

    SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGUSR1", "SIGINT")) if s)
    INSIST_AFTER_S = (
        3.0  # torchrun forwards the signal it got: the copy arriving right after is no second request
    )
    DEFER_S = 5.0  # SIGTERM outside the training loop: the time left to reach this rank's own error line

    def __init__(self):
        self.accepting = False
        self.held = False
        self.signum = 0
        self.received_at = 0.0
        self.received_in_step: int | None = None
        self._deferred: threading.Timer | None = None
        self._redelivering = False

    def handler(self, signum, frame):
        now = time.monotonic()
        if self._redelivering:  # the deferred SIGTERM, sent again to the main thread after DEFER_S
            self._redelivering = False
            if self.held or self.accepting:  # reporting a failure, or the loop (it stops after this step)
                return
            raise Terminated(signum)
        if self.held:
            self.signum = self.signum or signum
            return
        if self.accepting and (not self.signum or now - self.received_at < self.INSIST_AFTER_S):
            if not self.signum:  # no message here: torchrun also sends SIGTERM when another rank died
                self.signum, self.received_at = signum, now
                self.received_in_step = _active.step if _active is not None else None
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM and self._deferred is None and not self.accepting:
            self.signum, self.received_at = signum, now
            # The signal comes again to the main thread after DEFER_S (a real signal interrupts a sleep or
            # a gloo wait) and this handler then raises. (On NCCL the main thread may be blocked in a CUDA
            # wait, where no Python handler runs: a peer that died is named by the watchdog thread.)
            self._deferred = threading.Timer(self.DEFER_S, self._redeliver, args=(signum,))
            self._deferred.daemon = True
            self._deferred.start()
            return
        raise Terminated(signum)

    def _redeliver(self, signum: int) -> None:
        self._redelivering = True
        signal.pthread_kill(threading.main_thread().ident, signum)

    def hold(self) -> None:
        """A failure is being reported: from now on stop signals are noted, never raised."""
        self.held = True
        self._stop_deferral()

    def _stop_deferral(self) -> None:
        """Cancel the deferred SIGTERM and wait for its thread: once this returns it cannot arrive."""
        if self._deferred is not None:
            self._deferred.cancel()
            if self._deferred is not threading.current_thread():
                self._deferred.join()

    def install(self):
        self.accepting, self.held, self.signum, self.received_at, self.received_in_step = (
            False,
            False,
            0,
            0.0,
            None,
        )
        self._deferred, self._redelivering = None, False
        previous = {s: signal.signal(s, self.handler) for s in self.SIGNALS}
        # startup.py's handler only bridged the imports: after the run a SIGTERM ends the process again
        previous = {s: signal.SIG_DFL if h is startup.note else h for s, h in previous.items()}
        if startup.take_noted():  # a SIGTERM during the imports: deferred from now, as if it came now
            self.handler(signal.SIGTERM, None)

        def restore():
            self._stop_deferral()
            for s, h in previous.items():
                signal.signal(s, h)

        return restore


class Terminated(BaseException):
    """A stop signal outside the training loop, e.g. torchrun stopping the survivors after a rank failed."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


class Stopped(BaseException):
    """The training loop stopped on request after saving; run_entrypoint exits with 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


stop_request = StopRequest()
