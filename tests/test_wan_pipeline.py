"""tessera's DiT on diffusers' WanPipeline, code no one here wrote: a tiny random pipeline folder
(transformer, AutoencoderKLWan, UMT5 with the ByT5 tokenizer, FlowMatchEulerDiscreteScheduler with
shift 3) and a recipe of its dimensions. infer.py against the pipeline is the Wan row of
tests/test_families.py; here what is Wan's own: a fine-tuned run exported back into diffusers, Wan 2.2's
two experts (sampling, and training as two runs), model.size=auto against the explicit recipe."""

import sys

import numpy as np
import pytest
import torch

import infer
import train
from tests.conftest import ROOT, ranks, run_main
from tests.test_wan import TINY_WAN

sys.path.insert(0, str(ROOT / "scripts"))
import export  # noqa: E402

RECIPE = """
model:
  size: DiT-tiny          # 2 layers, 64 wide, 4 heads: the pipeline's transformer below
  patch_size: [1, 2, 2]
  adaln: single
  qk_norm_across_heads: true
  pooled_text: false
  text_mask: false
  ffn_dim: 32
  pretrained: {pipe}
vae:
  kind: wan
  pretrained: {pipe}
text_encoder:
  kind: umt5
  pretrained: {pipe}
  max_length: 40
flow:
  shift: 3.0
  shift_reference_tokens: 0   # Wan's fixed shift
sample:
  steps: 3
  guidance: 5.0
  prompts: ["a red square moving left"]
data:
  frames: 5      # 1 + 4k for the causal VAE
  height: 32
  width: 32
  synthetic_samples: 8
  num_workers: 0
train:
  max_steps: 2
  batch_size: 2
  lr: 1.0e-3
  warmup_steps: 1
  checkpoint_every: 2
logging:
  wandb: false
"""
PROMPT = "a red square moving left"


def diffusers_video(pipe, max_sequence_length=40, **extra) -> np.ndarray:
    """The video a diffusers Wan pipeline samples with the recipe's prompt, size, steps, guidance and seed."""
    return pipe(
        prompt=PROMPT,
        negative_prompt="",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=5.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        max_sequence_length=max_sequence_length,
        **extra,
    ).frames[0]


def pipeline_sample(folder, lora=None) -> np.ndarray:
    """diffusers' WanPipeline from `folder`, with `lora` (a LoRA file) loaded by load_lora_weights."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return diffusers_video(pipe)


def infer_sample(recipe, run, out, *extra) -> np.ndarray:
    assert (
        run_main(
            infer,
            [
                "--config",
                str(recipe),
                f"run.output_dir={run}",
                "--frames",
                "5",
                "--height",
                "32",
                "--width",
                "32",
                "--prompt",
                PROMPT,
                "--output",
                str(out),
                *extra,
            ],
        )
        == 0
    )
    return np.load(out)


# The tiny pipeline's pieces, shared with tests/test_image_to_video.py.
TINY_TRANSFORMER = dict(TINY_WAN, num_attention_heads=4, attention_head_dim=16, rope_max_seq_len=32)


def perturb(transformer):
    """Zero-initialised layers would make the output constant: every weight gets some noise."""
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def tiny_vae_and_text_encoder():
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=384,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    return vae, text_encoder


def tiny_wan_pipeline():
    """A tiny random WanPipeline (the scheduler's shift the recipe's flow.shift, 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import ByT5Tokenizer

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
    perturb(transformer)
    vae, text_encoder = tiny_vae_and_text_encoder()
    return WanPipeline(
        tokenizer=ByT5Tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("wanpipe")
    tiny_wan_pipeline().save_pretrained(root / "pipe")
    recipe = root / "wan.yaml"
    recipe.write_text(RECIPE.format(pipe=root / "pipe"))
    return root / "pipe", recipe


def test_fine_tuned_and_exported_pipeline_samples_what_infer_samples(tiny_pipeline, tmp_path):
    """Fine-tune from the pipeline folder, export the run as a whole WanPipeline (raw weights): diffusers
    samples from
    it what infer.py samples from the checkpoint, and not what the untouched pipeline samples."""
    pipe_dir, recipe = tiny_pipeline
    run = tmp_path / "run"
    assert run_main(train, ["--config", str(recipe), f"run.output_dir={run}"]) == 0
    # the raw weights (the EMA, at decay 0.999, has barely moved in two steps)
    assert (
        export.main(
            ["--checkpoint", str(run), "--output", str(tmp_path / "exported"), "--pipeline", "--no-ema"]
        )
        == 0
    )
    exported = pipeline_sample(tmp_path / "exported")
    tessera = infer_sample(
        recipe, run, tmp_path / "tessera.npy", "--no-ema"
    )  # the checkpoint wins over model.pretrained
    assert np.abs(exported - tessera).max() <= 1e-4
    assert np.abs(exported - pipeline_sample(pipe_dir)).max() > 1e-3  # two steps of training show
    with pytest.raises(ValueError, match="flow.shift_reference_tokens=0"):
        export.main(
            [
                "--checkpoint",
                str(run),
                "--output",
                str(tmp_path / "x"),
                "--pipeline",
                "--config",
                str(write_scaled_shift(recipe, tmp_path)),
            ]
        )


def write_scaled_shift(recipe, tmp_path):
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(recipe.read_text().replace("shift_reference_tokens: 0", "shift_reference_tokens: 256"))
    return scaled


@pytest.fixture(scope="module")
def a14b_pipeline(tiny_pipeline, tmp_path_factory):
    """The tiny pipeline with a second, low-noise transformer_2 and boundary_ratio 0.9, and its recipe."""
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe_dir, recipe = tiny_pipeline
    pipe = WanPipeline.from_pretrained(pipe_dir)
    torch.manual_seed(1)
    low = WanTransformer3DModel(**TINY_TRANSFORMER)
    perturb(low)
    root = tmp_path_factory.mktemp("a14b")
    WanPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=pipe.transformer,
        transformer_2=low,
        scheduler=pipe.scheduler,
        boundary_ratio=0.9,
    ).save_pretrained(root / "pipe")
    recipe_2 = root / "a14b.yaml"
    recipe_2.write_text(recipe.read_text().replace(str(pipe_dir), str(root / "pipe")))
    return root / "pipe", recipe_2


def test_wan22_two_experts_sample_what_wan_pipeline_samples(tiny_pipeline, a14b_pipeline, tmp_path, capsys):
    """Wan 2.2 A14B's pairing: a WanPipeline folder with transformer_2 and boundary_ratio 0.9, sampled by
    diffusers with guidance_scale_2 and by infer.py (both experts from the one folder): the same video, on
    one process and under cfg 2. Of the 3 steps (timesteps 1000, 751, 9 at shift 3) the first is the
    high-noise expert's. A second guidance without a second expert is refused by name."""
    from diffusers import WanPipeline

    pipe_dir, recipe = tiny_pipeline
    folder, recipe_2 = a14b_pipeline
    pair = WanPipeline.from_pretrained(folder)
    expected = diffusers_video(pair, guidance_scale_2=3.0)
    alone = pipeline_sample(pipe_dir)  # the high-noise expert alone
    assert np.abs(expected - alone).max() > 1e-3  # the low-noise expert counts
    video = infer_sample(recipe_2, tmp_path / "run", tmp_path / "pair.npy", "sample.guidance_2=3.0")
    assert np.abs(video - expected).max() <= 1e-5, np.abs(video - expected).max()
    # cfg 2: each half of the ranks runs one branch of whichever expert the step belongs to
    args = [
        "--config",
        str(recipe_2),
        f"run.output_dir={tmp_path / 'run'}",
        "--frames",
        "5",
        "--height",
        "32",
    ]
    args += [
        "--width",
        "32",
        "--prompt",
        PROMPT,
        "--output",
        str(tmp_path / "cfg.npy"),
        "sample.guidance_2=3.0",
    ]
    result = ranks(2, "infer.py", *args, "parallel.cfg=2", timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.abs(np.load(tmp_path / "cfg.npy") - expected).max() <= 1e-5
    single = ["--config", str(recipe), f"run.output_dir={tmp_path / 'run1'}", "sample.guidance_2=3.0"]
    assert run_main(infer, single) == 2
    assert (
        "sample.guidance_2, sample.boundary and model.pretrained_2 are for Wan 2.2's two experts"
        in capsys.readouterr().err
    )


def test_wan22_experts_train_as_two_runs_and_pair(a14b_pipeline, tmp_path, capsys, monkeypatch):
    """model.expert=high and =low train Wan 2.2's experts as two runs of one recipe (the low one from the
    folder's transformer_2/, both on their side of boundary_ratio); infer.py pairs the runs (run.output_dir
    the high one, model.pretrained_2 the low one) and samples what diffusers samples from the pair
    exported as one WanPipeline (--low-noise-expert); the pair the other way round is refused by name."""
    from diffusers import WanPipeline

    from models.flow import RectifiedFlow

    folder, recipe = a14b_pipeline
    runs = {expert: tmp_path / expert for expert in ("high", "low")}
    drawn = []  # the training timesteps, seen where train.py's flow draws them
    unrestricted = RectifiedFlow.sample_timestep
    monkeypatch.setattr(
        RectifiedFlow, "sample_timestep", lambda *a: drawn.append(unrestricted(*a)) or drawn[-1]
    )
    for expert, run in runs.items():
        args = ["--config", str(recipe), f"run.output_dir={run}", f"model.expert={expert}"]
        assert run_main(train, args) == 0
        assert len(drawn) == 4 and all(t >= 0.9 if expert == "high" else t < 0.9 for t in drawn), drawn
        drawn.clear()
    assert (runs["high"] / "config.yaml").read_text().count("boundary: 0.9") == 1
    assert str(folder / "transformer_2") in (runs["low"] / "config.yaml").read_text()
    exported = tmp_path / "pair"
    assert (
        export.main(
            ["--checkpoint", str(runs["high"]), "--output", str(exported), "--pipeline", "--no-ema"]
            + ["--low-noise-expert", str(runs["low"])]
        )
        == 0
    )
    expected = diffusers_video(WanPipeline.from_pretrained(exported), guidance_scale_2=3.0)
    pair = [f"model.pretrained_2={runs['low']}", "sample.guidance_2=3.0", "--no-ema"]
    video = infer_sample(recipe, runs["high"], tmp_path / "pair.npy", *pair)
    assert np.abs(video - expected).max() <= 1e-4, np.abs(video - expected).max()
    # each trained expert shows: the pair with either one untrained samples another video
    low_untrained = infer_sample(recipe, runs["high"], tmp_path / "a.npy", *pair[1:])
    high_untrained = infer_sample(recipe, tmp_path / "none", tmp_path / "b.npy", *pair)
    assert min(np.abs(video - v).max() for v in (low_untrained, high_untrained)) > 1e-3
    swapped = ["--config", str(recipe), f"run.output_dir={runs['low']}", f"model.pretrained_2={runs['high']}"]
    assert run_main(infer, swapped) == 2
    assert "trained the low-noise expert, but would sample the high-noise steps" in capsys.readouterr().err


def auto_recipe(recipe, tmp_path):
    """The recipe with model.size=auto and no architecture key: the folder decides them all."""
    import re

    text = recipe.read_text()
    model = re.search(r"model:\n((?:  .*\n)+)", text)
    pretrained = re.search(r"  pretrained: .*\n", model.group(1)).group(0)
    auto = tmp_path / "auto.yaml"
    auto.write_text(text.replace(model.group(0), "model:\n  size: auto\n" + pretrained))
    return auto


def architecture(cfg):
    from models.dit.transformer import build_dit

    with torch.device("meta"):
        return build_dit(cfg.model, in_channels=4, text_dim=16).architecture()


def test_model_size_auto_takes_every_architecture_key_from_the_folder(tiny_pipeline, tmp_path, capsys):
    """model.size=auto with nothing else builds the explicit recipe's DiT and samples its video; a key
    the folder contradicts is an error naming it."""
    from configs import ConfigError, load_config

    pipe_dir, recipe = tiny_pipeline
    auto = auto_recipe(recipe, tmp_path)
    assert architecture(load_config(auto)) == architecture(load_config(recipe))
    assert load_config(auto).model.size == "DiT-tiny"
    video = infer_sample(auto, tmp_path / "run", tmp_path / "auto.npy")
    assert np.abs(video - infer_sample(recipe, tmp_path / "run", tmp_path / "explicit.npy")).max() == 0
    with pytest.raises(ConfigError, match=r"model.ffn_dim=64 contradicts"):
        load_config(auto, ["model.ffn_dim=64"])
    with pytest.raises(ConfigError, match=r"model.depth=7 contradicts"):  # a named size's folder too
        load_config(auto, ["model.depth=7"])


@pytest.mark.parametrize(
    "prompt", ["  a  red\tsquare\n moving  ", "cats &amp;amp; dogs", "a\u3000wide\u00a0space", "a\x1c\x1fb"]
)
def test_prompts_are_cleaned_as_wan_pipelines_clean_them(prompt):
    """models/text_encoder.py wan_prompt against diffusers' prompt_clean (code no one here wrote): runs of
    whitespace, HTML entities twice, the separators regex does not take for spaces."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    from models.text_encoder import wan_prompt

    assert wan_prompt(prompt) == prompt_clean(prompt)
