"""model.base_dtype=float8 (models/float8.py): a LoRA run's frozen base in float8 with a scale per row.
Against the same model with its base in bf16 (what a LoRA run holds without it): the output within the
stated tolerance, the adapters exact and trained, the blocks' bytes halved (Wan2.1-14B counted on the meta
device); training under sequence parallelism with the shards on the CPU (train.cpu_offload) gives one
process's losses; and what it cannot do is refused by name."""

import copy
import sys

import pytest
import torch

import train
from configs import ConfigError, load_config
from configs.rundir import read_metrics
from models.float8 import FLOAT8, base_bytes, quantize_blocks, row_scales
from models.lora import DEFAULT_TARGETS, adapter_deltas, add_adapters, merge_deltas
from parallel.lifecycle.finite import first_bad_parameter
from tests.conftest import ROOT, ranks, run_main
from tests.test_lora import LORA, forward, randomize_adapters, tiny_wan
from tests.test_wan_pipeline import tiny_pipeline  # noqa: F401

# The float8 base's stated tolerance: |out - out_bf16| / |out_bf16| of the DiT's output (and of a training
# loss against the float32 base's). Measured on these tiny models: 1.07% (bf16 itself is 0.23% from
# float32) and at most 1.0% (losses); e4m3 holds 3 mantissa bits, so a weight is within 6.25% (2^-4) of
# its value, and the errors of a row's products average out.
TOLERANCE = 0.03


def adapted(seed=0):
    model = tiny_wan(seed)
    add_adapters(model, rank=4, alpha=8.0, patterns=DEFAULT_TARGETS)
    randomize_adapters(model)
    return model


def relative(ours, reference) -> float:
    return float((ours - reference).norm() / reference.norm())


def test_a_float8_base_computes_within_the_tolerance_and_trains_its_adapters():
    full = adapted()
    ours = copy.deepcopy(full)
    names = quantize_blocks(ours)
    assert len(names) == 2 * 7  # every Linear of both blocks; the embedders and the head keep their weights
    qkv = ours.blocks[0].attn.qkv
    assert qkv.weight.dtype == FLOAT8 and qkv.weight_scale.shape == (qkv.out_features, 1)
    assert (
        ours.final_layer.linear.weight.dtype == torch.float32 and ours.x_embedder.proj.weight.dtype != FLOAT8
    )
    for name, p in ours.named_parameters():  # the adapters are the same tensors, still trained alone
        assert p.requires_grad == (".lora_" in name), name
        if ".lora_" in name:
            assert torch.equal(p, full.get_parameter(name))
    bf16 = copy.deepcopy(full)  # the base a LoRA run holds without float8: its weights rounded to bf16
    with torch.no_grad():
        for p in bf16.parameters():
            if not p.requires_grad:
                p.copy_(p.to(torch.bfloat16))
    reference = forward(bf16)
    error, rounding = relative(forward(ours), reference), relative(forward(full), reference)
    assert 0 < rounding < error <= TOLERANCE, (error, rounding)
    print(
        f"float8 base: the output {error:.2%} from the bf16 base's (float32's: {rounding:.2%})",
        file=sys.__stderr__,
    )
    x, y = torch.randn(2, 4, 2, 8, 8), torch.randn(2, 7, 16)
    ours(x, torch.tensor([0.3, 0.8]), y, torch.ones(2, 7, dtype=torch.bool)).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters() if p.requires_grad)
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    # The blocks' Linear weights in a byte a value (float32: 4) and 4 a row for the scale; the rest as it was.
    values = sum(ours.get_submodule(n).weight.numel() for n in names)
    rows = sum(ours.get_submodule(n).out_features for n in names)
    assert base_bytes(ours) == base_bytes(full) - 3 * values + 4 * rows
    with pytest.raises(ValueError, match="float8 base .* takes no merged deltas"):
        merge_deltas(ours, adapter_deltas(ours))


def test_row_scales_are_powers_of_two_and_carry_nan_and_inf_to_the_finiteness_check():
    rows = torch.tensor([[1000.0, -3.0], [0.0, 0.0], [0.01, 0.002], [float("inf"), 1.0], [float("nan"), 1.0]])
    s = row_scales(rows)
    assert s[:3].flatten().tolist() == [4.0, 1.0, 2.0**-15]  # 1000/4 = 250 <= 448 < 500
    assert torch.isinf(s[3]).all() and torch.isnan(s[4]).all()
    model = adapted()
    quantize_blocks(model)
    assert first_bad_parameter(model) is None
    with torch.no_grad():
        model.blocks[1].mlp[0].weight_scale[3] = float("inf")  # as quantizing a row holding inf leaves it
    assert first_bad_parameter(model) == "blocks.1.mlp.0.weight"  # named as the weight the file holds


def test_the_14b_lora_base_is_halved_on_the_meta_device():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_lora

    counts = bench_lora.counts("Wan2.1-14B", 32)
    ratio = counts["base_float8"] / counts["base_bf16"]
    print(f"Wan2.1-14B LoRA base: {counts['base_float8'] / 2**30:.2f} GiB in float8, "
          f"{counts['base_bf16'] / 2**30:.2f} GiB in bf16 ({ratio:.1%})", file=sys.__stderr__)  # fmt: skip
    assert 0.5 < ratio <= 0.51  # the blocks halved; embedders, head, norms and the scales stay


@pytest.mark.slow  # every layout: the whole suite's (the fast tier keeps one layout a family)
@pytest.mark.timeout(240)
def test_lora_on_a_float8_base_trains_alike_in_every_layout(tiny_pipeline, tmp_path):  # noqa: F811
    """Three steps on the full-precision base, on the float8 base (one process), and on the float8 base
    under ulysses 2 with the shards in CPU memory (train.cpu_offload): the two float8 runs give the same
    losses (each rank quantizes its own rows, and a row's scale is its own), within the tolerance of the
    full-precision run's, and their adapters moved."""
    _, recipe = tiny_pipeline
    common = [
        "--config",
        str(recipe),
        *LORA,
        "train.max_steps=3",
        "train.log_every=1",
        "train.checkpoint_every=3",
    ]
    float8 = "model.base_dtype=float8"
    assert run_main(train, common + [f"run.output_dir={tmp_path / 'full'}"]) == 0
    assert run_main(train, common + [f"run.output_dir={tmp_path / 'one'}", float8]) == 0
    layout = ["parallel.ulysses=2", "train.cpu_offload=true"]
    result = ranks(2, "train.py", *common, f"run.output_dir={tmp_path / 'two'}", float8, *layout, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    full, one, two = (
        {m["step"]: m["loss"] for m in read_metrics(tmp_path / r)} for r in ("full", "one", "two")
    )
    assert full.keys() == one.keys() == two.keys() == {1, 2, 3}
    assert all(two[s] == pytest.approx(one[s], rel=1e-5) for s in one), (one, two)
    assert all(0 < abs(one[s] - full[s]) <= TOLERANCE * full[s] for s in full), (full, one)
    trained = saved_adapters(tmp_path / "one" / "checkpoints" / "step_3", "lora_B")
    assert trained and all(b.abs().max() > 0 for b in trained.values())  # B starts at zero


@torch.no_grad()
def test_loras_kept_beside_a_float8_layer_add_up():
    """Factored LoRA updates on a float8 layer (models/lora.py merge_deltas; sampling's run adapters, then
    each --lora file): each source joins the adapters kept beside it, a per-projection adapter's blocks
    and a file's rows where they belong: the layer computes its float8 base plus every update."""
    from models.float8 import base_linear
    from models.lora import lora_delta

    layer = torch.nn.Linear(16, 12, bias=False)
    base = copy.deepcopy(layer)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([layer])
    assert quantize_blocks(model.requires_grad_(False)) == ["blocks.0"]
    x, g = torch.randn(5, 16), torch.Generator().manual_seed(0)
    quantized = base_linear(model.blocks[0], x)
    run = (None, torch.randn(3 * 2, 16, generator=g), torch.randn(12, 2, generator=g), 0.5)  # 3 projections
    file = (slice(4, 8), torch.randn(3, 16, generator=g), torch.randn(4, 3, generator=g), 2.0)  # k's rows
    merge_deltas(model, {"blocks.0": [run]})
    merge_deltas(model, {"blocks.0": [file]})

    want = quantized + x @ (0.5 * lora_delta(run[1], run[2])).T
    want[:, 4:8] += x @ (2.0 * file[2] @ file[1]).T
    assert torch.allclose(model.blocks[0](x), want, atol=1e-5)
    assert not torch.allclose(base(x), want, atol=1e-3)  # the updates move it


@pytest.mark.slow  # a run and four samplings: the whole suite's
@torch.no_grad()
def test_infer_samples_on_a_float8_base(tiny_pipeline, tmp_path, monkeypatch, capsys):  # noqa: F811
    """infer.py with model.base_dtype=float8 (a recipe without a LoRA too): the transformer it samples holds
    its blocks' Linear weights in float8 (the start-up line says so), the video within the tolerance of
    the compute dtype's base and not equal to it. A LoRA run sampled on it keeps its adapters beside the
    float8 layers, as its training computed them: the LoRA's effect on the video is the one it has on the
    full-precision base (a LoRA merged into the weights before quantizing would lose or inflate an effect
    below e4m3's step)."""
    import numpy as np

    from parallel.drive import family_sampling
    from tests.test_wan_pipeline import infer_sample

    _, recipe = tiny_pipeline
    sampled = {}
    made = family_sampling.sampling_transformer

    def spy(*args, **kwargs):
        model = made(*args, **kwargs)
        sampled["dtypes"] = {p.dtype for p in model.blocks.parameters()}
        return model

    monkeypatch.setattr(family_sampling, "sampling_transformer", spy)
    run = tmp_path / "lora"
    with torch.enable_grad():
        assert run_main(train, ["--config", str(recipe), *LORA, "train.max_steps=2", "train.lr=1e-4",
                                f"run.output_dir={run}"]) == 0  # fmt: skip
    videos = {}
    for base in ("auto", "float8"):
        for weights in ("none", str(run)):
            # no lora.* keys: the base alone in float8 too; the run's record brings its adapters
            extra = ("sample.steps=3", f"model.base_dtype={base}", "--checkpoint", weights)
            videos[base, weights] = infer_sample(recipe, tmp_path / "none", tmp_path / "v.npy", *extra)
            assert (FLOAT8 in sampled["dtypes"]) == (base == "float8")
    assert ", float8 base;" in capsys.readouterr().out
    base = videos["auto", "none"]
    error = float(np.linalg.norm(videos["float8", "none"] - base) / np.linalg.norm(base))
    full = videos["auto", str(run)] - videos["auto", "none"]  # the LoRA's effect, full precision
    ours = videos["float8", str(run)] - videos["float8", "none"]
    ratio = float((ours * full).sum() / (full * full).sum())
    print(f"float8 base sampling: the video {error:.2%} from the full-precision base's; the LoRA's effect "
          f"({np.abs(full).max():.1e}) at {ratio:.3f} of its full-precision size", file=sys.__stderr__)
    assert 0 < error <= TOLERANCE and np.abs(full).max() > 0
    assert abs(ratio - 1) <= 0.05


def saved_adapters(step, kind: str) -> dict:
    """A checkpoint's `kind` (lora_A or lora_B) adapter weights {name: tensor}, read with DCP."""
    from torch.distributed.checkpoint import FileSystemReader

    from parallel.checkpoints.checkpoint import read_tensors

    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    shapes = {k.removeprefix("model."): saved[k].size for k in saved if k.startswith("model.") and kind in k}
    return read_tensors(step, "model", shapes)


def test_what_a_float8_base_cannot_do_is_refused_by_name(tiny_pipeline, tmp_path, capsys):  # noqa: F811
    _, recipe = tiny_pipeline
    argv = ["--config", str(recipe), "model.base_dtype=float8", f"run.output_dir={tmp_path / 'full'}"]
    assert run_main(train, argv) == 2  # training's: sampling takes a float8 base without a LoRA
    assert "model.base_dtype=float8 stores a frozen base, and lora.rank=0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="'model.base_dtype' is 'fp8'; choose one of auto, float8"):
        load_config(recipe, [*LORA, "model.base_dtype=fp8"])
    base = tmp_path / "base"
    assert run_main(train, ["--config", str(recipe), "train.max_steps=1", f"run.output_dir={base}"]) == 0
    argv = ["--config", str(recipe), *LORA, f"model.pretrained={base}", "model.base_dtype=float8"]
    assert run_main(train, argv + [f"run.output_dir={tmp_path / 'lora'}"]) == 2
    assert f"model.pretrained={base} is a tessera run" in capsys.readouterr().err
    assert not (tmp_path / "lora").exists()
