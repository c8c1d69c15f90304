"""One live training run per run directory: `run.lock` in run.output_dir names the process that trains there.

A second train.py started into a directory that a live run holds (a SLURM requeue while the old job still
runs, two users, one recipe) would delete the first run's temporary checkpoint folder, interleave
metrics.jsonl and overwrite config.yaml. So rank 0 takes the lock before anything is written, and a live
holder is refused by name. A lock whose holder is gone is taken over, saying so:

- on this machine (hostname, boot and pid namespace: containers may share a hostname): its process is gone;
- on any: its heartbeat (the file, rewritten every LOCK_BEAT_S) stays unchanged while watched, for at least
  two beats and at most LOCK_STALE_S (clocks are not compared: another host's, or the file server's, differ).

infer.py and the scripts only read a run: they never take the lock.
"""

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

LOCK_NAME = "run.lock"
LOCK_BEAT_S = 5.0  # the holder rewrites its lock this often
LOCK_STALE_S = 30.0  # a lock silent this long has no live holder


class RunDirectoryInUse(RuntimeError):
    """Another live run holds the run directory; the message names it and what to do."""


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux /proc), to tell a pid that was
    reused from the process that held the lock; None where /proc cannot say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _machine() -> str:
    """This machine and process namespace: the hostname, the kernel's boot id and the pid namespace. Two
    containers with host networking share a hostname, not pids: only the same machine may judge a pid."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.endswith("/pid") else Path(source).read_text().strip())
        except OSError:
            parts.append("?")
    return "/".join(parts)


def _process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return started is None or _process_start(pid) in (None, started)


def _read(path: Path) -> tuple[dict | None, float | None]:
    """(the lock's record or None if unreadable, its mtime or None if there is no file or no answer)."""
    mtime = None
    try:
        mtime = path.stat().st_mtime
        return json.loads(path.read_text()), mtime
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, mtime


class RunLock:
    """The lock of the run directory `run_dir`, for this process. acquire() takes it (or refuses), a daemon
    thread keeps its heartbeat, release() gives it back; held() says whether it still names this process."""

    def __init__(self, run_dir, beat_s: float = LOCK_BEAT_S, stale_s: float = LOCK_STALE_S):
        self.path = Path(run_dir) / LOCK_NAME
        self.beat_s, self.stale_s = beat_s, stale_s
        pid = os.getpid()
        self.record = {
            "host": socket.gethostname(),
            "machine": _machine(),
            "pid": pid,
            "process_start": _process_start(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": uuid.uuid4().hex,
            "beat": 0,
        }
        self.lost: dict | None = None  # the record that replaced ours, if another run took the lock over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------
    # Taking and giving back.

    def acquire(self, say=print) -> None:
        """Take the lock, or raise RunDirectoryInUse naming its live holder. `say` prints the take-over of a
        lock whose holder is gone."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # each round either creates the lock or removes one whose holder is gone
            if self._create():
                self._thread = threading.Thread(target=self._beat, name="tessera-run-lock", daemon=True)
                self._thread.start()
                return
            holder, mtime = _read(self.path)
            if mtime is None:  # released meanwhile
                continue
            if holder is None and time.time() - mtime < 2.0:  # being written this instant: read it again
                time.sleep(0.2)
                continue
            gone = self._gone(holder, mtime)
            if gone is None:
                raise RunDirectoryInUse(self._refusal(holder, mtime))
            if self._move_aside(holder):
                say(f"[tessera] took over {self.path}: {_describe(holder)}, {gone}")
        raise RunDirectoryInUse(f"{self.path} changed hands too often to take it: is another run starting?")

    def release(self) -> None:
        """Give the lock back (if it still names this process); the heartbeat stops."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.held():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def held(self) -> bool:
        holder, _ = _read(self.path)
        return holder is not None and holder.get("token") == self.record["token"]

    def ensure_held(self) -> None:
        """Raise RunDirectoryInUse if another run took the lock over (this one was silent for LOCK_STALE_S:
        stopped, or frozen): it must not write into the directory that run now uses."""
        holder = _read(self.path)[0]
        if self.lost is not None or (holder is not None and holder.get("token") != self.record["token"]):
            holder = self.lost or holder
            raise RunDirectoryInUse(
                f"this run lost {self.path} to {_describe(holder)} while it was silent for over "
                f"{self.stale_s:.0f} s (stopped or frozen); it stops without writing, so that the two runs' "
                "files do not mix"
            )

    # ------------------------------------------------------------------------------------------
    # Inside.

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _gone(self, holder: dict | None, mtime: float) -> str | None:
        """Why the lock's holder is gone, or None if it is alive."""
        if holder is None:  # left half-written by a kill (one being written was read again)
            return "the lock was unreadable"
        if holder.get("machine") == self.record["machine"]:  # the same machine and pid namespace
            if holder.get("pid") == self.record["pid"]:
                return "an earlier run of this same process"  # one run at a time per process
            if not _process_alive(holder.get("pid", -1), holder.get("process_start")):
                return f"its process {holder.get('pid')} no longer exists"
        # Alive, or another machine's: its heartbeat decides. The file's age, judged by our clock (which may
        # differ from the file server's or another host's), only shortens the watch: two beats always pass.
        age = max(0.0, time.time() - mtime)
        wait_s = min(self.stale_s, max(2 * self.beat_s + 1, self.stale_s - age))
        return self._unchanged_for(mtime, wait_s, holder)

    def _unchanged_for(self, mtime: float, wait_s: float, holder: dict) -> str | None:
        """Watch the lock for `wait_s`: None if it changes (its holder is alive), else why it is gone."""
        print(
            f"[tessera] {self.path} is held by {_describe(holder)}: watching its heartbeat for up to "
            f"{wait_s:.0f} s to see whether that run is alive",
            flush=True,
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(min(0.5, wait_s))
            now, now_mtime = _read(self.path)
            if now_mtime != mtime or (now or {}).get("beat") != holder.get("beat"):
                return None
        return f"its heartbeat did not change in {wait_s:.0f} s (the run is stopped, frozen or gone)"

    def _move_aside(self, holder: dict | None) -> bool:
        """Remove the lock judged gone, unless another process replaced it meanwhile (it is then put back).
        True: removed."""
        aside = self.path.with_name(f"{LOCK_NAME}.{self.record['token']}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved, _ = _read(aside)
        if holder is not None and (moved or {}).get("token") != holder.get("token"):
            try:  # a newer holder's lock: give it back (link: never over a lock made since)
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            return False
        aside.unlink()
        return True

    def _beat(self) -> None:
        misses = 0  # reads in a row that found no readable lock (a network file system's hiccup)
        while not self._stop.wait(self.beat_s):
            holder, _ = _read(self.path)
            misses = misses + 1 if holder is None else 0
            if misses >= 3 or (holder is not None and holder.get("token") != self.record["token"]):
                self.lost = holder or {"host": "(removed, or unreadable for 3 beats)", "pid": "?"}
                return
            if holder is None:
                continue
            self.record["beat"] += 1
            tmp = self.path.with_name(f"{LOCK_NAME}.{self.record['token']}.tmp")
            try:
                tmp.write_text(json.dumps(self.record))
                os.replace(tmp, self.path)
            except OSError:  # a full disk must not stop training here; the checkpoint save names it
                pass

    def _refusal(self, holder: dict, mtime: float) -> str:
        return (
            f"run.output_dir {self.path.parent} is in use by another training run: {_describe(holder)}, "
            f"its heartbeat {max(0.0, time.time() - mtime):.0f} s ago ({self.path}). Two runs in one "
            "directory would overwrite each other's checkpoints and logs: wait for that run to end or stop "
            "it, or give this run another run.output_dir (a lock whose run has died is taken over by the "
            "next start: its process gone on this machine, or its heartbeat stopped)"
        )


def _describe(holder: dict | None) -> str:
    if not holder:
        return "an unreadable lock"
    return f"host {holder.get('host')} pid {holder.get('pid')}, started {holder.get('started')}"


def live_holder(run_dir, stale_s: float = LOCK_STALE_S) -> dict | None:
    """The record of a lock in `run_dir` whose heartbeat is recent, read once without waiting (None: no
    such lock): infer.py leaves the failure records of a directory that a live run trains in alone."""
    holder, mtime = _read(Path(run_dir) / LOCK_NAME)
    return holder if mtime is not None and time.time() - mtime < stale_s else None
