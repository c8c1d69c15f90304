"""Checkpoint faults: a kill at each point of a save, damaged shards refused by name, and the four ways
of naming a checkpoint. The reference for every resume is a straight run of the same recipe."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import infer
import train
from configs.rundir import read_metrics
from parallel.checkpoints import checkpoint, checkpoint_files, checkpoint_reading
from parallel.checkpoints.checkpoint import FAULT_POINTS
from tests.conftest import ROOT, TINY, ranks, run_main

pytestmark = pytest.mark.slow

COMMON = ["--config", str(TINY), "train.max_steps=4", "train.checkpoint_every=2"]  # checkpoints at 2 and 4


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}  # a step logged twice: the later one


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert run_main(train, COMMON + [f"run.output_dir={run_dir}"]) == 0
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """`python train.py` killed (SIGKILL, from TESSERA_FAULT) at each point of the step-4 save; the three
    run side by side. {point: (run_dir, exit code, output)}."""
    base = tmp_path_factory.mktemp("killed")
    procs = {}
    try:
        for point in FAULT_POINTS:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULT": f"save_{point}:4"}
            procs[point] = subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *COMMON, f"run.output_dir={base / point}"],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        results, deadline = {}, time.monotonic() + 240  # one bound for the three: a hang fails, not stalls
        for point, proc in procs.items():
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[point] = (base / point, proc.returncode, output)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_kill_during_a_save_loses_nothing_beyond_the_previous_checkpoint(straight, killed, point, capfd):
    run_dir, code, output = killed[point]
    assert code == -signal.SIGKILL, output[-3000:]
    assert f"[fault] rank 0: save_{point} in step 4" in output
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step_2\n"
    # the temporary folder carries the run's lock token (.step_4.<token>.tmp): two runs never share one
    temporary = list(root.glob(".step_4.*.tmp"))
    leftover = temporary[0] if point != "after_rename" and len(temporary) == 1 else root / "step_4"
    assert leftover.is_dir()  # what the kill interrupted is still there for the next save to handle
    assert checkpoint_files.find_latest(run_dir) == root / "step_2"
    checkpoint_reading.verify_checkpoint(root / "step_2")  # every file as it was written

    assert run_main(train, COMMON + [f"run.output_dir={run_dir}"]) == 0
    assert f"resumed from {root / 'step_2'} at step 2" in capfd.readouterr().out
    assert losses(run_dir) == losses(straight)  # bit for bit
    assert (root / "latest").read_text() == "step_4\n"
    checkpoint_reading.verify_checkpoint(root / "step_4")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_4"]  # no leftovers


def test_a_resave_killed_between_its_renames_keeps_the_old_copy(straight, tmp_path):
    """Re-saving step N moves the old step_N aside as .step_N.old before renaming the new one in; a
    kill between the two renames leaves `latest` naming step_N, found under its hidden name."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    root = run_dir / "checkpoints"
    (root / "step_4").rename(root / ".step_4.old")
    (root / ".step_4.tmp").mkdir()  # the new copy, unfinished
    assert checkpoint_files.find_latest(run_dir) == root / ".step_4.old"
    checkpoint_reading.verify_checkpoint(root / ".step_4.old")
    assert checkpoint_reading.read_trainer_state(root / ".step_4.old")["step"] == 4


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2 :]
    else:  # the same size, eight bytes flipped in the middle
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(data)


def never_called(*args, **kwargs):
    raise AssertionError("weights were read from a damaged checkpoint")


@pytest.mark.parametrize(
    "how, message",
    [("truncated", "__0_0.distcp is truncated ("), ("corrupt", "__0_0.distcp is corrupt (crc32 ")],
)
def test_a_damaged_shard_is_refused_by_name_before_any_weight_is_read(
    straight, tmp_path, monkeypatch, capfd, how, message
):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    root = run_dir / "checkpoints"
    damage(root / "step_4" / "__0_0.distcp", how)
    monkeypatch.setattr(checkpoint, "_load", never_called)
    resume = COMMON[:2] + [f"run.output_dir={run_dir}", "train.max_steps=6", "train.checkpoint_every=2"]
    assert run_main(train, resume) == 2
    err = capfd.readouterr().err
    assert f"error: checkpoint {root / 'step_4'} is damaged" in err and message in err, err
    assert f"the previous complete checkpoint is {root / 'step_2'}: resume from it with train.resume=" in err
    sample = COMMON[:2] + [f"run.output_dir={run_dir}", "--steps", "1", "--output", str(tmp_path / "x.npy")]
    assert run_main(infer, sample) == 2  # sampling checks every file too
    err = capfd.readouterr().err
    assert message in err and f"infer.py --checkpoint {root / 'step_2'}" in err, err
    assert not (tmp_path / "x.npy").exists()
    if how == "corrupt":  # the suggestion works: it continues from step 2 as a straight run does
        monkeypatch.undo()
        assert run_main(train, resume[:-2] + ["train.max_steps=4", f"train.resume={root / 'step_2'}"]) == 0
        assert losses(run_dir) == losses(straight)


def test_the_ranks_split_the_reading_and_share_the_verdict(straight, tmp_path):
    """Two processes check a checkpoint written by one: each file is read by one rank (the shard by rank 0,
    .metadata and trainer_rank0.pt by rank 1), and a corrupt .metadata, which only rank 1 read, is
    refused by both, by name."""
    run_dir = tmp_path / "damaged"
    shutil.copytree(straight / "checkpoints", run_dir / "checkpoints")
    damage(run_dir / "checkpoints" / "step_4" / ".metadata", "corrupt")
    result = ranks(
        2,
        "tests/checkpoint_worker.py",
        str(straight / "checkpoints" / "step_4"),
        str(run_dir / "checkpoints" / "step_4"),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "rank 0: run: read ['__0_0.distcp']: ok" in out, out
    assert "rank 1: run: read ['.metadata', 'trainer_rank0.pt']: ok" in out, out
    for rank in (0, 1):
        line = next(line for line in out.splitlines() if line.startswith(f"rank {rank}: damaged:"))
        assert ": refused: checkpoint " in line and ".metadata is corrupt (crc32 " in line, line
        assert (
            "__0_0.distcp is" not in line and f"train.resume={run_dir / 'checkpoints' / 'step_2'}" in line
        ), line


def test_a_checkpoint_is_named_by_its_folder_its_pointer_its_checkpoints_folder_or_its_run(
    straight, tmp_path, capfd
):
    root = straight / "checkpoints"
    for spec in (root / "step_4", root / "latest", root, straight):
        assert checkpoint_files.resolve_checkpoint(str(spec), tmp_path) == root / "step_4", spec
    assert checkpoint_files.resolve_checkpoint("auto", straight) == root / "step_4"
    assert checkpoint_files.resolve_checkpoint("none", straight) is None
    assert checkpoint_files.resolve_checkpoint("auto", tmp_path) is None  # nothing there yet: a fresh start
    with pytest.raises(checkpoint_files.CheckpointError, match="not a complete tessera checkpoint folder"):
        checkpoint_files.resolve_checkpoint(str(tmp_path), tmp_path)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(checkpoint_files.CheckpointError, match="is not a tessera `latest` pointer"):
        checkpoint_files.resolve_checkpoint(str(tmp_path / "notes.txt"), tmp_path)

    # From the command line: the pointer the README describes, and a run directory to resume from.
    out = tmp_path / "v.npy"
    sample = COMMON[:2] + [f"run.output_dir={tmp_path / 'elsewhere'}", "--steps", "1", "--output"]
    assert run_main(infer, sample + [str(out), "--checkpoint", str(root / "latest")]) == 0
    assert run_main(infer, sample + [str(tmp_path / "w.npy"), "--checkpoint", str(root / "step_4")]) == 0
    assert np.array_equal(np.load(out), np.load(tmp_path / "w.npy"))
    capfd.readouterr()
    assert (
        run_main(
            train,
            COMMON + [f"run.output_dir={tmp_path / 'next'}", "train.max_steps=4", f"train.resume={straight}"],
        )
        == 0
    )
    assert f"resumed from {root / 'step_4'} at step 4" in capfd.readouterr().out
