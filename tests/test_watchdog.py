"""The watchdog's decisions in one process, on an in-memory store, driven tick by tick: who is named
when a rank goes silent, fails or stalls (the multi-process runs are in tests/test_failures.py)."""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from parallel.compute import comm
from parallel.lifecycle import entrypoint, exits
from parallel.lifecycle.preemption import StopRequest, Terminated
from parallel.lifecycle.watchdog import Deadlines, Watchdog


def pair(tmp_path, silence=0.3, stall=0.5):
    store = dist.HashStore()
    dogs = [
        Watchdog(
            r, 2, store, tmp_path, Deadlines(long_s=5, stall_s=stall, silence_s=silence), interval_s=0.05
        )
        for r in (0, 1)
    ]
    for dog in dogs:
        dog._held.set()  # verdicts go to .verdict instead of ending this (pytest's) process
        dog._publish()
    return dogs


def test_a_silent_rank_is_named_with_its_step_and_phase(tmp_path):
    survivor, silent = pair(tmp_path)
    silent.begin_step(74)
    silent.mark("backward")
    silent._tick()  # its last heartbeat: step 74, backward; then nothing
    survivor._tick()
    assert survivor.verdict is None
    time.sleep(0.4)
    survivor._tick()
    assert (
        "error: rank 1 (" in survivor.verdict
        and "stopped responding at step 74 (phase: backward)" in survivor.verdict
    )
    assert "latest checkpoint: none yet" in survivor.verdict


def test_a_rank_that_keeps_beating_is_not_named(tmp_path):
    survivor, peer = pair(tmp_path)
    for _ in range(8):
        peer._tick()
        survivor._tick()
        time.sleep(0.05)
    assert survivor.verdict is None and peer.verdict is None


def test_a_failed_rank_is_named_by_the_others_with_its_reason(tmp_path):
    survivor, failing = pair(tmp_path)
    failing.begin_step(3)
    line = failing.report_failure(ValueError("bad manifest line 7"))
    assert line.startswith("error: rank 1 (") and "this is rank 1" in line
    survivor._tick()
    assert (
        "rank 1 (" in survivor.verdict
        and "failed at step 3 (phase: data): ValueError: bad manifest line 7" in survivor.verdict
    )
    # the first reason published stands: a later one does not replace it
    assert survivor._claim_abort("something else") == failing._claim_abort("another") != "something else"


def test_a_rank_stuck_outside_collectives_names_itself_and_writes_its_stacks(tmp_path):
    stuck, _ = pair(tmp_path)
    stuck.begin_step(5)
    stuck._long_step = False
    time.sleep(0.6)
    stuck._held.clear()  # the main thread is not handling an exception: this is a stall
    reasons = []
    stuck._conclude = reasons.append  # keep the verdict instead of ending the process
    stuck._tick()
    assert (
        reasons
        and "rank 0 (" in reasons[0]
        and "made no progress" in reasons[0]
        and "step 5 (phase: data)" in reasons[0]
    )
    stacks = (tmp_path / "failures" / "stacks_rank0.txt").read_text()
    assert "--- thread MainThread" in stacks and "test_watchdog.py" in stacks


def test_ranks_in_different_collectives_are_named(tmp_path):
    a, b = pair(tmp_path)
    a._publish()
    payload = b._payload()
    payload.update(open=True, seq=20, op=["all_reduce", "world", [3]])
    a.store.set("hb/1", __import__("json").dumps(payload))
    with comm.recorded("all_gather", None, torch.zeros(4), log=a.comm):  # rank 0 waits in an all-gather
        a.comm.last_record().seq = 20
        a._publish()
        reason = a._compare_everyone()
    assert "the ranks wait in different collectives" in reason
    assert (
        "rank 0 in all_gather on world (seq 20)" in reason
        and "rank 1 in all_reduce on world (seq 20)" in reason
    )


def test_error_messages_and_peer_errors():
    wrapped = ValueError(
        "Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
        'last):\n  File "x.py", line 1\ndata.dataset.DataError: 3 samples in a row could not be loaded'
    )
    assert exits.error_message(wrapped) == "3 samples in a row could not be loaded"
    assert exits.is_peer_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert exits.is_peer_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not exits.is_peer_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_in_the_loop_only_sets_the_flag(signum):
    import signal

    request = StopRequest()
    request.DEFER_S = 0.2
    restore = request.install()
    try:
        start = time.monotonic()
        with pytest.raises(Terminated):  # start-up: nothing to save, stop (SIGTERM: after DEFER_S)
            request.handler(getattr(signal, signum), None)
            assert signum == "SIGTERM"  # deferred: this rank may still reach its own error line first
            time.sleep(5)  # the signal comes again after DEFER_S and interrupts the sleep
        assert time.monotonic() - start < 2
        request._deferred, request.signum = None, 0
        request.accepting = True
        request.handler(getattr(signal, signum), None)
        assert request.signum == getattr(signal, signum)
        request.handler(
            getattr(signal, signum), None
        )  # torchrun's forwarded copy, right after: no second request
        request.received_at -= 10
        with pytest.raises(Terminated):  # a second request seconds later: stop at once
            request.handler(getattr(signal, signum), None)
    finally:
        restore()


def test_a_stop_signal_while_a_failure_is_reported_is_only_noted():
    """torchrun's SIGTERM follows another rank's failure within milliseconds: it must not pre-empt the
    `error:` line this rank is about to print (run_entrypoint holds signals from its first exception)."""
    import signal

    request = StopRequest()
    restore = request.install()
    try:
        request.hold()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            request.handler(signum, None)  # no exception
        assert request.signum == signal.SIGTERM
    finally:
        restore()


def test_one_process_that_stalls_only_warns(tmp_path, capsys):
    alone = Watchdog(0, 1, None, tmp_path, Deadlines(long_s=5, stall_s=0.2, silence_s=0.3), interval_s=0.05)
    alone.begin_step(2)
    alone._long_step = False
    time.sleep(0.3)
    alone._conclude = lambda reason: pytest.fail(f"a single process was ended: {reason}")
    alone._tick()
    assert (
        "warning: rank 0 (" in capsys.readouterr().err
        and (tmp_path / "failures" / "stacks_rank0.txt").is_file()
    )
    alone._tick()  # once per stall
    assert "warning" not in capsys.readouterr().err


def test_outside_the_training_loop_there_is_no_step_deadline(tmp_path):
    a, b = pair(tmp_path, stall=0.1)
    time.sleep(0.3)
    a._held.clear()
    a._conclude = lambda reason: pytest.fail(f"start-up work was called a stall: {reason}")
    a._tick()  # start-up: one rank may encode or load for long
    assert a._compare_everyone(own_error=RuntimeError("x")) is None  # not in a collective: blames nobody


def test_a_rank_stopped_by_torchrun_names_the_rank_whose_heartbeat_stopped(tmp_path):
    """torchrun sends SIGTERM to every rank when one died: the survivor names the rank whose heartbeat
    stopped advancing (a killed rank publishes no reason), and blames nobody when every rank beats."""
    survivor, dead = pair(tmp_path)
    dead.begin_step(7)
    dead._tick()  # its last heartbeat
    survivor._held.clear()
    assert "rank 1 (" in survivor._stopped_peer(
        wait_s=0.2
    ) and "at step 7 (phase: data)" in survivor._stopped_peer(wait_s=0.2)
    beating = threading.Event()

    def beat():
        while not beating.is_set():  # its heartbeat thread alive (publishing only: no verdicts of its own)
            dead._beat += 1
            dead._publish()
            time.sleep(0.02)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        assert survivor._stopped_peer(wait_s=0.2) is None  # a user's stop: every rank alive
    finally:
        beating.set()
        thread.join()


def test_sampling_steps_have_deadlines_and_are_named(tmp_path):
    dog, _ = pair(tmp_path, stall=0.5)
    dog.sampling_progress(0, 8)
    assert (
        dog.deadline == 5 and dog._where() == "during sampling (step 1 of 8)"
    )  # the first: compile, warm-up
    dog.sampling_progress(2, 8)
    assert dog.deadline == 0.5 and dog._where() == "during sampling (step 3 of 8)"
    dog.sampling_progress(8, 8)
    assert dog.deadline == 5 and dog._where() == "during sampling (decode, after step 8)"
    assert "latest checkpoint: " in dog._line("x")  # training: the checkpoint to resume from
    dog.task = "sample"  # infer.py: no checkpoints to talk about
    assert "checkpoint" not in dog._line("rank 1 (h:1) stopped responding during sampling (step 3 of 8)")
    trainer, _ = pair(tmp_path)
    trainer.begin_step(40)
    trainer.sampling_progress(2, 30)  # a preview
    assert trainer._where() == "at step 40 (phase: preview, sampling step 3 of 30)"
    trainer._long_step = False
    assert trainer.deadline == 0.5  # a later denoising step of a preview
    trainer.sampling_progress(30, 30)
    assert trainer.deadline == 5  # its VAE decode and the writing: parallel.timeout_s


def test_a_wait_in_a_fence_is_judged_against_the_control_timeout(tmp_path):
    """A rank whose replica is done waits in a gloo fence while another replica samples on: not a stall
    after the step deadline, only after parallel.control_timeout_s (Deadlines.save_s)."""
    waiting, _ = pair(tmp_path, stall=0.1)
    waiting.deadlines = Deadlines(long_s=0.1, stall_s=0.1, silence_s=0.1, save_s=30)
    waiting.sampling_progress(8, 8)
    waiting.mark("finishing")
    waiting._held.clear()
    waiting._conclude = lambda reason: pytest.fail(f"a fence wait was called a stall: {reason}")
    with comm.recorded("barrier", None, None, log=waiting.comm) as record:
        record.group = "control"
        time.sleep(0.3)
        waiting._tick()


def test_a_stalled_sampling_step_is_named(tmp_path):
    stuck, _ = pair(tmp_path, stall=0.2)
    stuck.sampling_progress(3, 8)
    time.sleep(0.4)
    stuck._held.clear()
    reasons = []
    stuck._conclude = reasons.append
    stuck._tick()
    assert reasons and "made no progress" in reasons[0] and "during sampling (step 4 of 8)" in reasons[0]


def test_a_phase_change_is_published_at_once(tmp_path):
    store = dist.HashStore()
    dog = Watchdog(0, 2, store, tmp_path, Deadlines(long_s=5, stall_s=1, silence_s=10))  # beats every 1 s
    dog.start()
    try:
        time.sleep(0.3)
        dog.mark("backward")
        time.sleep(0.3)
        assert json.loads(store.get("hb/0"))["phase"] == "backward"
    finally:
        dog.finish()


@pytest.mark.slow  # the benchmark's tiny run starts processes
@pytest.mark.timeout(120)
def test_bench_watchdog_runs():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_watchdog.py"), "--calls", "5"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stop-flag exchange per step" in result.stdout and "a phase published at once" in result.stdout


def test_a_broken_collective_is_a_stop_only_outside_the_loop(tmp_path, capsys, monkeypatch):
    """A preemption signal pending in the training loop must not turn this rank's failed collective into a
    silent 'stopped' (no error line, no checkpoint said missing); a stop during start-up, which reached a
    peer first, must not be reported as a failure."""
    import signal

    monitor, _ = pair(tmp_path)
    session = entrypoint.Session()
    session.watchdog, session.run_dir, session.comm = monitor, tmp_path, monitor.comm
    monkeypatch.setattr(entrypoint, "hard_exit", lambda code, backend: pytest.fail("hard_exit"))
    broken = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    request = session.stop
    request.signum = signal.SIGTERM
    request.accepting = True  # in the loop: agreed at the step boundary, not yet
    assert entrypoint._report_failure(broken, 0, session) == 1
    err = capsys.readouterr().err
    assert "error: rank 0 (" in err and "failed" in err and "Connection closed by peer" in err, err
    monitor2, peer = pair(tmp_path / "again")
    peer.leave("stopped")  # the peer left on the stop signal, which broke this rank's collective
    session.watchdog = monitor2
    request.accepting = False  # start-up
    assert entrypoint._report_failure(broken, 0, session) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "[rank 0] stopped: received SIGTERM" in err and "error:" not in err, err


class SlowStore:
    """A store whose writes take `delay_s` (a loaded rendezvous host): the watchdog's ticks run long."""

    def __init__(self, store, delay_s: float):
        self.store, self.delay_s = store, delay_s

    def set(self, key, value):
        time.sleep(self.delay_s)
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_slow_tick_is_no_suspension_and_a_dead_peer_is_still_named(tmp_path):
    """The thread judges a suspended process (it woke far later than it asked: a job resumed after
    SIGSTOP) by its wait alone: a tick made slow by the store must not count as one, or every slow tick
    would wipe the peers' silence and a dead rank would never be named."""
    store = dist.HashStore()
    deadlines = Deadlines(long_s=5, stall_s=5, silence_s=1.0)
    survivor = Watchdog(0, 2, SlowStore(store, 0.9), tmp_path, deadlines, interval_s=0.2)
    dead = Watchdog(1, 2, store, tmp_path, deadlines, interval_s=0.2)
    survivor._held.set()
    dead._publish()  # its one heartbeat, then nothing
    survivor.start()
    try:
        assert survivor._verdict_ready.wait(timeout=15), "the dead rank was never named"
    finally:
        survivor.finish()
    assert "rank 1 (" in survivor.verdict and "stopped responding" in survivor.verdict, survivor.verdict
