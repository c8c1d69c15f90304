"""LoRA: tessera's adapters against their own folded weights, the shared file formats against each other,
and both directions against diffusers' PEFT LoRAs (code no one here wrote): a PEFT LoRA saved by
WanPipeline.save_lora_weights samples in infer.py --lora what WanPipeline.load_lora_weights samples; a
LoRA trained here (resumed across sequence-parallel layouts) and exported samples in diffusers what
infer.py samples from its checkpoint."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import infer
import train
from configs.rundir import read_metrics
from models.dit.transformer import WAN_OPTIONS, DiT
from models.lora import (
    DEFAULT_TARGETS,
    adapted_modules,
    adapter_deltas,
    add_adapters,
    fold_adapters,
    merge_deltas,
)
from models.lora_formats import (
    LoRAFormatError,
    export_adapters,
    match_lora,
    model_projections,
    starting_adapters,
)
from tests.conftest import ranks, run_main
from tests.test_wan_pipeline import PROMPT, infer_sample, pipeline_sample, tiny_pipeline  # noqa: F401

# the diffusers module names PEFT targets for "every Linear of self-, cross-attention and feed-forward"
PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def tiny_wan(seed=0, image=False) -> DiT:
    """image: Wan2.1 I2V's image conditioning too (add_k_proj/add_v_proj, k_img/v_img in the files)."""
    torch.manual_seed(seed)
    extra = dict(image_dim=20, image_tokens=5) if image else {}
    model = DiT(4, 16, depth=2, hidden_size=64, num_heads=4, ffn_dim=32, **WAN_OPTIONS, **extra)
    model.init_weights(zero_init=False)
    return model


def randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def forward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 4, 2, 8, 8, generator=g), torch.randn(2, 7, 16, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([0.3, 0.8]), y, torch.ones(2, 7, dtype=torch.bool))


def test_adapters_start_as_the_base_and_fold_exactly():
    base = tiny_wan()
    adapted = tiny_wan()
    names = add_adapters(adapted, rank=4, alpha=8.0, patterns=DEFAULT_TARGETS)
    assert len(names) == 2 * 7  # qkv, proj, q, kv, proj, mlp.0, mlp.2 in each of 2 blocks
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == {
        f"{m}.lora_{ab}.weight" for m in names for ab in "AB"
    }
    with torch.no_grad():  # A random, B zero: the base exactly
        for m in dict(adapted.named_modules()).values():
            if hasattr(m, "lora_A"):
                m.lora_A.weight.normal_()
                m.lora_B.weight.zero_()
    assert torch.equal(forward(adapted), forward(base))
    randomize_adapters(adapted)
    unmerged = forward(adapted)
    assert (unmerged - forward(base)).abs().max() > 1e-3
    assert torch.allclose(forward(fold_adapters(adapted)), unmerged, atol=1e-5)


def test_adapters_on_the_float32_time_embedder_are_applied():
    """t_embedder runs its Linear layers itself, in float32: their adapters must still count (and fold)."""
    adapted = tiny_wan()
    add_adapters(adapted, rank=4, alpha=8.0, patterns=["t_embedder.mlp.*"])
    randomize_adapters(adapted)
    unmerged = forward(adapted)
    assert (unmerged - forward(tiny_wan())).abs().max() > 1e-3
    assert torch.allclose(forward(fold_adapters(adapted)), unmerged, atol=1e-5)


def test_targets_that_match_nothing_and_oversized_ranks_are_refused():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.attention\.\*' match no Linear layer"):
        add_adapters(tiny_wan(), 4, 4.0, ["blocks.*.attention.*"])
    with pytest.raises(ValueError, match="lora.rank=40 is larger than the smallest side"):
        add_adapters(tiny_wan(), 40, 40.0, DEFAULT_TARGETS)


def kohya_from_comfyui(tensors: dict) -> dict:
    """musubi-tuner's names for the same weights: lora_unet_<original path with _>.lora_down/up + alpha."""
    out = {}
    for key, value in tensors.items():
        module, _, role = key.removeprefix("diffusion_model.").partition(".lora_")
        if key.endswith(".alpha"):
            module, role = key.removeprefix("diffusion_model.").removesuffix(".alpha"), "alpha"
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.{ {'A.weight': 'lora_down.weight', 'B.weight': 'lora_up.weight'}.get(role, role) }"] = (
            value
        )
    return out


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("per_projection", [True, False])
@pytest.mark.parametrize("fmt", ["diffusers", "comfyui", "kohya"])
def test_every_format_round_trips_the_fused_projections_exactly(fmt, per_projection, image):
    """Export tessera's adapters (fused qkv and kv split into per-projection adapters: their own A's, or
    one shared A), read them back: the weight updates are those of the adapters themselves. With image
    conditioning (i2v) the image's keys and values are adapted too, under Wan's names for them."""
    model = tiny_wan(image=image)
    add_adapters(model, rank=4, alpha=2.0, patterns=DEFAULT_TARGETS, per_projection=per_projection)
    randomize_adapters(model)
    adapters = {
        name: (m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.lora_scale)
        for name, m in model.named_modules()
        if hasattr(m, "lora_A")
    }
    projections, linears = model_projections(tiny_wan(image=image))
    tensors = export_adapters(adapters, projections, "diffusers" if fmt == "diffusers" else "comfyui")
    if image:  # the names diffusers and ComfyUI give the image's projections
        name = (
            "transformer.blocks.1.attn2.add_v_proj"
            if fmt == "diffusers"
            else "diffusion_model.blocks.1.cross_attn.v_img"
        )
        assert f"{name}.lora_B.weight" in tensors
    if fmt == "diffusers":
        assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in tensors and not any(
            k.endswith(".alpha") for k in tensors
        )
    else:
        assert "diffusion_model.blocks.1.self_attn.v.lora_B.weight" in tensors
        assert "diffusion_model.blocks.0.ffn.0.alpha" in tensors
    if fmt == "kohya":
        tensors = kohya_from_comfyui(tensors)
        assert "lora_unet_blocks_0_cross_attn_k.lora_down.weight" in tensors
    update = match_lora(tensors, projections, linears)
    ours, theirs = adapter_deltas(model), update.deltas()
    assert ours.keys() == theirs.keys()
    for name, [(_, delta)] in ours.items():
        rebuilt = torch.zeros_like(delta)
        for rows, part in theirs[name]:
            rebuilt[rows if rows is not None else slice(None)] += part
        assert torch.allclose(rebuilt, delta, atol=1e-6), name


def test_an_image_to_video_lora_loads_in_diffusers_and_computes_the_same(tmp_path):
    """A LoRA on every Linear of an I2V model (the image's keys and values and its embedder too), exported
    in diffusers' names and loaded by diffusers' own WanTransformer3DModel.load_lora_adapter (PEFT):
    its forward with the image equals tessera's with the adapters."""
    from diffusers import WanTransformer3DModel

    from models.dit.wan import dit_kwargs_from_diffusers_config, tessera_state_dict_from_diffusers
    from tests.test_wan import TINY_WAN

    config = dict(TINY_WAN, in_channels=12, out_channels=4, image_dim=20, added_kv_proj_dim=24)
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = DiT(**dict(dit_kwargs_from_diffusers_config(config), image_tokens=5))
    model.load_state_dict(tessera_state_dict_from_diffusers(reference.state_dict()), strict=True)
    patterns = [*DEFAULT_TARGETS, "image_embedder.ff.*"]
    add_adapters(model.eval(), rank=4, alpha=2.0, patterns=patterns, per_projection=True)
    randomize_adapters(model)
    adapters = {
        n: (m.lora_A.weight, m.lora_B.weight, m.lora_scale)
        for n, m in model.named_modules()
        if hasattr(m, "lora_A")
    }
    tensors = export_adapters(adapters, model_projections(model)[0], "diffusers")
    assert "transformer.blocks.0.attn2.add_k_proj.lora_A.weight" in tensors
    assert "transformer.condition_embedder.image_embedder.ff.net.0.proj.lora_B.weight" in tensors
    reference.load_lora_adapter(tensors, prefix="transformer", adapter_name="tessera")
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 12, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    y, image = torch.randn(2, 512, 16, generator=g), torch.randn(2, 5, 20, generator=g)
    with torch.no_grad():
        expected = reference(x, t * 1000, y, encoder_hidden_states_image=image, return_dict=False)[0]
        ours = model(x, t, y, torch.ones(2, 512, dtype=torch.bool), image)
    assert ((ours - expected).norm() / expected.norm()).item() <= 1e-5
    reference.disable_lora()
    with torch.no_grad():  # the LoRA counts: without it diffusers gives another output
        assert (
            reference(x, t * 1000, y, encoder_hidden_states_image=image, return_dict=False)[0] - expected
        ).abs().max() > 1e-3


def test_per_projection_adapters_are_separate_adapters_on_the_fused_layer():
    """The fused qkv's adapters against three nn.Linear LoRAs written out by hand on the split weight."""
    model = tiny_wan()
    add_adapters(model, rank=4, alpha=2.0, patterns=["blocks.0.attn.qkv"])
    randomize_adapters(model)
    qkv = model.blocks[0].attn.qkv
    x = torch.randn(5, 64)
    A, B = qkv.lora_A.weight, qkv.lora_B.weight
    expected = torch.cat(
        [
            x @ w.T + b + 0.5 * (x @ a.T) @ bb.T
            for w, b, a, bb in zip(qkv.weight.chunk(3), qkv.bias.chunk(3), A.chunk(3), B.chunk(3))
        ],
        dim=-1,
    )
    with torch.no_grad():
        assert torch.allclose(qkv(x), expected, atol=1e-6)
    assert A.shape == (12, 64) and B.shape == (192, 4)  # rank 4 for each of q, k and v


def adapters_of(model) -> dict:
    return {
        name: (m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.lora_scale)
        for name, m in adapted_modules(model).items()
    }


def assert_starts_alike(run, source, update) -> None:
    """lora.init_from's adapters of `update` in `run`: every adapter started, each update `source`'s."""
    start = starting_adapters(update, adapted_modules(run), seed=0)
    with torch.no_grad():
        for name, p in run.named_parameters():
            if name in start:
                p.copy_(start[name])
    assert len(start) == 2 * len(adapted_modules(run))
    ours, theirs = adapter_deltas(run), adapter_deltas(source)
    for name in theirs:
        assert torch.allclose(ours[name][0][1], theirs[name][0][1], atol=1e-6), name


@pytest.mark.parametrize("wan", [True, False])
def test_a_file_starts_the_adapters_exactly(wan):
    """lora.init_from: a file's adapters (rank 2, another alpha) become the run's rank-4 adapters, padded,
    with the same weight updates; tessera's own names (a DiT without Wan's options) keep the fused qkv
    as one block-diagonal adapter, read back exactly too."""
    make = tiny_wan if wan else lambda: DiT(4, 16, depth=2, hidden_size=64, num_heads=4, ffn_dim=32)
    source = make()
    add_adapters(source, rank=2, alpha=3.0, patterns=DEFAULT_TARGETS)
    randomize_adapters(source)
    projections, linears = model_projections(make())
    tensors = export_adapters(adapters_of(source), projections, "comfyui")
    assert any(k.endswith("self_attn.q.lora_A.weight") for k in tensors) == wan
    update = match_lora(tensors, projections, linears)
    run = make()
    add_adapters(run, rank=4, alpha=8.0, patterns=DEFAULT_TARGETS)
    assert_starts_alike(run, source, update)
    small = make()
    add_adapters(small, rank=1, alpha=1.0, patterns=DEFAULT_TARGETS)
    with pytest.raises(LoRAFormatError, match="has rank 2 in the file, more than lora.rank=1"):
        starting_adapters(update, adapted_modules(small), seed=0)
    partial = make()
    add_adapters(partial, rank=4, alpha=8.0, patterns=["blocks.*.mlp.*"])
    with pytest.raises(LoRAFormatError, match="none in this run .*add them to lora.targets"):
        starting_adapters(update, adapted_modules(partial), seed=0)
    if wan:
        shared = make()
        add_adapters(shared, rank=4, alpha=8.0, patterns=DEFAULT_TARGETS, per_projection=False)
        with pytest.raises(LoRAFormatError, match="set lora.per_projection=true"):
            starting_adapters(update, adapted_modules(shared), seed=0)


def test_keys_that_match_nothing_or_another_size_are_named():
    projections, linears = model_projections(tiny_wan())
    good = {
        "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 64),
        "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(64, 4),
    }
    stray = {"transformer.blocks.0.attn1.to_qq.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(
        LoRAFormatError, match=r"2 of 3 keys match .* no layer for transformer\.blocks\.0\.attn1\.to_qq"
    ):
        match_lora(good | stray, projections, linears)
    wide = {k: torch.zeros(4, 128) if "lora_A" in k else v for k, v in good.items()}
    with pytest.raises(LoRAFormatError, match="made for another model size or architecture"):
        match_lora(wide, projections, linears)
    with pytest.raises(LoRAFormatError, match="no lora_B"):
        match_lora({k: v for k, v in good.items() if "lora_A" in k}, projections, linears)


def peft_lora_file(pipe_dir, folder, alpha=8):
    """A PEFT LoRA with random non-zero weights on diffusers' WanTransformer3DModel, saved by diffusers."""
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = WanPipeline.from_pretrained(pipe_dir)
    config = LoraConfig(r=4, lora_alpha=alpha, target_modules=PEFT_TARGETS, init_lora_weights=False)
    pipe.transformer.add_adapter(config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    WanPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    return folder / "pytorch_lora_weights.safetensors"


def test_a_diffusers_peft_lora_samples_in_infer_what_diffusers_samples(tiny_pipeline, tmp_path):  # noqa: F811
    pipe_dir, recipe = tiny_pipeline
    lora = peft_lora_file(pipe_dir, tmp_path / "peft")
    expected = pipeline_sample(pipe_dir, lora)
    base = pipeline_sample(pipe_dir)
    assert np.abs(expected - base).max() > 1e-2  # the LoRA changes the video
    ours = infer_sample(recipe, tmp_path / "run", tmp_path / "ours.npy", "--lora", str(lora))
    assert np.abs(ours - expected).max() <= 1e-4
    # the kohya / musubi-tuner renaming of the same weights, alpha carried per module
    tensors = load_file(lora)
    comfy = {}
    for key, value in tensors.items():
        module = key.removeprefix("transformer.").rsplit(".lora_", 1)[0]
        original = (
            module.replace("attn1.to_out.0", "self_attn.o")
            .replace("attn2.to_out.0", "cross_attn.o")
            .replace("attn1.to_", "self_attn.")
            .replace("attn2.to_", "cross_attn.")
            .replace("ffn.net.0.proj", "ffn.0")
            .replace("ffn.net.2", "ffn.2")
        )
        comfy[key.replace(f"transformer.{module}", f"diffusion_model.{original}")] = value
        comfy[f"diffusion_model.{original}.alpha"] = torch.tensor(8.0)
    kohya = tmp_path / "kohya.safetensors"
    save_file(kohya_from_comfyui(comfy), kohya)
    again = infer_sample(recipe, tmp_path / "run", tmp_path / "kohya.npy", "--lora", f"{kohya}:1.0")
    assert np.abs(again - expected).max() <= 1e-4
    # PipeFusion: each stage merges the adapters of its own blocks and none of the others'
    size = ["--frames", "5", "--height", "32", "--width", "32", "--prompt", PROMPT, "--lora", str(lora)]
    stages = ["parallel.pipefusion=2", "parallel.pipefusion_warmup=3", f"run.output_dir={tmp_path / 'run'}"]
    out = tmp_path / "pipefusion.npy"
    result = ranks(2, "infer.py", "--config", str(recipe), *stages, *size, "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.abs(np.load(out) - ours).max() <= 1e-5


LORA = ["lora.rank=4", "lora.alpha=8", "train.ema_decay=0.0", "train.sample_every=0", "sample.steps=3"]


def lora_losses(run):
    return {m["step"]: m["loss"] for m in read_metrics(run)}


@pytest.mark.slow  # three launches of 2 processes
def test_a_lora_trained_across_layouts_exports_to_diffusers_and_comfyui(tiny_pipeline, tmp_path):  # noqa: F811
    """One process trains steps 1-2, ulysses 2 resumes for step 3, ring 2 with the weights offloaded to
    the CPU (train.cpu_offload) for step 4: the losses are a straight one-process run's. The exported
    LoRA (both formats) samples in diffusers what infer.py samples from the checkpoint, and not what
    the base samples."""
    import export

    pipe_dir, recipe = tiny_pipeline
    common = ["--config", str(recipe), *LORA, "train.checkpoint_every=1", "train.log_every=1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert run_main(train, common + [f"run.output_dir={straight}", "train.max_steps=4"]) == 0
    assert run_main(train, common + [f"run.output_dir={run}", "train.max_steps=2"]) == 0
    for steps, *layout in ((3, "parallel.ulysses=2"), (4, "parallel.ring=2", "train.cpu_offload=true")):
        result = ranks(2, "train.py", *common, f"run.output_dir={run}", f"train.max_steps={steps}", *layout)
        assert result.returncode == 0, result.stderr[-3000:]
    a, b = lora_losses(straight), lora_losses(run)
    assert a.keys() == b.keys() == {1, 2, 3, 4}
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a), (a, b)
    step = run / "checkpoints" / "step_4"
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith(("model.", "ema."))]
    assert len(weights) == 2 * 2 * 2 * 7 and all(".lora_" in k for k in weights)  # adapters only

    ours = infer_sample(recipe, run, tmp_path / "ours.npy")
    assert np.abs(ours - pipeline_sample(pipe_dir)).max() > 1e-3  # four steps of training show
    for fmt in ("diffusers", "comfyui"):
        out = tmp_path / f"{fmt}.safetensors"
        assert export.main(["--checkpoint", str(run), "--lora", "--format", fmt, "--output", str(out)]) == 0
        theirs = pipeline_sample(pipe_dir, out)
        assert np.abs(theirs - ours).max() <= 1e-4, fmt
    merged = tmp_path / "merged"
    assert export.main(["--checkpoint", str(run), "--lora", "--merge", "--output", str(merged)]) == 0
    assert json.loads((merged / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    # a recipe building another DiT (an option without weights) is refused before any file is written
    from omegaconf import OmegaConf

    from parallel.checkpoints.checkpoint_files import CheckpointError

    other = OmegaConf.load(run / "config.yaml")
    other.model.text_mask = not other.model.text_mask
    OmegaConf.save(other, tmp_path / "other.yaml")
    argv = ["--checkpoint", str(run), "--config", str(tmp_path / "other.yaml"), "--lora", "--output"]
    with pytest.raises(CheckpointError, match="was trained with another model: model.text_mask"):
        export.main([*argv, str(tmp_path / "other.safetensors")])
    assert not (tmp_path / "other.safetensors").exists()


def test_training_starts_from_a_shared_lora_as_diffusers_merges_it(tiny_pipeline, tmp_path, capsys):  # noqa: F811
    """lora.init_from: a PEFT LoRA saved by diffusers starts the adapters. Under ulysses 2, the first loss is
    that of a fresh LoRA run (one process) on the base diffusers' fuse_lora makes of the same file, and
    not the plain base's. A file of a higher rank than lora.rank, or for another model, is refused."""
    from diffusers import WanPipeline

    pipe_dir, recipe = tiny_pipeline
    lora = peft_lora_file(pipe_dir, tmp_path / "peft")
    pipe = WanPipeline.from_pretrained(pipe_dir)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the fused weights stay
    pipe.transformer.save_pretrained(tmp_path / "fused")
    common = ["--config", str(recipe), *LORA, "train.max_steps=1", "train.log_every=1"]
    fused = [f"run.output_dir={tmp_path / 'fused_run'}", f"model.pretrained={tmp_path / 'fused'}"]
    assert run_main(train, common + fused) == 0
    assert run_main(train, common + [f"run.output_dir={tmp_path / 'base_run'}"]) == 0
    result = ranks(
        2,
        "train.py",
        *common,
        f"run.output_dir={tmp_path / 'run'}",
        f"lora.init_from={lora}",
        "parallel.ulysses=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ours, merged, base = (lora_losses(tmp_path / name)[1] for name in ("run", "fused_run", "base_run"))
    assert ours == pytest.approx(merged, rel=1e-5) and abs(ours - base) > 1e-3 * abs(base), (
        ours,
        merged,
        base,
    )
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert (
        run_main(train, common + [f"run.output_dir={refused}", f"lora.init_from={lora}", "lora.rank=2"]) == 2
    )
    assert "more than lora.rank=2" in capsys.readouterr().err
    alien = tmp_path / "alien.safetensors"
    save_file({"lora_unet_down_blocks_0_attn.lora_down.weight": torch.zeros(4, 8)}, alien)
    assert run_main(train, common + [f"run.output_dir={refused}", f"lora.init_from={alien}"]) == 2
    assert "lora.init_from=" in (err := capsys.readouterr().err) and "0 of 1 keys match" in err
    assert not refused.exists()  # refused before the run directory is made


def test_lora_refusals_name_the_cause_before_anything_starts(tiny_pipeline, tmp_path, capsys):  # noqa: F811
    pipe_dir, recipe = tiny_pipeline
    common = ["--config", str(recipe), *LORA, "train.max_steps=1", "train.checkpoint_every=1"]
    run = tmp_path / "run"
    assert run_main(train, common + [f"run.output_dir={run}"]) == 0
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    # another base: a copy of the pipeline whose weights differ
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((pipe_dir / "transformer" / "config.json").read_text())
    weights = load_file(next((pipe_dir / "transformer").glob("*.safetensors")))
    save_file({k: v + 0.01 for k, v in weights.items()}, other / "model.safetensors")
    resume = common[:-2] + [f"run.output_dir={run}", "train.max_steps=2", f"model.pretrained={other}"]
    assert run_main(train, resume) == 2
    assert "holds adapters trained on the base" in capsys.readouterr().err
    # a full fine-tuning recipe on a LoRA checkpoint
    assert run_main(train, common[:2] + [f"run.output_dir={run}", "train.max_steps=2", "lora.rank=0"]) == 2
    assert "trained a LoRA of rank 4; this recipe trains every weight" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing written was lost
    # a truncated LoRA file, and one for another model
    lora = peft_lora_file(pipe_dir, tmp_path / "peft")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(lora.read_bytes()[:-100])
    assert run_main(infer, ["--config", str(recipe), f"run.output_dir={run}", "--lora", str(cut)]) == 2
    assert "is truncated" in capsys.readouterr().err
    alien = tmp_path / "alien.safetensors"
    save_file({"lora_unet_down_blocks_0_attn.lora_down.weight": torch.zeros(4, 8)}, alien)
    assert run_main(infer, ["--config", str(recipe), f"run.output_dir={run}", "--lora", str(alien)]) == 2
    assert "0 of 1 keys match this model's layers" in capsys.readouterr().err


def test_merged_deltas_skip_the_blocks_another_stage_holds():
    """A PipeFusion stage (keep_blocks) merges the deltas of its own layers and skips those another stage
    holds (held_elsewhere: here block 1); a layer no stage holds is an error naming
    it, on a stage and on the whole model, and so is another stage's layer when the caller does not say
    it lives elsewhere."""
    from parallel.compute.pipefusion_plan import held_elsewhere, keep_blocks

    model = tiny_wan()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stage = keep_blocks(model, 0, 2)
    assert held_elsewhere(stage) == ("blocks.1",) and held_elsewhere(model) == ()
    g = torch.Generator().manual_seed(0)
    ours = torch.randn(64, 64, generator=g)  # the k third of the fused qkv
    theirs = {"blocks.1.attn.qkv": [(None, torch.randn(192, 64, generator=g))]}
    merge_deltas(stage, {"blocks.0.attn.qkv": [(slice(64, 128), ours)], **theirs}, held_elsewhere(stage))
    after = model.state_dict()
    expected = before["blocks.0.attn.qkv.weight"].clone()
    expected[64:128] += ours
    assert torch.allclose(after["blocks.0.attn.qkv.weight"], expected, atol=1e-6)
    for rows in (slice(0, 64), slice(128, 192)):  # q and v untouched
        assert torch.equal(after["blocks.0.attn.qkv.weight"][rows], before["blocks.0.attn.qkv.weight"][rows])
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["blocks.0.attn.qkv.weight"], changed
    alien = {"blocks.7.attn.qkv": [(None, torch.ones(192, 64))]}
    for target, deltas, elsewhere in (
        (stage, alien, held_elsewhere(stage)),  # no stage holds block 7
        (model, alien, ()),
        (stage, {"blocks.1.attn.proj": [(None, torch.ones(64, 64))]}, ()),  # elsewhere not given
    ):
        with pytest.raises(ValueError, match=rf"lacks: {next(iter(deltas))}$"):
            merge_deltas(target, deltas, elsewhere)
    assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())  # refused before any merge


@pytest.mark.slow  # a 2-process launch: the whole suite's
def test_previews_leave_the_training_unchanged(tmp_path):
    """A preview samples with the EMA adapters swapped in; the steps after it train the raw ones again.
    Two processes, a sharded model: FSDP2 keeps its last block gathered after a forward, so the previews
    reshard every module before the raw adapters go back."""
    from tests.conftest import TINY

    base = tmp_path / "base"
    assert run_main(train, ["--config", str(TINY), f"run.output_dir={base}", "train.max_steps=2"]) == 0
    common = ["--config", str(TINY), "train.max_steps=4", "train.checkpoint_every=4", "train.ema_decay=0.5"]
    common += [f"model.pretrained={base}", "lora.rank=4", "train.batch_size=2"]
    for name, every in (("a", 0), ("b", 1)):
        result = ranks(
            2, "train.py", *common, f"run.output_dir={tmp_path / name}", f"train.sample_every={every}"
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert lora_losses(tmp_path / "a") == lora_losses(tmp_path / "b")
    # config.yaml records the recipe as given: the base run, not the step it resolved to at start-up;
    # once the base run saved a newer step, the LoRA still samples on the step it was trained on
    assert f"pretrained: {base}\n" in (tmp_path / "a" / "config.yaml").read_text()
    assert run_main(train, ["--config", str(TINY), f"run.output_dir={base}", "train.max_steps=3"]) == 0
    out = tmp_path / "lora.npy"
    argv = ["--config", str(tmp_path / "a" / "config.yaml"), "--prompt", "a red square", "--steps", "1"]
    assert run_main(infer, [*argv, "--checkpoint", str(tmp_path / "a"), "--output", str(out)]) == 0
