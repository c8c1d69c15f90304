"""scripts/export.py: a tessera checkpoint of a Wan-architecture DiT becomes a diffusers
WanTransformer3DModel folder that diffusers loads and that computes what tessera computes."""

import sys

import pytest
import torch

import train
from tests.conftest import ROOT, TINY, run_main

sys.path.insert(0, str(ROOT / "scripts"))
import export  # noqa: E402

WAN_OPTIONS = [
    "model.adaln=single",
    "model.qk_norm_across_heads=true",
    "model.pooled_text=false",
    "model.text_mask=false",
]


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    assert (
        run_main(
            train,
            [
                "--config",
                str(TINY),
                f"run.output_dir={run}",
                "train.max_steps=2",
                "train.checkpoint_every=2",
                *WAN_OPTIONS,
            ],
        )
        == 0
    )
    return run


@pytest.mark.parametrize("use_ema", [True, False], ids=["ema", "raw"])
def test_export_loads_in_diffusers_and_computes_the_same(wan_run, tmp_path, use_ema):
    from diffusers import WanTransformer3DModel

    from configs import load_config
    from models.dit.transformer import build_dit
    from parallel.checkpoints.checkpoint import load_weights

    out = tmp_path / "transformer"
    assert (
        export.main(["--checkpoint", str(wan_run), "--output", str(out), *([] if use_ema else ["--no-ema"])])
        == 0
    )
    reference = WanTransformer3DModel.from_pretrained(out).eval()
    cfg = load_config(wan_run / "config.yaml")
    model = build_dit(cfg.model, in_channels=3, text_dim=32)
    load_weights(wan_run / "checkpoints" / "step_2", model, use_ema=use_ema)
    g = torch.Generator().manual_seed(0)
    x, t, y = (
        torch.randn(2, 3, 4, 16, 16, generator=g),
        torch.rand(2, generator=g),
        torch.randn(2, 6, 32, generator=g),
    )
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        expected = model.eval()(x, t, y, mask)
        got = reference(x, t * 1000, y, return_dict=False)[0]
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
    # the EMA and the raw weights differ after two steps, so the flag is not a no-op
    other = build_dit(cfg.model, in_channels=3, text_dim=32)
    load_weights(wan_run / "checkpoints" / "step_2", other, use_ema=not use_ema)
    with torch.no_grad():
        assert not torch.allclose(other.eval()(x, t, y, mask), expected)


def test_a_non_wan_model_is_refused_with_the_options_to_set(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        run_main(
            train,
            ["--config", str(TINY), f"run.output_dir={run}", "train.max_steps=1", "train.checkpoint_every=1"],
        )
        == 0
    )
    with pytest.raises(
        ValueError,
        match="model.adaln=single model.qk_norm_across_heads=true model.pooled_text=false "
        "model.text_mask=false",
    ):
        export.main(["--checkpoint", str(run), "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
