"""One live training run per run directory: `run.lock` in run.output_dir names the process that trains there.

Rank 0 takes the lock before anything is written; a live holder is refused by name. A lock whose holder is
gone is taken over, saying so: on this machine (hostname, boot and pid namespace) when its process is gone;
on any when its heartbeat (rewritten every LOCK_BEAT_S) stays unchanged while watched, two beats at least,
LOCK_STALE_S at most (clocks are never compared). A run that lost its lock while it was frozen never writes
there again: a missing lock is not a held lock, every write asks first (RunLock.ensure_held; the other ranks
ask `holds` with rank 0's token), and the heartbeat writes only through the file its process created, so a
woken run cannot put its lock back over its successor's (docs/failures.md has the whole story and the one
order left open). infer.py and the scripts only read a run: they never take the lock.
"""

import json
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path

LOCK_NAME = "run.lock"
LOCK_BEAT_S = 5.0  # the holder rewrites its lock this often
LOCK_STALE_S = 30.0  # a lock silent this long has no live holder
RECORD_BYTES = 1024  # the record is padded to a fixed length: a beat rewrites it in place, whole


def _timing() -> tuple[float, float]:
    """(beat, stale) seconds: the defaults, or TESSERA_LOCK_S="<beat>,<stale>" (the tests' short watch)."""
    spec = os.environ.get("TESSERA_LOCK_S")
    if not spec:
        return LOCK_BEAT_S, LOCK_STALE_S
    beat, stale = (float(x) for x in spec.split(","))
    return beat, stale


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
        record = json.loads(path.read_text())
        return (record if isinstance(record, dict) else None), mtime
    except FileNotFoundError:
        return None, None
    except IsADirectoryError as e:
        raise RunDirectoryInUse(_not_a_file(path)) from e
    except (OSError, ValueError, UnicodeDecodeError):
        return None, mtime


def _not_a_file(path: Path) -> str:
    return (
        f"{path} is a folder, not a lock file: tessera writes that name itself while a run trains. Move or "
        "remove the folder (nothing of tessera's is in it), or give this run another run.output_dir"
    )


def _encode(record: dict) -> bytes:
    """The record as JSON padded with spaces to a multiple of RECORD_BYTES: every beat is the same length,
    so a reader sees the old record or the new one, never a shorter file."""
    text = json.dumps(record).encode()
    return text + b" " * (-len(text) % RECORD_BYTES)


def holds(run_dir, token: str) -> bool:
    """Whether the lock of `run_dir` still names `token` (the other ranks of the run that rank 0's lock
    stands for ask this before they write there). A lock being rewritten this instant (unreadable) counts
    as held; a missing one does not, unless this run's rank 0 gave it back itself (its tombstone is there:
    the other ranks may still be writing their failure records as the run ends)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        holder, mtime = _read(path) if _present(path) else (None, None)
    except RunDirectoryInUse:
        return False
    except OSError:  # the file system did not answer (EIO, ESTALE): no sign of a loss, as for rank 0
        return True
    if mtime is None:
        return _tombstone(path, token).exists()
    return holder is None or holder.get("token") == token


def owns(lock, run_dir, token: str | None) -> bool:
    """Whether a run still owns its directory: rank 0 asks its `lock`; another rank reads the lock file with
    rank 0's `token`; a run that takes no lock (sampling, the scripts) always does."""
    if lock is not None:
        return lock.lost is None and lock.held()
    return token is None or run_dir is None or holds(run_dir, token)


def _present(path: Path) -> bool:
    """Whether the lock file exists, asked twice a quarter second apart when it is missing: a take-over
    racing another moves it aside for an instant (_move_aside), which is no loss."""
    if path.exists():
        return True
    time.sleep(0.25)
    return path.exists()


def _tombstone(path: Path, token: str) -> Path:
    """Where release() leaves the lock it gave back (removed by the next run's acquire)."""
    return path.with_name(f"{LOCK_NAME}.{token}.released")


class RunLock:
    """The lock of the run directory `run_dir`, for this process. acquire() takes it (or refuses), a daemon
    thread keeps its heartbeat, release() gives it back; held() says whether it still names this process."""

    def __init__(self, run_dir, beat_s: float | None = None, stale_s: float | None = None):
        self.path = Path(run_dir) / LOCK_NAME
        default_beat, default_stale = _timing()
        self.beat_s = default_beat if beat_s is None else beat_s
        self.stale_s = default_stale if stale_s is None else stale_s
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
        self._fd: int | None = None  # the lock file this process created: its beats go through it alone
        self._inode: tuple | None = None  # (device, inode) of that file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str:
        return self.record["token"]

    # ------------------------------------------------------------------------------------------
    # Taking and giving back.

    def acquire(self, say=print) -> None:
        """Take the lock, or raise RunDirectoryInUse naming its live holder. `say` prints the take-over of a
        lock whose holder is gone."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # each round either creates the lock or removes one whose holder is gone
            if self._create():
                for released in self.path.parent.glob(f"{LOCK_NAME}.*.released"):  # earlier runs' (holds)
                    released.unlink(missing_ok=True)
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
        """Give the lock back (if it still names this process); the heartbeat stops. The lock is moved
        aside, to a tombstone the run's other ranks recognise (holds), and put back if it turns out to be
        another run's: a run frozen between a check and an unlink would otherwise remove its successor's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.lost is None and self.held():
            self._move_aside(self.record, _tombstone(self.path, self.token))
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def held(self) -> bool:
        """Whether the lock file still names this process: it exists, and it is the file this process
        created (or, read, it holds this process's token). A missing lock is not held."""
        return self._holder()[0]

    def _holder(self) -> tuple[bool, dict | None]:
        """(held, the record found: None if the lock is missing or unreadable). Only a definite answer
        counts as a loss: the lock is missing, is another file with another token, or is not a file; a file
        system that does not answer (EIO, ESTALE on a network mount) or a record being rewritten this instant
        in this process's own file shows no loss."""
        try:
            found = self.path.stat() if _present(self.path) else None
        except OSError:
            return True, None
        if found is None:
            return False, None
        if not stat.S_ISREG(found.st_mode):
            return False, None
        holder, mtime = _read(self.path)
        if mtime is None:  # removed between the two calls
            return False, None
        if holder is not None:
            return holder.get("token") == self.token, holder
        return (found.st_dev, found.st_ino) == self._inode, None

    def ensure_held(self) -> None:
        """Raise RunDirectoryInUse unless the lock still names this process: another run took it over (this
        one was silent for LOCK_STALE_S: stopped, or frozen), or it is gone (taken over, then released by
        a run that finished). Either way the directory is not this run's any more: it must not write there."""
        held, holder = self._holder()
        if held and self.lost is None:
            return
        self.lost = self.lost or holder or {"host": "(removed: released by the run that took it over)"}
        raise RunDirectoryInUse(self.lost_message())

    def lost_message(self) -> str:
        holder = self.lost or {}
        whom = (
            f"to {_describe(holder)}"
            if holder.get("token")
            else "(its lock is gone: another run took it over and has finished, or it was removed)"
        )
        return (
            f"this run lost {self.path} {whom} while it was silent for over {self.stale_s:.0f} s (stopped, "
            "suspended or frozen); it stops without writing anything more there, so that the two runs' "
            "files do not mix. The run that took it over owns the directory: see its checkpoints and "
            "metrics.jsonl, and run the same command to go on from its latest checkpoint"
        )

    # ------------------------------------------------------------------------------------------
    # Inside.

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except IsADirectoryError as e:
            raise RunDirectoryInUse(_not_a_file(self.path)) from e
        os.write(fd, _encode(self.record))
        os.fsync(fd)
        stat = os.fstat(fd)
        self._fd, self._inode = fd, (stat.st_dev, stat.st_ino)
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

    def _move_aside(self, holder: dict | None, keep: Path | None = None) -> bool:
        """Remove the lock judged gone (or, to `keep`, this process's own at release), unless another
        process replaced it meanwhile (it is then put back). True: removed."""
        aside = self.path.with_name(f"{LOCK_NAME}.{self.record['token']}.stale")  # a neutral name first
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        except IsADirectoryError as e:
            raise RunDirectoryInUse(_not_a_file(self.path)) from e
        moved, _ = _read(aside)
        if holder is not None and (moved or {}).get("token") != holder.get("token"):
            try:  # a newer holder's lock: give it back (link: never over a lock made since)
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            return False
        if keep is None:
            aside.unlink()
        else:  # now known to be this process's own: the tombstone the run's other ranks recognise
            os.replace(aside, keep)
        return True

    def _beat(self) -> None:
        """Rewrite the record in place through the file this process created, every beat_s: never through
        the path, so a beat cannot replace another run's lock. Stops at the first beat that finds the lock
        not this process's (missing, or another token): ensure_held then refuses every write."""
        while not self._stop.wait(self.beat_s):
            held, holder = self._holder()
            if not held:
                self.lost = holder or {"host": "(removed: released by the run that took it over)"}
                return
            self.record["beat"] += 1
            try:  # fsync: a network file system's client would hold the write back for up to 30 s, and a
                # start on another host watching the lock for 11 s would take a live run for a dead one
                os.pwrite(self._fd, _encode(self.record), 0)
                os.fsync(self._fd)
            except (OSError, TypeError):  # a full disk must not stop training here; the checkpoint names it
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
