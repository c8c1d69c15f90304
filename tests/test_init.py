"""Start-up without a whole model on any rank: meta-device build, FSDP2 sharding, then each rank fills its
own shard from train.seed or from a pretrained diffusers Wan folder (parallel/build/init.py)."""

import re
import shutil

import numpy as np
import pytest
import torch

import infer
import train
from tests.conftest import TINY, ranks, run_main
from tests.test_wan import TINY_WAN


def save_wan(folder, **overrides):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**TINY_WAN, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="20KB")  # several files, as the real checkpoints come
    return folder


@pytest.mark.timeout(120)
def test_sharded_start_up_equals_one_process_and_reads_only_own_rows(tmp_path):
    folder = save_wan(tmp_path / "wan")
    assert len(list(folder.glob("*.safetensors"))) > 1
    result = ranks(2, "tests/init_worker.py", str(folder), timeout=100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert sum(line.startswith("ok seed ") for line in lines) == 4, lines
    assert any(line.startswith("ok pretrained: ") for line in lines), lines
    partial = next(line for line in lines if line.startswith("ok pretrained reads only own rows"))
    counts = [int(c) for c in re.search(r"\[(\d+), (\d+)\] of them partial", partial).groups()]  # per rank
    assert all(c > 10 for c in counts), partial  # each rank read part of most parameters, not all of them
    assert not any(line.startswith("FAIL") for line in lines), lines


def tiny_wan_for_the_tiny_recipe(folder):
    # tests/tiny.yaml: DiT-tiny (2 x 64 wide, 4 heads, FFN 256), patch 1x4x4, pixel space (3 channels),
    # the tiny T5 (32 wide)
    return save_wan(
        folder,
        patch_size=(1, 4, 4),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=3,
        out_channels=3,
        text_dim=32,
        ffn_dim=256,
        num_layers=2,
    )


def test_train_starts_from_pretrained_weights(tmp_path):
    """train.py with model.pretrained and a learning rate of 1e-10: the checkpoint after one step holds
    the folder's weights (AdamW moves each by about the learning rate)."""
    from safetensors.torch import load_file

    from models.dit.transformer import DiT
    from models.dit.wan import WanWeights, tessera_state_dict_from_diffusers
    from parallel.checkpoints.checkpoint import load_weights

    folder = tiny_wan_for_the_tiny_recipe(tmp_path / "wan")
    run = tmp_path / "run"
    options = [
        "model.adaln=single",
        "model.qk_norm_across_heads=true",
        "model.pooled_text=false",
        "model.text_mask=false",
        f"model.pretrained={folder}",
    ]
    assert (
        run_main(
            train,
            [
                "--config",
                str(TINY),
                f"run.output_dir={run}",
                "train.max_steps=1",
                "train.checkpoint_every=1",
                "train.lr=1e-10",
                *options,
            ],
        )
        == 0
    )
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    expected = tessera_state_dict_from_diffusers(state)
    for use_ema in (False, True):
        model = DiT(**WanWeights(folder).dit_kwargs)
        load_weights(run / "checkpoints" / "step_1", model, use_ema=use_ema)
        for name, param in model.named_parameters():
            assert torch.allclose(param, expected[name], rtol=0, atol=1e-8), (use_ema, name)
    # infer.py samples from the pretrained weights when the run has no checkpoint, and --random-weights
    # really means random ones
    fresh = tmp_path / "fresh"
    common = [
        "--config",
        str(TINY),
        f"run.output_dir={fresh}",
        "--steps",
        "2",
        "--prompt",
        "a red square",
        *options,
    ]
    assert run_main(infer, [*common, "--output", str(tmp_path / "pretrained.npy")]) == 0
    assert run_main(infer, [*common, "--random-weights", "--output", str(tmp_path / "random.npy")]) == 0
    assert (
        run_main(
            infer,
            [
                *common[: -len(options)],
                *options[:-1],
                "--random-weights",
                "--output",
                str(tmp_path / "random_no_folder.npy"),
            ],
        )
        == 0
    )
    pretrained, random = np.load(tmp_path / "pretrained.npy"), np.load(tmp_path / "random.npy")
    assert np.array_equal(random, np.load(tmp_path / "random_no_folder.npy"))
    assert not np.allclose(pretrained, random)
    # a resume takes every weight from the checkpoint: the folder may be gone
    shutil.rmtree(folder)
    assert (
        run_main(
            train,
            [
                "--config",
                str(TINY),
                f"run.output_dir={run}",
                "train.max_steps=2",
                "train.checkpoint_every=1",
                "train.lr=1e-10",
                *options,
            ],
        )
        == 0
    )


def test_a_recipe_that_disagrees_with_the_pretrained_folder_is_named(tmp_path, capsys):
    folder = tiny_wan_for_the_tiny_recipe(tmp_path / "wan")
    code = run_main(
        train, ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", f"model.pretrained={folder}"]
    )
    err = capsys.readouterr().err
    assert code != 0
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "disagrees with the recipe" in line and "model.adaln (or model.size)" in line, line
    assert "model.pooled_text (or model.size)" in line and "model.text_mask (or model.size)" in line, line
    assert line.endswith(
        "set model.adaln=single model.qk_norm_across_heads=true model.pooled_text=false model.text_mask=false"
    ), line
    # options without a shape to betray them are compared too
    code = run_main(
        train,
        [
            "--config",
            str(TINY),
            f"run.output_dir={tmp_path / 'run'}",
            f"model.pretrained={folder}",
            "model.adaln=single",
            "model.qk_norm_across_heads=true",
            "model.pooled_text=false",
            "model.text_mask=false",
            "model.qk_norm=false",
            "model.rope_theta=500",
        ],
    )
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error:"))
    assert (
        code != 0 and "model.qk_norm: qk_norm=False" in line and "model.rope_theta: rope_theta=500.0" in line
    ), line


def test_from_scratch_weights_do_not_depend_on_the_meta_path():
    """build_model's one-process weights (infer.py's) equal what parallel/build/init.py makes shard by shard
    (tests/init_worker.py checks the sharded side against init_weights(seed))."""
    from configs import load_config
    from parallel.build.components import build_frozen, build_model

    cfg = load_config(TINY)
    text_encoder, vae = build_frozen(cfg, torch.device("cpu"))
    a, b = build_model(cfg, text_encoder, vae), build_model(cfg, text_encoder, vae)
    reference = build_model(cfg, text_encoder, vae, weights=False)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=cfg.train.seed)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), reference.parameters()):
        assert torch.equal(x, y) and torch.equal(x, z), name
    assert any(x.abs().sum() > 0 for x in a.parameters())
