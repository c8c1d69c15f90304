"""scripts/bench_gpu.py runs end to end at tiny sizes on CPU (the GPU code path, small), and its
written-out FLOP count agrees with PyTorch's own FLOP counter."""

import json
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_gpu  # noqa: E402


@pytest.mark.parametrize("name", list(bench_gpu.TINY_CASES))
def test_flop_count_matches_torch_counter(name):
    from models.dit import DiT

    case = bench_gpu.TINY_CASES[name]
    (C, T, H, W), (L, text_dim), B = case["latent"], case["text"], case["batch"]
    model = DiT(
        C,
        text_dim,
        depth=case["depth"],
        hidden_size=case["hidden"],
        num_heads=case["heads"],
        patch_size=bench_gpu.PATCH,
        ffn_dim=case["ffn"],
    )
    with FlopCounterMode(display=False) as counter:
        model(
            torch.randn(B, C, T, H, W),
            torch.rand(B),
            torch.randn(B, L, text_dim),
            torch.ones(B, L, dtype=torch.bool),
        )
    written = bench_gpu.dit_flops(
        case["depth"], case["hidden"], case["ffn"], T * H * W // 4, L, B, C, text_dim
    )
    assert written == pytest.approx(counter.get_total_flops(), rel=0.1)


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
    }
    assert all(r["seconds"] > 0 and 0 < r["mfu"] for r in written["train"])
    assert [w["model"] for w in written["wan_ratio"]] == ["tessera", "tessera, Wan options"]
    assert all(w["speedup"] > 0 for w in written["wan_ratio"])
    assert written["lse"]["self_check"] is True
    assert written["sp"]["ratio"] > 0 and written["sampler"]["seconds_per_step"] > 0
    assert "| tiny image (tessera) | eager |" in (tmp_path / "results.md").read_text()
