"""A run that is suspended (SIGSTOP: `scontrol suspend`, a hung network file system, a debugger) while a
requeue takes its directory over never writes there again when it wakes, whatever the order: stopped
between saves or in the middle of one, the new holder finished, still training or killed (and a third run
then taking over from it), one process or two ranks suspended together. Afterwards metrics.jsonl holds
each step once, every checkpoint is one run's (checksums.json names the run's lock token, and lists every
file), and the legitimate run ends as it would alone.

The lock's watch is shortened (TESSERA_LOCK_S: a beat of 1 s, silent for 3 s is gone) so that the requeue
takes over in seconds instead of 30. (bf7d40d, with these timings and the stop faults added, failed every
order: the woken run logged its steps again and moved `latest`, or died with a FileNotFoundError.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from configs.rundir import read_metrics
from configs.runlock import LOCK_NAME
from parallel.checkpoints.checkpoint_files import CHECKSUMS, unlisted_files
from tests.conftest import ROOT, TINY

LOCK_S = "1,3"
STEPS, EVERY = 24, 4


def _train(run_dir, *overrides, fault=""):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), f"run.output_dir={run_dir}",
           f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.keep_checkpoints=100",
           "train.sample_every=0", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_LOCK_S": LOCK_S, "TESSERA_FAULT": fault}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _token(run_dir, proc, timeout=120) -> str:
    """The token of the lock `proc` holds in `run_dir`, once it holds it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            record = json.loads((run_dir / LOCK_NAME).read_text())
            if record.get("pid") == proc.pid:
                return record["token"]
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"pid {proc.pid} never took the lock")


def _wait_stopped(proc, timeout=120) -> None:
    """Until `proc` is stopped (state T in /proc: it stopped itself at its fault)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError("the run never stopped at its fault")


def _end(*procs) -> None:
    """Whatever of `procs` still runs (a failed assertion's leftovers): woken and killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def _check_one_run(run_dir, legit, stale: str) -> None:
    """Each step logged once; every checkpoint whole and written by one run, the legitimate one's (`legit`:
    a token, or the tokens of the runs that held the directory after the stale one) at the end; `latest`
    the last step."""
    legit = {legit} if isinstance(legit, str) else set(legit)
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step_{STEPS}"
    for folder in sorted(root.glob("step_*")):
        listing = json.loads((folder / CHECKSUMS).read_text())
        assert not unlisted_files(folder), (folder, unlisted_files(folder))
        assert listing.get("run") in legit | {stale}, folder
        if int(folder.name.split("_")[1]) > EVERY:  # after the take-over: the new holders' only
            assert listing["run"] in legit, f"{folder} was written by the stopped run"
    assert not list(root.glob(".step_*")), list(root.iterdir())
    assert not (run_dir / LOCK_NAME).exists()


def _lost(out: str, ranks: int = 1) -> None:
    """The woken run's `error:` lines (one per rank at most) name the loss, with no traceback of a rank's
    (torchrun's agent prints its own ChildFailedError when a rank exits non-zero)."""
    errors = [
        line
        for line in out.splitlines()
        if line.lstrip().startswith(("error:", "[rank")) and "error:" in line
    ]
    assert errors and all("this run lost" in e and "writing anything more" in e for e in errors), out[-3000:]
    assert len(errors) <= ranks, out[-3000:]
    assert out.count("Traceback") == ("ChildFailedError" in out), out[-3000:]


# (the fault that stops run A itself; whether B has finished before A is continued)
ORDERS = [
    pytest.param("stop:6", True, id="stopped-between-saves-new-holder-finished"),
    pytest.param("save_before_shards_stop:8", False, id="stopped-as-a-save-starts-new-holder-running"),
    pytest.param("save_after_shards_stop:8", True, id="stopped-with-its-shards-written-new-holder-finished"),
    pytest.param("save_after_rename_stop:8", False, id="stopped-before-latest-moved-new-holder-running"),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, finished", ORDERS)
def test_a_suspended_run_writes_nothing_once_its_directory_is_taken_over(tmp_path, fault, finished):
    run_dir = tmp_path / "run"
    first = _train(run_dir, fault=fault)
    stale = _token(run_dir, first)
    _wait_stopped(first)
    second = _train(run_dir)  # the requeue: the same command
    try:
        legit = _token(run_dir, second)
        if finished:
            out_b, _ = second.communicate(timeout=180)
            assert second.returncode == 0, out_b[-3000:]
        else:  # wake the stopped run while the new holder trains
            while not (run_dir / "checkpoints" / f"step_{2 * EVERY + EVERY}").exists():
                assert second.poll() is None, second.stdout.read()[-3000:]
                time.sleep(0.05)
        first.send_signal(signal.SIGCONT)
        out_a, _ = first.communicate(timeout=120)
        if not finished:
            out_b, _ = second.communicate(timeout=180)
            assert second.returncode == 0, out_b[-3000:]
    finally:
        _end(first, second)
    assert "took over" in out_b, out_b[-3000:]
    _check_one_run(run_dir, legit, stale)
    assert first.returncode == 2, out_a[-3000:]
    _lost(out_a)
    assert not (run_dir / "failures").exists() or not list((run_dir / "failures").glob("*rank0*"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_suspended_run_wakes_after_its_successor_was_killed(tmp_path):
    """A stopped between saves; B takes over and is killed (SIGKILL) mid-run; A wakes: the lock names B,
    dead, and A writes nothing; C, the next requeue, takes B's dead lock over at once and finishes."""
    run_dir = tmp_path / "run"
    first = _train(run_dir, fault="stop:6")
    stale = _token(run_dir, first)
    _wait_stopped(first)
    second = _train(run_dir)
    try:
        killed = _token(run_dir, second)
        while not (run_dir / "checkpoints" / f"step_{3 * EVERY}").exists():
            assert second.poll() is None, second.stdout.read()[-3000:]
            time.sleep(0.05)
        second.kill()
        second.wait()
        first.send_signal(signal.SIGCONT)
        out_a, _ = first.communicate(timeout=120)
        assert first.returncode == 2, out_a[-3000:]
        _lost(out_a)
        third = _train(run_dir)
        legit = _token(run_dir, third)
        out_c, _ = third.communicate(timeout=180)
        assert third.returncode == 0 and "no longer exists" in out_c, out_c[-3000:]
    finally:
        _end(first, second)
    _check_one_run(run_dir, {killed, legit}, stale)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_suspended_ranks_write_nothing_once_their_directory_is_taken_over(tmp_path):
    """A job of two ranks (ulysses 2, torchrun) suspended together (its whole process group stopped, as
    `scontrol suspend` does); B, one process, takes over and finishes; A wakes: rank 0 names the loss, rank 1
    (which holds no lock: it asks with the token rank 0 shared) writes nothing either: no metrics, no
    shard, no failure record."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "--config", str(TINY), f"run.output_dir={run_dir}",
           f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.keep_checkpoints=100",
           "train.sample_every=0", "parallel.ulysses=2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_LOCK_S": LOCK_S}
    first = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stale = json.loads(_wait_for_lock(run_dir, first))["token"]
        while not any(m["step"] >= 6 for m in _metrics(run_dir)):
            assert first.poll() is None, first.stdout.read()[-3000:]
            time.sleep(0.05)
        _signal_tree(first.pid, signal.SIGSTOP)
        second = _train(run_dir)
        legit = _token(run_dir, second)
        out_b, _ = second.communicate(timeout=180)
        assert second.returncode == 0, out_b[-3000:]
        _signal_tree(first.pid, signal.SIGCONT)
        out_a, _ = first.communicate(timeout=120)
        assert first.returncode != 0, out_a[-3000:]
        _lost(out_a, ranks=2)
    finally:
        if first.poll() is None:
            _signal_tree(first.pid, signal.SIGCONT)
            _signal_tree(first.pid, signal.SIGKILL)
            first.wait()
    _check_one_run(run_dir, legit, stale)
    assert not (run_dir / "failures").exists() or not list((run_dir / "failures").iterdir())


def _signal_tree(pid: int, signum) -> None:
    """`signum` to torchrun's agent and every process below it (its ranks run in sessions of their own):
    what `scontrol suspend` does to a job."""
    from parallel.lifecycle.memory import children

    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children(tree[-1])
    for member in tree:
        try:
            os.kill(member, signum)
        except ProcessLookupError:
            pass


def _wait_for_lock(run_dir, proc, timeout=180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = (run_dir / LOCK_NAME).read_text()
            if json.loads(text).get("token"):
                return text
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError("the lock never appeared")


def _metrics(run_dir) -> list:
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):
        return []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_suspended_and_resumed_goes_on(tmp_path):
    """`scontrol suspend` and `resume` of a two-rank job, stopped for longer than the heartbeat's silence
    deadline (10 s) with nobody taking it over: it goes on and finishes (each rank's watchdog sees that it
    did not run itself, and judges its peers' silence afresh; bf7d40d named a rank dead on waking)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=12",
           "train.checkpoint_every=6", "train.sample_every=0", "parallel.ulysses=2"]  # fmt: skip
    job = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        while not any(m["step"] >= 3 for m in _metrics(run_dir)):
            assert job.poll() is None, job.stdout.read()[-3000:]
            time.sleep(0.05)
        _signal_tree(job.pid, signal.SIGSTOP)
        time.sleep(15)
        _signal_tree(job.pid, signal.SIGCONT)
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            _signal_tree(job.pid, signal.SIGCONT)
            _signal_tree(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, out[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 13))
