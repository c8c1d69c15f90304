"""No silent non-finite output (issue 32, item 5): weights with NaN or inf are refused where they are loaded
(a pretrained folder, a checkpoint sampled or resumed, a LoRA file), naming the file and the tensor, and a
diverged run recommends the newest checkpoint saved with its loss and weights in range, not merely the
newest finite one. Each refusal is one `error:` line and exit code 2."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import infer
import train
from configs.rundir import read_metrics
from parallel.build.init import canonical_name
from parallel.checkpoints import checkpoint as checkpoint_module
from parallel.checkpoints import checkpoint_files, checkpoint_reading
from tests.conftest import TINY, ranks, run_main
from tests.test_guards import WAN_OPTIONS, first_error, wan_folder


def poison(file, key=None, row=0):
    """Write NaN into row `row` of tensor `key` (default: the file's first) of a safetensors file; returns
    the key."""
    with safe_open(str(file), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    key = key or sorted(tensors)[0]
    tensors[key][row] = float("nan")
    save_file(tensors, str(file), metadata=metadata)
    return key


def test_nan_pretrained_weights_are_named_not_the_learning_rate(tmp_path, capsys):
    """(a), (c): a Wan folder with one NaN tensor. train.py named the learning rate (the first step's
    gradient norm was NaN) and infer.py wrote a NaN video with exit 0; both now name the file and tensor."""
    folder = wan_folder(tmp_path)
    file = sorted(folder.glob("*.safetensors"))[-1]
    key = poison(file)
    run_dir = tmp_path / "run"
    for module, extra in (
        (train, ["train.max_steps=2"]),
        (infer, ["--steps", "2", "--output", str(tmp_path / "v.npy")]),
    ):
        argv = [
            "--config",
            str(TINY),
            f"run.output_dir={run_dir}",
            f"model.pretrained={folder}",
            *WAN_OPTIONS,
        ]
        assert run_main(module, argv + extra) == 2, module
        line = first_error(capsys.readouterr().err)
        assert f"model.pretrained={folder}: tensor '{key}' in {file} holds NaN or inf" in line, line
        assert "train.lr" not in line and "training diverged" not in line, line
    assert not list(tmp_path.glob("v*.npy")) and checkpoint_files.find_latest(run_dir) is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_ranks_agree_on_nan_weights_only_one_of_them_holds(tmp_path):
    """Two data-parallel ranks, each filling its own half of every weight's rows: the NaN is in the last
    row of a weight, which only rank 1 reads. Both ranks refuse it with the same line; without the
    agreement rank 0 would go on into the first step's collectives and only learn of rank 1's failure
    from the abort."""
    folder = wan_folder(tmp_path)
    file = sorted(folder.glob("*.safetensors"))[0]
    with safe_open(str(file), framework="pt") as f:
        key = next(k for k in sorted(f.keys()) if k.endswith("weight") and f.get_slice(k).get_shape()[0] >= 4)
        rows = f.get_slice(key).get_shape()[0]
    poison(file, key, row=rows - 1)
    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", f"model.pretrained={folder}"]
    result = ranks(2, "train.py", *args, *WAN_OPTIONS, "train.max_steps=2", timeout=150)
    expected = f"error: model.pretrained={folder}: tensor '{key}' in {file} holds NaN or inf"
    assert f"[rank 0] {expected}" in result.stderr and f"[rank 1] {expected}" in result.stderr, result.stderr[
        -3000:
    ]


def test_a_checkpoint_holding_inf_is_refused_for_sampling_and_for_resuming(tmp_path, monkeypatch, capsys):
    """(a): a checkpoint whose EMA holds an inf (written as an older tessera or another tool could: the
    save's own check is switched off here) samples a NaN video and resumes into a refused save; both entry
    points now name the checkpoint and the tensor."""
    real, corrupted = train.update_ema, []

    def corrupting(ema, model, decay):
        real(ema, model, decay)
        if not corrupted:
            name, param = next(ema.named_parameters())
            param.to_local().fill_(float("inf"))
            corrupted.append(canonical_name(name))

    monkeypatch.setattr(train, "update_ema", corrupting)
    monkeypatch.setattr(checkpoint_module, "check_before_save", lambda *args: 0)
    run_dir = tmp_path / "run"
    common = ["--config", str(TINY), f"run.output_dir={run_dir}"]
    assert run_main(train, [*common, "train.max_steps=2", "train.checkpoint_every=2"]) == 0
    monkeypatch.undo()
    step = run_dir / "checkpoints" / "step_2"
    assert run_main(infer, [*common, "--steps", "2", "--output", str(tmp_path / "v.npy")]) == 2
    line = first_error(capsys.readouterr().err)
    assert f"checkpoint {step}: tensor 'ema.{corrupted[0]}' holds NaN or inf" in line, line
    assert "No earlier complete checkpoint" in line and not list(tmp_path.glob("v*.npy")), line
    assert run_main(train, [*common, "train.max_steps=4", "train.checkpoint_every=2"]) == 2
    line = first_error(capsys.readouterr().err)
    assert f"checkpoint {step}: 'ema.{corrupted[0]}' holds NaN or inf" in line, line


@pytest.mark.parametrize("role", ["--lora", "lora.init_from"])
def test_a_lora_file_holding_nan_is_refused(tmp_path, capsys, role):
    """A LoRA for one 64 x 64 layer of the tiny DiT (sampled: the tiny recipe, tessera's own names; trained
    from: a Wan base, diffusers' names), with a NaN in B. Without the check the sampling made a NaN video
    and the training would start from NaN adapters."""
    file = tmp_path / "nan.safetensors"
    b = torch.zeros(64, 4)
    b[3, 1] = float("nan")
    module = "t_embedder.mlp.2" if role == "--lora" else "blocks.0.attn1.to_out.0"
    save_file({f"{module}.lora_A.weight": torch.randn(4, 64), f"{module}.lora_B.weight": b}, str(file))
    argv = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}"]
    if role == "--lora":
        code = run_main(
            infer, [*argv, "--random-weights", "--output", str(tmp_path / "v.npy"), "--lora", str(file)]
        )
    else:
        lora = ["lora.rank=4", f"lora.init_from={file}", f"model.pretrained={wan_folder(tmp_path)}"]
        code = run_main(train, [*argv, *lora, *WAN_OPTIONS, "train.max_steps=1"])
    line = first_error(capsys.readouterr().err)
    assert code == 2 and f"LoRA file {file}: tensor '{module}.lora_B.weight' holds NaN or inf" in line, line


# checkpoints at 2, 4 and 6 (all kept); every step logged
RANGE_RUN = ["train.max_steps=8", "train.checkpoint_every=2", "train.log_every=1", "train.keep_checkpoints=5"]


@pytest.mark.parametrize("keep", [5, 1])
def test_a_diverged_run_recommends_the_checkpoint_from_before_the_loss_left_its_range(
    tmp_path, monkeypatch, capsys, keep
):
    """(b): the logged loss rises far above train.loss_limit from step 5 on, and the gradient norm is NaN
    at step 7. step_6 is finite, but was saved out of range: the advice names step_4, which the rotation
    keeps even with train.keep_checkpoints=1."""
    real = train.Window.summarize

    def rising(self, runtime, plan, loss, done, context):
        metrics = real(self, runtime, plan, loss, done, context)
        metrics["loss"] *= 1e4 if done >= 5 else 1.0
        return metrics

    monkeypatch.setattr(train.Window, "summarize", rising)
    monkeypatch.setenv("TESSERA_FAULT", "nan@0:7")
    run_dir = tmp_path / "run"
    recipe = ["--config", str(TINY), f"run.output_dir={run_dir}", *RANGE_RUN]
    recipe.append(f"train.keep_checkpoints={keep}")
    assert run_main(train, recipe) == 2
    err = capsys.readouterr().err
    line = first_error(err)
    logged = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    assert logged[4] < 10 < logged[6]  # the range, read from the run's own metrics
    steps = run_dir / "checkpoints"
    assert checkpoint_files.find_latest(run_dir) == steps / "step_6"  # `latest` is the finite, bad one
    assert (
        f"the last good checkpoint is {steps / 'step_4'}: resume from it with train.resume={steps / 'step_4'}"
        in line
    ), line
    assert f"step_6: the loss logged at step 6 was {logged[6]:.4g}, above train.loss_limit=10" in line, line
    assert "step 6 is saved out of range" in err and "step 4 is saved out of range" not in err


def test_weights_above_the_limit_make_no_checkpoint_good(tmp_path, monkeypatch, capsys):
    """(b), weights that grew while the loss stayed finite: with train.weight_limit below the tiny model's
    weights every checkpoint is out of range, and the largest weight each records is the one in it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    monkeypatch.setenv("TESSERA_FAULT", "nan@0:5")
    run_dir = tmp_path / "run"
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", *RANGE_RUN, "train.weight_limit=0.01"]
    assert run_main(train, argv) == 2
    line = first_error(capsys.readouterr().err)
    for step in (2, 4):
        path = run_dir / "checkpoints" / f"step_{step}"
        state = _load_state_dict_from_keys(checkpoint_id=str(path))
        largest = max(t.abs().max().item() for k, t in state["model"].items())
        recorded = checkpoint_reading.read_trainer_state(path)["health"]
        assert recorded["largest_weight"] == pytest.approx(largest, rel=1e-6) and not recorded["in_range"]
        assert f"step_{step}: its largest trained weight was {largest:.4g}" in line, line
    assert "no checkpoint was saved in range (step_4: " in line and "train.resume=none starts afresh" in line


@pytest.mark.parametrize("other_rank", ["finite", "bad at 0"])
def test_ranks_holding_other_tensors_agree_without_naming_the_wrong_one(monkeypatch, other_rank):
    """PipeFusion stages hold other blocks, so an index into one stage's tensors names nothing on another:
    a stage with every tensor finite must not take another's 'none' (its own tensor count) for a bad index,
    and a stage that holds no bad tensor must not name one of its own."""
    from parallel.lifecycle import finite

    theirs = finite.NONE if other_rank == "finite" else 0
    monkeypatch.setattr(finite.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(finite.dist, "get_world_size", lambda group: 2)
    other = torch.tensor([theirs])  # what the other stage's check sends
    monkeypatch.setattr(finite.comm, "all_reduce", lambda t, op, group: torch.minimum(t, other))
    mine = [torch.zeros(2), torch.ones(3), torch.zeros(1)]  # finite, at indices another stage's count reaches
    got = finite.first_non_finite(mine, group="stages", aligned=False)
    assert got == (None if other_rank == "finite" else finite.ELSEWHERE)
    mine[2][0] = float("inf")  # this stage's own bad tensor is named, whatever another holds
    assert finite.first_non_finite(mine, group="stages", aligned=False) == 2
