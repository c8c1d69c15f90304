"""Everyday failures in one process (the multi-process ones are in tests/test_failures.py): a NaN at any
step never reaches a checkpoint, a full disk is named with the space it needs, a damaged weights file or
checkpoint is named before anything is loaded, a non-finite recipe number is refused by key. Each ends
with one `error:` line and exit code 2."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import infer
import train
from configs import load_config
from configs.rundir import read_metrics
from parallel.build.components import build_frozen, build_model
from parallel.checkpoints import checkpoint_files
from parallel.compute import comm
from parallel.lifecycle import storage
from tests.conftest import TINY, run_main

# checkpoint_every=3 and log_every=4 over 8 steps: saves at 3, 6, 8 (the end), logs at 4 and 8
RUN = ["--config", str(TINY), "train.max_steps=8", "train.checkpoint_every=3", "train.log_every=4"]


def first_error(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line or line.startswith("Traceback")]
    assert lines and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def latest_is_finite(run_dir: Path):
    """(the step `latest` names or None, whether every tensor of it is finite)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    latest = checkpoint_files.find_latest(run_dir)
    if latest is None:
        return None, True
    state = _load_state_dict_from_keys(checkpoint_id=str(latest))
    tensors = [t for t in storage.local_tensors(state) if t.is_floating_point()]
    return int(latest.name.split("_")[1]), all(bool(torch.isfinite(t).all()) for t in tensors)


# (the step whose loss is NaN, the step the run stops at): a checkpoint step, a log step or the last
# step, whichever comes first after it; "term" adds a preemption notice in the same step.
@pytest.mark.parametrize(
    "nan_at, stops_at, term",
    [
        (1, 3, False),
        (2, 3, False),
        (3, 3, False),
        (4, 4, False),
        (5, 6, False),
        (7, 8, False),
        (8, 8, False),
        (5, 5, True),
    ],
)
def test_a_nan_never_reaches_a_checkpoint(tmp_path, monkeypatch, capsys, nan_at, stops_at, term):
    fault = f"nan@0:{nan_at}" + (f",term@0:{nan_at}" if term else "")
    monkeypatch.setenv("TESSERA_FAULT", fault)
    run_dir = tmp_path / "run"
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}"]) == 2
    line = first_error(capsys.readouterr().err)
    assert f"the gradient norm was not finite at step {nan_at}; stopped at step {stops_at}" in line, line
    step, finite = latest_is_finite(run_dir)
    assert finite and (step is None or step < nan_at), (step, finite)
    good = checkpoint_files.find_latest(run_dir)
    assert (
        f"the last good checkpoint is {good}" if good else "no checkpoint was written before it"
    ) in line, line
    assert "train.lr (now 0.001)" in line and "train.on_nonfinite=skip" in line, line


def test_non_finite_weights_with_a_finite_gradient_are_not_saved(tmp_path, monkeypatch, capsys):
    """Weights that went non-finite while every gradient norm stayed finite (here the EMA, corrupted
    in step 2): the save itself finds them, on every rank alike, and refuses."""
    real = train.update_ema

    def corrupting(ema, model, decay):
        real(ema, model, decay)
        if getattr(corrupting, "calls", 0) == 1:
            next(ema.parameters()).to_local().fill_(float("inf"))
        corrupting.calls = getattr(corrupting, "calls", 0) + 1

    monkeypatch.setattr(train, "update_ema", corrupting)
    run_dir = tmp_path / "run"
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}"]) == 2
    line = first_error(capsys.readouterr().err)
    assert (
        "training diverged: refusing to save step 3: NaN or inf in 1 ema tensor; nothing was written" in line
    ), line
    assert "no checkpoint was written before it" in line and checkpoint_files.find_latest(run_dir) is None, (
        line
    )
    assert not list((run_dir / "checkpoints").glob("*step_3*"))


def test_skipping_non_finite_steps_keeps_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_FAULT", "nan@0:2,nan@0:5")
    run_dir = tmp_path / "run"
    assert (
        run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.on_nonfinite=skip", "train.log_every=1"])
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "step 2: the gradient norm is nan; step skipped" in err
        and "(train.on_nonfinite=skip; 2 so far)" in err
    )
    metrics = read_metrics(run_dir)
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 1, 2, 2, 2, 2]
    assert all(m["loss"] == m["loss"] for m in metrics if m["step"] not in (2, 5))  # NaN only where skipped
    assert latest_is_finite(run_dir) == (8, True)


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    """The figure stated is the one checked (the margin included, and said so); train.keep_checkpoints is
    suggested only when older checkpoints exist that a lower value would remove (a first save has none)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    real = shutil.disk_usage
    free = lambda n: monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=n))
    # the tensors' bytes, counted here: the model's and the EMA's state dicts, AdamW's two moments and a
    # step (a float32 scalar) per parameter
    cfg = load_config(TINY)
    model = build_model(cfg, *build_frozen(cfg, "cpu"), weights=False)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tensors = 2 * weights + sum(2 * p.numel() * p.element_size() + 4 for p in model.parameters())
    margin = int(0.02 * tensors) + (16 << 20)
    required = f"{(tensors + margin) / 1e6:.1f} MB required (the tensors' ~{tensors / 1e6:.1f} MB plus a "
    required += f"{margin / 1e6:.1f} MB margin for the metadata, checksums and trainer state)"

    free(tensors + margin - 1)  # more than the tensors alone, a byte short of what is checked
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=3"]) == 2
    line = first_error(capsys.readouterr().err)
    assert f"not enough space to save step 3 in {root}" in line and required in line, line
    assert "no earlier checkpoint exists. Free space there" in line and "keep_checkpoints" not in line, line
    assert not list(root.glob("*step_3*"))

    free(tensors + margin)  # exactly what the line says is required: it saves
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=3"]) == 0
    free(1_000_000)
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=6"]) == 2
    line = first_error(capsys.readouterr().err)
    assert "not enough space to save step 6 in" in line and f"1.0 MB free, {required}" in line, line
    assert f"nothing was written, and the previous checkpoint {root / 'step_3'} is intact" in line
    assert line.endswith(". Free space there"), line  # step_3 is what a resume needs: nothing to remove
    assert checkpoint_files.find_latest(run_dir).name == "step_3" and not list(root.glob(".step_6*"))

    monkeypatch.undo()
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=6"]) == 0
    free(1_000_000)
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}"]) == 2  # the step-8 save
    line = first_error(capsys.readouterr().err)
    assert f"the previous checkpoint {root / 'step_6'} is intact" in line, line
    assert (
        "Free space there, e.g. by removing older checkpoints a resume does not need (step_3); a lower "
        "train.keep_checkpoints (now 3) keeps fewer of them" in line
    ), line


def test_a_full_disk_during_a_save_suggests_what_would_free_space(tmp_path):
    """storage_message (the file system refused a write): the same figure and the same suggestions."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    problem = (errno.ENOSPC, str(root / ".step_2.tmp" / "__0_0.distcp"))
    line = storage.storage_message(problem, root, 3_000_000, keep=3)
    assert "free, 19.8 MB required (the tensors' ~3.0 MB plus a 16.8 MB margin" in line, line
    assert "; no earlier checkpoint exists. Free space there, then run the same command" in line, line
    for step in (2, 4, 6):  # complete checkpoints; `latest` names step_6
        (root / f"step_{step}").mkdir()
        (root / f"step_{step}" / ".metadata").write_bytes(b"")
    (root / "step_8").mkdir()  # incomplete: not a checkpoint
    (root / "latest").write_text("step_6\n")
    line = storage.storage_message(problem, root, 3_000_000, keep=3)
    assert (
        "Free space there, e.g. by removing older checkpoints a resume does not need (step_2, step_4); "
        "a lower train.keep_checkpoints (now 3) keeps fewer of them" in line
    ), line
    assert "keep_checkpoints" not in storage.storage_message(problem, root, 3_000_000, keep=1)
    assert "keep_checkpoints" not in storage.storage_message(problem, root, 3_000_000, training=False)


def test_storage_errors_are_recognised_through_dcp_and_without_an_errno(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/__1_0.distcp")
    except OSError as e:
        wrapped = CheckpointException("save failed", {1: _wrap_exception(e)})
    assert storage.storage_problem(wrapped) == (errno.ENOSPC, "/ckpt/__1_0.distcp")
    assert storage.storage_problem(PermissionError(errno.EROFS, "Read-only file system"))[0] == errno.EROFS
    assert (
        storage.storage_problem(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), tmp_path) is None
    )
    # torch's zip writer on a full disk loses the errno ("unexpected pos 704 vs 598"): the free space tells
    real = shutil.disk_usage
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    assert storage.storage_problem(RuntimeError("unexpected pos 704 vs 598"), tmp_path) == (
        errno.ENOSPC,
        None,
    )


def test_failure_records_never_raise_on_a_full_or_unwritable_disk(tmp_path):
    from parallel.lifecycle.watchdog import Deadlines, Watchdog

    blocked = tmp_path / "failures"
    blocked.write_text("a file where the folder should be")
    where = comm.CommLog().dump_safely(blocked, 0, "reason")
    assert where.startswith("nowhere: ") and "could not be written" in where
    dog = Watchdog(0, 1, None, tmp_path, Deadlines(long_s=5, stall_s=1, silence_s=1))
    assert dog.dump("reason").startswith("nowhere: ") and dog._dump_stacks().startswith("nowhere: ")


def test_a_full_disk_outside_checkpoints_is_named(tmp_path, monkeypatch, capsys):
    """metrics.jsonl on a full disk: the same kind of line as a checkpoint's, exit 2."""
    from configs.rundir import RunDirectory

    def full(self, metrics):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "metrics.jsonl"))

    monkeypatch.setattr(RunDirectory, "log_metrics", full)
    run_dir = tmp_path / "run"
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}"]) == 2
    line = first_error(capsys.readouterr().err)
    assert (
        line.startswith("error: no space left on ") and f"while writing {run_dir / 'metrics.jsonl'}" in line
    ), line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=3"]) == 0
    return run_dir


def test_a_damaged_checkpoint_without_checksums_is_named(trained, tmp_path, capsys):
    """Without checksums.json (an older checkpoint, or the file lost), DCP's .metadata still says how
    long each shard must be: a truncated one is named, not taken for another model."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step = run_dir / "checkpoints" / "step_3"
    (step / "checksums.json").unlink()
    shard = step / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    for module, argv in (
        (train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=6"]),
        (infer, ["--config", str(TINY), f"run.output_dir={run_dir}", "--output", str(tmp_path / "v.npy")]),
    ):
        assert run_main(module, argv) == 2
        line = first_error(capsys.readouterr().err)
        assert (
            f"checkpoint {step} is damaged, nothing was loaded from it: __0_0.distcp is truncated "
            f"({size // 2} of"
            in line
            and "does not fit" not in line
        ), line
    assert not dist.is_initialized()


def wan_folder(tmp_path):
    from tests.test_init import tiny_wan_for_the_tiny_recipe

    return tiny_wan_for_the_tiny_recipe(tmp_path / "wan")


WAN_OPTIONS = [
    "model.adaln=single",
    "model.qk_norm_across_heads=true",
    "model.pooled_text=false",
    "model.text_mask=false",
]


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate", "is truncated: {size} bytes, its header describes"),
        ("garbage", "is not a safetensors file, or is truncated"),
        ("config_key", "config.json has no 'num_layers'; a WanTransformer3DModel config.json lists"),
        ("config_json", "config.json is not valid JSON (Expecting"),
    ],
)
def test_a_damaged_pretrained_folder_is_named_before_start_up(tmp_path, capsys, damage, expected):
    folder = wan_folder(tmp_path)
    file = sorted(folder.glob("*.safetensors"))[-1]
    config = folder / "config.json"
    if damage == "truncate":
        os.truncate(file, file.stat().st_size - 10)
    elif damage == "garbage":
        file.write_bytes(b"\x00" * 3)
    elif damage == "config_key":
        values = json.loads(config.read_text())
        del values["num_layers"]
        config.write_text(json.dumps(values))
    else:
        config.write_text(config.read_text()[:-5])
    run_dir = tmp_path / "run"
    for module, extra in ((train, []), (infer, ["--output", str(tmp_path / "v.npy")])):
        code = run_main(
            module,
            [
                "--config",
                str(TINY),
                f"run.output_dir={run_dir}",
                f"model.pretrained={folder}",
                *WAN_OPTIONS,
                *extra,
            ],
        )
        line = first_error(capsys.readouterr().err)
        assert code == 2, line
        named = file if damage in ("truncate", "garbage") else config
        assert f"model.pretrained: {named} " in line and expected.format(size=file.stat().st_size) in line, (
            line
        )
        assert not (run_dir / "config.yaml").exists() and not dist.is_initialized()  # before the run started


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=nan", "train.lr"),
        ("parallel.timeout_s=inf", "parallel.timeout_s"),
        ("train.betas=[0.9,nan]", "train.betas"),
        ("parallel.heartbeat_timeout_s=-5", "parallel.heartbeat_timeout_s"),
    ],
)
def test_a_non_finite_or_negative_number_is_refused_by_key(tmp_path, capsys, override, key):
    run_dir = tmp_path / "run"
    assert run_main(train, ["--config", str(TINY), f"run.output_dir={run_dir}", override]) == 2
    line = first_error(capsys.readouterr().err)
    assert line.startswith(f"error: '{key}' must be") and not run_dir.exists(), line


def test_a_resume_logs_each_step_once(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    assert run_main(train, [*RUN, f"run.output_dir={run_dir}", "train.max_steps=5", "train.log_every=1"]) == 0
    # the checkpoint of step 3 is resumed again: steps 4 and 5 were logged already
    assert (
        run_main(
            train,
            [
                *RUN,
                f"run.output_dir={run_dir}",
                "train.max_steps=6",
                "train.log_every=1",
                f"train.resume={run_dir / 'checkpoints' / 'step_3'}",
            ],
        )
        == 0
    )
    assert [m["step"] for m in read_metrics(run_dir)] == [3, 4, 5, 6]
    earlier = sorted(run_dir.glob("metrics.*.jsonl"))
    assert len(earlier) == 1 and [
        json.loads(line)["step"] for line in earlier[0].read_text().splitlines()
    ] == [3, 4, 5]


def test_non_finite_tensors_are_counted_per_device():
    """AdamW keeps `step` as a CPU scalar beside the moments (on the GPU in a GPU run): the count stacks
    flags per device, never across devices. Here every tensor is on the CPU: the arithmetic is checked."""
    tensors = [
        torch.tensor(3.0),
        torch.ones(4, 5),
        torch.tensor([1.0, float("nan")]),
        torch.full((2, 2), float("-inf")),
        torch.zeros(7, dtype=torch.bfloat16),
    ]
    assert storage._count_non_finite(tensors) == 2
    assert storage._count_non_finite([]) == 0
