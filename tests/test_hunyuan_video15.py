"""HunyuanVideo 1.5's transformer (models/hunyuan_video15/) against diffusers'
HunyuanVideo15Transformer3DModel, code no one here wrote: a tiny random config, the same weights, padded
texts and glyph texts of other lengths, text-to-video (no image tokens here, diffusers' zero image masked
out) and image-to-video."""

import numpy as np
import pytest
import torch

from models.hunyuan_video15.transformer import HunyuanVideo15Cond
from models.hunyuan_video15.weights import (
    HunyuanVideo15FormatError,
    build_transformer,
    diffusers_state_dict_from_tessera,
    tessera_state_dict_from_diffusers,
)

# a diffusers config of a tiny transformer (weights.py reads it)
TINY = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)


def tiny_pair():
    """(diffusers' transformer, tessera's built from its config by weights.py) with the same random weights,
    float32."""
    from diffusers import HunyuanVideo15Transformer3DModel

    theirs = HunyuanVideo15Transformer3DModel(**TINY).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    ours = build_transformer(dict(theirs.config)).eval()
    ours.load_state_dict(tessera_state_dict_from_diffusers(theirs.state_dict()), strict=True)
    return theirs, ours


@torch.no_grad()
@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_transformer_matches_diffusers(task):
    """The velocity of both at a 2 x 3 x 5 token grid (non-square), two samples at timesteps 750 and 250,
    Qwen texts of 7 tokens (one padded to 3 real), glyph texts of 5 (one padded to 2 real)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs, ours = tiny_pair()
        x = torch.randn(2, 9, 2, 3, 5)
        text, glyph = torch.randn(2, 7, 24), torch.randn(2, 5, 20)
        image = torch.randn(2, 3, 12) if task == "i2v" else torch.zeros(2, 3, 12)
    text_mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    glyph_mask = torch.tensor([[1, 1, 0, 0, 0], [1] * 5])
    t = torch.tensor([0.75, 0.25])
    want = theirs(
        hidden_states=x,
        timestep=t * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=image,
        return_dict=False,
    )[0]
    given = image if task == "i2v" else None  # text-to-video: diffusers' zeros are masked out
    cond = HunyuanVideo15Cond(text, text_mask.bool(), glyph, glyph_mask.bool(), given)
    got = ours(x[:, :4], t, HunyuanVideo15Cond(**{**vars(cond), "image_latents": x[:, 4:]}))
    diff = float((got - want).abs().max())
    print(f"{task}: max abs {diff:.2e}, output std {float(want.std()):.3f}")
    assert got.shape == want.shape == (2, 4, 2, 3, 5) and want.std() > 0.1
    assert diff <= 1e-5


def test_weight_names_and_config():
    """diffusers' names round-trip through tessera's; a config this transformer does not run is refused."""
    from diffusers import HunyuanVideo15Transformer3DModel

    theirs = HunyuanVideo15Transformer3DModel(**TINY)
    ours = build_transformer(dict(theirs.config))
    assert set(diffusers_state_dict_from_tessera(ours.state_dict())) == set(theirs.state_dict())
    assert any(k.startswith("blocks.1.") for k in ours.state_dict())
    for wrong, words in [(dict(use_meanflow=True), "use_meanflow"), (dict(qk_norm="layer_norm"), "qk_norm")]:
        with pytest.raises(HunyuanVideo15FormatError, match=words):
            build_transformer({**dict(theirs.config), **wrong})


# Qwen's chat template, enough of it for the pipeline's system + user turns and the generation prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ['a sign reading "open" and "late" in the rain', "a dog"]  # glyph texts in one, none in the other
NEGATIVE = "blurry"
SIZE = dict(frames=5, height=24, width=40)  # 3 x 6 x 10 latents: 180 tokens


def tiny_pipeline():
    """A tiny random HunyuanVideo15Pipeline, float32: Qwen2.5-VL text model with the byte-level tokenizer of
    tests/test_qwen_image.py and Qwen's chat template, ByT5 (tokenizer and a small T5 encoder), diffusers'
    tiny causal VAE (4x, 2x), the transformer, a shifted scheduler and a guider."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    from tests.test_qwen_image import tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    rope = {"mrope_section": [2, 2, 2], "rope_type": "default", "type": "default"}  # head dim 12
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            hidden_size=24,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling=rope,
            rope_theta=1e6,
            vocab_size=len(tokenizer),
        )
    )
    glyph_encoder = T5EncoderModel(
        T5Config(
            vocab_size=384,
            d_model=20,
            d_kv=10,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            feed_forward_proj="gated-gelu",
        )
    )
    transformer = HunyuanVideo15Transformer3DModel(**TINY)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=glyph_encoder.eval(),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan_video15") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline().save_pretrained(folder)
    return folder


@torch.no_grad()
def test_infer_matches_the_pipeline(saved, tmp_path):
    """infer.py --config configs/hunyuanvideo-1.5-480p.yaml on the folder (model.size=auto) against
    HunyuanVideo15Pipeline from it: two prompts (one with quoted glyph texts), a negative prompt, 3 steps,
    guidance 4, seeds 5 and 6, 5 frames at 24 x 40: the same videos, prompt by prompt."""
    from diffusers import DiffusionPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    import infer
    from tests.conftest import ROOT, run_main

    out = tmp_path / "video.npy"
    argv = ["--config", str(ROOT / "configs" / "hunyuanvideo-1.5-480p.yaml"), "model.size=auto"]
    argv += [f"{key}.pretrained={saved}" for key in ("model", "vae", "text_encoder")]
    argv += [f"run.output_dir={tmp_path / 'run'}", "--prompt", *PROMPTS, "--negative-prompt", NEGATIVE]
    argv += ["--frames", "5", "--height", "24", "--width", "40", "--steps", "3", "--guidance", "4"]
    argv += ["--seed", "5", "--output", str(out)]
    assert run_main(infer, argv) == 0
    pipe = DiffusionPipeline.from_pretrained(saved)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=4.0)
    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(PROMPTS):
        want = pipe(
            prompt=prompt,
            negative_prompt=NEGATIVE,
            num_inference_steps=3,
            num_frames=5,
            height=24,
            width=40,
            generator=torch.Generator().manual_seed(5 + i),
            output_type="np",
        ).frames[0]
        got = np.load(tmp_path / f"video_{i:03d}.npy")
        diff = float(np.abs(got - want).max())
        print(f"prompt {i}: infer.py vs HunyuanVideo15Pipeline max abs {diff:.2e}")
        assert got.shape == want.shape == (5, 24, 40, 3) and want.std() > 0.01
        assert diff <= 1e-5


def test_refusals(saved, tmp_path, capsys):
    """What the family does not run yet: one error line naming it, before any process group."""
    import infer
    import train
    from tests.conftest import ROOT, run_main

    base = ["--config", str(ROOT / "configs" / "hunyuanvideo-1.5-480p.yaml"), "model.size=auto"]
    base += [f"{key}.pretrained={saved}" for key in ("model", "vae", "text_encoder")]
    base += [f"run.output_dir={tmp_path / 'run'}"]
    cases = [
        (infer, ["--frames", "4"], "--frames"),  # a causal VAE: 1 + 2k frames
        (infer, ["--height", "26"], "height"),
        (infer, ["parallel.ulysses=2"], "does not sample under parallel.ulysses=2"),
        (infer, ["--image", "x.png"], "--image"),
        (infer, ["sample.cache=first_block"], "does not run the step cache"),
        (train, [], "training it is not built yet"),
    ]
    for program, extra, expected in cases:
        assert run_main(program, [*base, *extra]) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()
