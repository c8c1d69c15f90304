"""scripts/bench_gpu.py runs end to end at tiny sizes on CPU (the GPU code path, small), and its one
FLOP formula counts what it says: the linear layers over their real rows, attention as torch's SDPA
formulas do, the same for two implementations of one architecture."""

import json
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_gpu  # noqa: E402


def _factories(case):
    makers = [bench_gpu.make_tessera]
    if case.get("wan"):
        makers += [bench_gpu.make_tessera_wan, bench_gpu.make_wan]
    return makers


@pytest.mark.parametrize("name", list(bench_gpu.TINY_CASES))
def test_linear_flops_on_fake_tensors_equal_a_real_forward(name):
    """The count taken on fake tensors (no memory, as on a GPU machine at full size) equals torch's FLOP
    counter over a real forward: every linear layer and patch convolution, over the rows it processes
    (functional calls on a layer's weights included, e.g. the float32 time embedding)."""
    from torch.utils.flop_counter import FlopCounterMode

    case = bench_gpu.TINY_CASES[name]
    (C, T, H, W), (L, text_dim), B = case["latent"], case["text"], case["batch"]
    for make_model in _factories(case):
        inputs = torch.randn(B, C, T, H, W), torch.rand(B), torch.randn(B, L, text_dim)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            make_model(case)(*inputs, torch.ones(B, L, dtype=torch.bool))
        counts = counter.get_flop_counts()["Global"]
        real = sum(n for op, n in counts.items() if str(op).split(".")[1] in bench_gpu.LINEAR_OPS)
        assert real > 0 and bench_gpu.linear_forward_flops(make_model, case) == real, make_model.__name__


@pytest.mark.parametrize("name", list(bench_gpu.TINY_CASES))
def test_attention_flops_follow_torch_sdpa_counts(name):
    """4·S²·d per self-attention layer and 4·S·L·d per cross-attention layer forward, as torch's own
    SDPA FLOP formula counts them; its backward formula gives the 2.5 x the training count uses."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    case = bench_gpu.TINY_CASES[name]
    (_, T, H, W), (L, _), B = case["latent"], case["text"], case["batch"]
    heads, head_dim, S = case["heads"], case["hidden"] // case["heads"], T * H * W // 4
    video, text = (B, heads, S, head_dim), (B, heads, L, head_dim)
    per_layer = sdpa_flop_count(video, video, video) + sdpa_flop_count(video, text, text)
    assert bench_gpu.attention_forward_flops(case) == case["depth"] * per_layer
    assert sdpa_backward_flop_count(video, video, video, video) == 2.5 * sdpa_flop_count(video, video, video)


@pytest.mark.parametrize("name", ["tiny video (Wan-shaped)", "Wan2.1-1.3B dims 33x480x832"])
def test_the_closed_form_is_the_count(name):
    """dit_flops (for the scaling models) is the formula that train_flops counts from the model itself."""
    case = {**bench_gpu.TINY_CASES, **bench_gpu.FULL_CASES}[name]
    (C, T, H, W), (L, text_dim), B = case["latent"], case["text"], case["batch"]
    written = bench_gpu.dit_flops(
        case["depth"], case["hidden"], case["ffn"], T * H * W // 4, L, B, C, text_dim, train=True
    )
    assert written == bench_gpu.train_flops(bench_gpu.make_tessera_wan, case)


def test_equal_architectures_count_equal_flops():
    """tessera's DiT with Wan's options and diffusers' WanTransformer3DModel: one count for both."""
    case = bench_gpu.TINY_CASES["tiny video (Wan-shaped)"]
    ours, theirs = (bench_gpu.train_flops(m, case) for m in (bench_gpu.make_tessera_wan, bench_gpu.make_wan))
    assert ours == theirs > 0


def test_runs_tiny_on_cpu(tmp_path):
    results = bench_gpu.main(
        [
            "--tiny",
            "--out",
            str(tmp_path),
            "--variants",
            "eager",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--sampler-steps",
            "2",
        ]
    )
    assert results["mode"] == "tiny"
    written = json.loads((tmp_path / "results.json").read_text())
    assert {r["case"] for r in written["train"]} == {
        "tiny image (tessera)",
        "tiny video (Wan-shaped) (tessera)",
        "tiny video (Wan-shaped) (tessera, Wan options)",
        "tiny video (Wan-shaped) (diffusers Wan)",
        "tiny video (Wan-shaped) (tessera, Wan options, LoRA r32)",
        "tiny video (Wan-shaped) (tessera, Wan options, LoRA r32, CPU offload)",
    }
    full = [r for r in written["train"] if "LoRA" not in r["case"]]
    assert all(r["seconds"] > 0 and 0 < r["mfu"] for r in full)
    assert [(w["model"], w["reference"]) for w in written["wan_ratio"]] == [
        ("tessera", "diffusers Wan"),
        ("tessera, Wan options", "diffusers Wan"),
        ("tessera, Wan options, LoRA r32", "tessera, Wan options"),
        ("tessera, Wan options, LoRA r32, CPU offload", "tessera, Wan options, LoRA r32"),
    ]
    assert all(w["speedup"] > 0 for w in written["wan_ratio"])
    assert {r["model"] for r in written["denoise"]} == {"tessera, Wan options", "diffusers Wan"}
    assert all(r["seconds"] > 0 for r in written["denoise"])
    assert written["lse"]["self_check"] is True
    assert written["sp"]["ratio"] > 0 and written["sampler"]["seconds_per_step"] > 0
    assert "| tiny image (tessera) | eager |" in (tmp_path / "results.md").read_text()


def test_the_fp8_suite_runs_tiny_on_cpu(tmp_path):
    """--suite fp8 (issue 35's GPU command) at tiny sizes, eager: each model with and without train.fp8
    (torchao emulating the float8 matmuls), their ratio, and the LoRA on a float8 base with and without
    train.cpu_offload against each other."""
    pytest.importorskip("torchao.float8")
    results = bench_gpu.main(
        ["--suite", "fp8", "--tiny", "--out", str(tmp_path), "--variants", "eager,eager+fp8", "--steps", "1",
         "--warmup", "0", "--parts", "train,wan,lora8"]
    )  # fmt: skip
    rows = {(r["case"], r["variant"]) for r in results["train"] if "seconds" in r}
    models = ["tessera, Wan options", "diffusers Wan", "tessera, Wan options, LoRA r32, float8 base"]
    models.append("tessera, Wan options, LoRA r32, float8 base, CPU offload")
    expected = {(f"tiny video (Wan-shaped) ({m})", "eager") for m in models}
    # train.fp8 is tessera's option: not run on diffusers' model, refused with a LoRA
    expected |= {(f"tiny video (Wan-shaped) ({models[0]})", "eager+fp8")}
    assert rows == expected, rows
    assert len(results["fp8_ratio"]) == 1 and results["fp8_ratio"][0]["speedup"] > 0
    pairs = {(w["model"], w["reference"]) for w in results["wan_ratio"]}
    assert (models[3], models[2]) in pairs
    assert "eager+fp8 against eager: speed ratio" in (tmp_path / "results.md").read_text()


def test_cases_run_in_the_command_lines_order():
    """A GPU session can be cut short: --cases' order is the order of measurement, and the denoising
    step runs each variant once without its training-only tokens."""
    cases = {"a 33x": 1, "b 81x": 2, "c 81x": 3, "d 17x": 4}
    assert bench_gpu.in_order(cases, "81x,33x") == [("b 81x", 2), ("c 81x", 3), ("a 33x", 1)]
    assert bench_gpu.in_order(cases, "") == list(cases.items())
    variants = ["eager", "ac", "compile", "compile+ac", "compile+ac+fp8", "compile+sac"]
    assert bench_gpu.denoise_variants(variants) == ["eager", "compile"]
    assert bench_gpu.denoise_variants(["ac+fp8"]) == ["eager"]


@pytest.mark.parametrize("suite", sorted(bench_gpu.SUITES))
def test_each_case_of_a_suite_names_a_case(suite):
    """A misspelt key in a suite would silently drop a case on the GPU, where nobody is watching."""
    suite = bench_gpu.SUITES[suite]
    for key in [*suite["cases"].split(","), *suite["train_cases"].split(",")]:
        names = bench_gpu.TINY_CASES if key.startswith("tiny") else bench_gpu.FULL_CASES
        assert any(key in name for name in names), key


@pytest.mark.slow  # a tiny GPU bench: the fp8 suite's tiny run covers its training path in the fast tier
def test_the_lead_suite_runs_tiny_on_cpu(tmp_path):
    """--suite lead (issue 54's GPU command) at tiny sizes: SDPA's kernels at the case's attention shape
    (those the CPU lacks are rows with their error, the others timed and compared with the first), each
    model's step with selective and full checkpointing beside train.memory=auto's modelled peak, and what
    auto would choose (no GPU: nothing)."""
    results = bench_gpu.main(
        ["--suite", "lead", "--tiny", "--out", str(tmp_path), "--cases", "tiny video",
         "--train-cases", "tiny", "--variants", "sac,ac", "--steps", "1", "--warmup", "0"]
    )  # fmt: skip
    attention = results["attention"]
    for mode in ("sampling forward", "training forward + backward"):
        rows = [r for r in attention if r["mode"] == mode]
        assert {r["kernel"] for r in rows} >= set(bench_gpu.SDPA_BACKENDS)
        timed = [r for r in rows if r["error"] is None]  # on CPU: flash and the math reference
        assert len(timed) >= 2 and all(r["ms"] > 0 for r in timed), rows
        assert all(r["max_diff"] < 1e-5 for r in timed), rows  # float32: every kernel agrees with the first
        (auto,) = [r for r in timed if r["kernel"] == "auto"]  # model.attention_backend=auto's pick
        assert auto["chosen"] in ("sdpa:flash_attention", "sdpa:math"), auto  # what runs on a CPU
    trained = {(r["case"], r["variant"]): r for r in results["train"]}
    assert {v for _, v in trained} == {"sac", "ac"} and all("seconds" in r for r in trained.values())
    for (case, variant), row in trained.items():
        assert row["modelled_gib"] > 0, (case, variant)
    (auto,) = results["memory_auto"]
    peaks = list(auto["modelled_gib"].values())
    assert peaks[0] > max(peaks[1:]) and auto["chosen"] is None  # no checkpointing keeps the most
    text = (tmp_path / "results.md").read_text()
    assert "SDPA's kernels" in text and "train.memory=auto's model" in text


@pytest.mark.slow  # a tiny GPU bench: test_memory.py checks the offload's hooks in the fast tier
def test_the_offload_suite_runs_tiny_on_cpu(tmp_path):
    """--suite offload (issue 54's 14B LoRA on a 24 GB card) at tiny sizes: the LoRA on a float8 base with
    train.cpu_offload, its checkpointed blocks' inputs kept and on the host (the aco variant: the training
    forward inside train.activation_offload's hooks), each step timed."""
    results = bench_gpu.main(
        ["--suite", "offload", "--tiny", "--out", str(tmp_path), "--cases", "tiny video", "--train-cases",
         "tiny", "--variants", "ac,ac+aco", "--steps", "1", "--warmup", "0"]
    )  # fmt: skip
    rows = {(r["case"], r["variant"]): r for r in results["train"]}
    model = "tiny video (Wan-shaped) (tessera, Wan options, LoRA r32, float8 base, CPU offload)"
    assert set(rows) == {(model, "ac"), (model, "ac+aco")}, set(rows)
    assert all(r["seconds"] > 0 for r in rows.values())
