"""One live training run per run directory (configs/runlock.py): a live holder is refused by name, a lock
whose holder is gone (dead process, silent heartbeat, another host that stopped beating) is taken over,
and two train.py started into one directory no longer destroy each other's work."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from configs.rundir import read_metrics
from configs.runlock import LOCK_NAME, RunDirectoryInUse, RunLock, _machine
from tests.conftest import ROOT, TINY


def write_lock(run_dir, host=None, pid=None, age_s=0.0, beat=0, machine=None):
    """A lock file as another process would have left it, its heartbeat `age_s` old (`machine`: this
    machine's identity when `host` is None, else another's)."""
    path = run_dir / LOCK_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    if machine is None:
        machine = _machine() if host is None else f"{host}/other-boot/other-ns"
    record = {"host": host or socket.gethostname(), "machine": machine, "pid": pid, "process_start": None}
    path.write_text(json.dumps(record | {"started": "earlier", "token": "theirs", "beat": beat}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@contextmanager
def beating(run_dir, **holder):
    """A live holder: its heartbeat changes every 0.1 s."""
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.wait(0.1):
            n += 1
            write_lock(run_dir, beat=n, **holder)

    write_lock(run_dir, **holder)
    thread = threading.Thread(target=beat)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture
def other_process():
    """A live process of this machine that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


FAST = dict(beat_s=0.2, stale_s=1.0)  # the watch of a silent lock: 1.4 s instead of 11-30 s


def test_a_live_holder_on_this_machine_is_refused_by_name(tmp_path, other_process):
    with beating(tmp_path, pid=other_process), pytest.raises(RunDirectoryInUse) as refused:
        RunLock(tmp_path, **FAST).acquire(say=lambda line: None)
    message = str(refused.value)
    assert f"pid {other_process}" in message and socket.gethostname() in message, message
    assert "run.output_dir" in message and "another training run" in message
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "theirs"  # left as it was


def test_a_lock_whose_process_died_is_taken_over_at_once_saying_so(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, pid=dead.pid)
    said, started = [], time.monotonic()
    lock = RunLock(tmp_path)  # the default watch (11-30 s) would show: a dead pid needs none
    lock.acquire(say=said.append)
    try:
        assert lock.held() and len(said) == 1 and time.monotonic() - started < 5
        assert f"pid {dead.pid}" in said[0] and "no longer exists" in said[0], said
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_live_process_whose_heartbeat_is_silent_is_taken_over(tmp_path, other_process):
    write_lock(tmp_path, pid=other_process, age_s=600)  # stopped (SIGSTOP) or frozen ten minutes ago
    said = []
    lock = RunLock(tmp_path, **FAST)
    lock.acquire(say=said.append)
    lock.release()
    assert "did not change" in said[-1] and f"pid {other_process}" in said[-1], said


def test_a_container_with_this_hostname_and_this_pid_is_not_this_process(tmp_path):
    """Containers with host networking share a hostname but not pids: a live run there, whose rank 0 has
    this very pid, is judged by its heartbeat, not taken for an earlier run of this process."""
    with beating(tmp_path, host=socket.gethostname(), pid=os.getpid(), machine="other-container"):
        with pytest.raises(RunDirectoryInUse, match=f"pid {os.getpid()}"):
            RunLock(tmp_path, **FAST).acquire(say=lambda line: None)


def test_another_host_is_watched_refused_while_it_beats_taken_over_once_silent(tmp_path):
    with (
        beating(tmp_path, host="elsewhere", pid=1),
        pytest.raises(RunDirectoryInUse, match="host elsewhere pid 1"),
    ):
        RunLock(tmp_path, **FAST).acquire(say=lambda line: None)
    # silent now: after the watch (two beats at least) it is taken over, however recent its clock says it is
    os.utime(tmp_path / LOCK_NAME, None)
    said, started = [], time.monotonic()
    lock = RunLock(tmp_path, **FAST)
    lock.acquire(say=said.append)
    lock.release()
    assert time.monotonic() - started >= 2 * 0.2 and "did not change" in said[-1], said


def test_a_lock_being_written_is_read_again_not_refused_as_unreadable(tmp_path, other_process):
    """Two starts at one moment: the second reads the first's lock before its bytes are in."""
    (tmp_path / LOCK_NAME).write_text("")

    def fill():
        time.sleep(0.3)
        write_lock(tmp_path, pid=other_process)

    writer = threading.Thread(target=fill)
    writer.start()
    with beating(tmp_path, pid=other_process), pytest.raises(RunDirectoryInUse, match=f"pid {other_process}"):
        RunLock(tmp_path, **FAST).acquire(say=lambda line: None)
    writer.join()


def test_the_holder_beats_and_learns_when_it_lost_the_lock(tmp_path):
    lock = RunLock(tmp_path, beat_s=0.05)
    lock.acquire()
    first = (tmp_path / LOCK_NAME).stat().st_mtime_ns
    time.sleep(0.3)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["beat"] >= 2
    assert (tmp_path / LOCK_NAME).stat().st_mtime_ns != first
    ours = (tmp_path / LOCK_NAME).read_text()
    (tmp_path / LOCK_NAME).write_text("{not json")  # a read that fails once (a network file system's hiccup)
    time.sleep(0.07)
    (tmp_path / LOCK_NAME).write_text(ours)
    time.sleep(0.2)
    lock.ensure_held()  # still ours: one bad read is no loss
    # taken over while this one was frozen: a successor's lock is a new file (O_EXCL, once the stale one is
    # moved aside), so this one's beats, through its own file, cannot write over it (in place they could,
    # between a beat's read and its write: the test failed so under load)
    (tmp_path / LOCK_NAME).unlink()
    write_lock(tmp_path, host="elsewhere", pid=7)
    time.sleep(0.2)
    with pytest.raises(RunDirectoryInUse, match="lost .* to host elsewhere pid 7"):
        lock.ensure_held()
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # the new holder's lock stays


def _train(run_dir, *overrides, env=None):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), f"run.output_dir={run_dir}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [*cmd, *overrides], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_run_into_a_training_directory_is_refused_and_the_first_loses_nothing(tmp_path):
    """What a SLURM requeue does while the old job still runs: today's main let the second run delete the
    first's temporary checkpoint folder and interleave metrics.jsonl. Now the second is refused by name
    before it writes anything, infer.py may still read the run, and the first ends as it would alone."""
    run_dir = tmp_path / "run"
    # every checkpoint kept: the one infer.py reads must not be rotated away meanwhile (at 2 steps apart)
    first = _train(
        run_dir, "train.max_steps=100000", "train.checkpoint_every=2", "train.keep_checkpoints=100000",
        "train.sample_every=0",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "latest").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
            time.sleep(0.2)
        config = (run_dir / "config.yaml").read_text()
        second = _train(run_dir, "train.max_steps=3", "train.resume=none")
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 2, out[-3000:]
        errors = [line for line in out.splitlines() if "error:" in line]
        assert len(errors) == 1 and f"pid {first.pid}" in errors[0], out[-3000:]
        assert "in use by another training run" in errors[0]
        sampled = subprocess.run(
            [sys.executable, str(ROOT / "infer.py"), "--config", str(TINY), f"run.output_dir={run_dir}",
             "--output", str(tmp_path / "live.npy"), "--steps", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert sampled.returncode == 0, sampled.stderr[-3000:]
        assert first.poll() is None, "the first run died"
        assert (run_dir / "config.yaml").read_text() == config
    finally:
        first.send_signal(signal.SIGTERM)  # it saves the step it is in and stops
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, steps[-1] + 1)), steps  # one run's steps, each once
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]}"
    assert not (run_dir / LOCK_NAME).exists()  # given back at the end


def test_a_missing_lock_is_not_a_held_lock(tmp_path):
    """Taken over while frozen, and released by the run that took it: no lock at all. bf7d40d counted a
    missing lock as held for three missed beats, and ensure_held passed: the woken run trained on."""
    lock = RunLock(tmp_path, beat_s=10)
    lock.acquire()
    (tmp_path / LOCK_NAME).unlink()
    with pytest.raises(RunDirectoryInUse, match="lost .*its lock is gone"):
        lock.ensure_held()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_beat_never_writes_over_the_lock_of_the_run_that_took_over(tmp_path, monkeypatch):
    """The heartbeat rewrites the file this process created, through its descriptor: a run frozen between
    reading its lock (still its own then) and beating cannot put its record back over its successor's.
    The frozen read is played by a _read that answers with this run's record once. (bf7d40d's beat
    replaced the path: the successor's lock was overwritten and it lost the directory to the stale run.)"""
    import configs.runlock as runlock

    lock = RunLock(tmp_path, beat_s=0.05)
    lock.acquire()
    path = tmp_path / LOCK_NAME
    theirs = tmp_path / "theirs"
    theirs.write_text(json.dumps({"host": "elsewhere", "pid": 7, "token": "theirs", "beat": 0}))
    real_read, stale = runlock._read, [dict(lock.record)]

    def read_before_the_freeze(p):
        found, mtime = real_read(p)
        return (stale.pop() if stale else found), mtime

    monkeypatch.setattr(runlock, "_read", read_before_the_freeze)
    os.replace(theirs, path)  # what a take-over leaves: another file under the name
    time.sleep(0.3)
    assert not stale  # the beat did read the frozen record
    assert json.loads(path.read_text())["token"] == "theirs"
    with pytest.raises(RunDirectoryInUse, match="to host elsewhere pid 7"):
        lock.ensure_held()
    lock.release()
    assert json.loads(path.read_text())["token"] == "theirs"  # release leaves it too


def test_a_lock_name_that_is_a_folder_is_refused_and_left_alone(tmp_path):
    """bf7d40d renamed the folder aside and took the lock, or failed with a traceback."""
    (tmp_path / LOCK_NAME).mkdir()
    (tmp_path / LOCK_NAME / "keep.txt").write_text("mine")
    with pytest.raises(RunDirectoryInUse, match="is a folder, not a lock file"):
        RunLock(tmp_path, **FAST).acquire(say=lambda line: None)
    assert (tmp_path / LOCK_NAME / "keep.txt").read_text() == "mine"


def test_a_file_system_that_does_not_answer_is_no_loss(tmp_path, monkeypatch):
    """ESTALE or EIO from a network mount while a rank asks: held, for the ranks that hold no lock too
    (they raised the OSError itself, even while writing their failure records)."""
    from pathlib import Path

    from configs.runlock import holds

    lock = RunLock(tmp_path, beat_s=10)
    lock.acquire()
    real = Path.exists

    def stale(path, *args, **kwargs):
        if path.name == LOCK_NAME:
            raise OSError(116, "Stale file handle")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", stale)
    assert holds(tmp_path, lock.token) and lock.held()
    monkeypatch.setattr(Path, "exists", real)
    lock.release()
    assert holds(tmp_path, lock.token)  # its tombstone: the run's other ranks still count as its
    assert not holds(tmp_path, "another run's token")
