"""HunyuanVideo 1.5's transformer (models/hunyuan_video15/) against diffusers'
HunyuanVideo15Transformer3DModel, code no one here wrote: a tiny random config, the same weights, padded
texts and glyph texts of other lengths, text-to-video (no image tokens here, diffusers' zero image masked
out) and image-to-video."""

import json
import shutil

import numpy as np
import pytest
import torch

from models.hunyuan_video15.family import HunyuanVideo15
from models.hunyuan_video15.transformer import HunyuanVideo15Cond
from models.hunyuan_video15.weights import HunyuanVideo15FormatError, build_transformer

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
    ours.load_state_dict(HunyuanVideo15().names.to_tessera(theirs.state_dict()), strict=True)
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


@torch.no_grad()
def test_bf16_timestep_rounds_as_the_pipeline():
    """In bf16 the pipeline hands the transformer 1000 sigma rounded to bf16 (980.39 -> 980.0) for the time
    and the refiner's embeddings: tessera's bf16 transformer, told sigma, rounds the same way, so its
    velocity is diffusers' bf16 one within bf16's own rounding (diffusers' float32 one is the reference)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs, ours = tiny_pair()
        x, text, glyph = torch.randn(1, 9, 2, 3, 5), torch.randn(1, 7, 24), torch.randn(1, 5, 20)
    sigma = torch.tensor([0.98039])
    timestep = (sigma * 1000).to(torch.bfloat16)  # the pipeline's: t.expand(B).to(latents.dtype)
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    kwargs = dict(
        encoder_hidden_states=text, encoder_hidden_states_2=glyph, image_embeds=torch.zeros(1, 3, 12)
    )
    kwargs = {k: v.to(torch.bfloat16) for k, v in kwargs.items()}
    masks = dict(encoder_attention_mask=torch.ones(1, 7), encoder_attention_mask_2=torch.ones(1, 5))
    want = theirs(x.to(torch.bfloat16), timestep, **kwargs, **masks, return_dict=False)[0].float()
    cond = HunyuanVideo15Cond(text.to(torch.bfloat16), None, glyph.to(torch.bfloat16), None)
    got = ours(
        x[:, :4].to(torch.bfloat16), sigma, HunyuanVideo15Cond(**{**vars(cond), "image_latents": x[:, 4:]})
    )
    diff = float((got.float() - want).abs().max())
    print(f"bf16: max abs {diff:.3f} on an output of std {float(want.std()):.2f}")
    assert diff <= 0.05  # unrounded, the timestep sits 0.39 off and the velocity ~1.4


def test_weight_names_and_config():
    """diffusers' names round-trip through tessera's; a config this transformer does not run is refused."""
    from diffusers import HunyuanVideo15Transformer3DModel

    theirs = HunyuanVideo15Transformer3DModel(**TINY)
    ours = build_transformer(dict(theirs.config))
    family = HunyuanVideo15()
    assert set(family.names.to_diffusers(ours.state_dict())) == set(theirs.state_dict())
    assert family.names.diffusers_name("blocks.1.attn.to_q") == "transformer_blocks.1.attn.to_q"
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
SIZE = dict(num_frames=5, height=24, width=40)  # the pipeline's keywords; 3 x 6 x 10 latents: 180 tokens


def tiny_pipeline(image_to_video: bool = False, config: dict = TINY):
    """A tiny random HunyuanVideo15Pipeline, float32: Qwen2.5-VL text model with the byte-level tokenizer of
    tests/test_qwen_image.py and Qwen's chat template, ByT5 (tokenizer and a small T5 encoder), diffusers'
    tiny causal VAE (4x, 2x), the transformer, a shifted scheduler and a guider; `image_to_video`: the
    HunyuanVideo15ImageToVideoPipeline, with a small SigLIP image encoder and its processor, and the
    transformer's target size 32 pixels (an 80 x 48 image picks 40 x 24). `config`: the transformer's (the
    encoders' widths follow it)."""
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
            d_model=config["text_embed_2_dim"],
            d_kv=10,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            feed_forward_proj="gated-gelu",
        )
    )
    target = dict(target_size=32) if image_to_video else {}
    transformer = HunyuanVideo15Transformer3DModel(**config, **target)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    parts = dict(
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=glyph_encoder.eval(),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
    )
    if not image_to_video:
        return HunyuanVideo15Pipeline(**parts)
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    return HunyuanVideo15ImageToVideoPipeline(**parts, **tiny_siglip(config["image_embed_dim"]))


def tiny_siglip(width: int) -> dict:
    """A small SigLIP image encoder `width` wide and its processor (16 x 16 pixels, 8 x 8 patches)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    siglip = SiglipVisionConfig(
        hidden_size=width,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    processor = SiglipImageProcessor(size={"height": 16, "width": 16})
    return dict(image_encoder=SiglipVisionModel(siglip).eval(), feature_extractor=processor)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan_video15") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_i2v(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan_video15_i2v") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline(image_to_video=True).save_pretrained(folder)
    return folder


def infer_args(saved, tmp_path, *extra) -> list:
    """infer.py's arguments on the folder `saved` (tests/test_families.py's, its row)."""
    from tests.test_families import infer_args

    return infer_args("hunyuan_video15", saved, tmp_path, *extra)


# (processes, overrides) of image-to-video (text-to-video: the row of tests/test_families.py): 180 tokens,
# split in 2 x 90 under ulysses; warm-up over every step: exact (its stale patches over frames below)
LAYOUTS = {
    "one-process": (1, []),
    "cfg2-ulysses2": (4, ["parallel.cfg=2", "parallel.ulysses=2"]),
    "pipefusion2": (2, ["parallel.pipefusion=2", "parallel.pipefusion_warmup=3"]),
}


def first_frame(tmp_path):
    """An 80 x 48 random PNG: both pipelines' image processors pick a 40 x 24 video for it."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "first.png")
    return tmp_path / "first.png"


@torch.no_grad()
@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[pytest.mark.slow] * (LAYOUTS[name][0] > 1)) for name in LAYOUTS]
)
def test_image_to_video_matches_the_pipeline(saved_i2v, tmp_path, capsys, layout):
    """infer.py --image (an 80 x 48 PNG cropped to 40 x 24, without --height and --width: the size the
    image picks) on the image-to-video folder against HunyuanVideo15ImageToVideoPipeline: two prompts (one
    with quoted glyph texts), a negative prompt, 3 steps, guidance 4, seeds 5 and 6, 5 frames: the same
    videos; on one process (the folder without --image refused), with the guidance branches and the heads
    split over 4 processes (tests/ranks.py), and under PipeFusion 2."""
    from PIL import Image

    import infer
    from tests.conftest import ranks, run_main
    from tests.test_families import assert_written, negative

    processes, overrides = LAYOUTS[layout]
    out = tmp_path / "video.npy"
    given = ["--prompt", *PROMPTS, "--negative-prompt", negative("hunyuan_video15")]
    argv = infer_args(saved_i2v, tmp_path, *given)
    argv += ["--steps", "3", "--guidance", "4", "--seed", "5", "--output", str(out), *overrides]
    at = argv.index("--height")
    del argv[at : at + 4]  # no --height or --width: the size the image picks
    if processes == 1:
        assert run_main(infer, argv) != 0
        assert "give the first frame with --image" in capsys.readouterr().err
    image = first_frame(tmp_path)
    argv += ["--image", str(image)]
    if processes == 1:
        assert run_main(infer, argv) == 0
    else:
        done = ranks(processes, "infer.py", *argv, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_written("hunyuan_video15", saved_i2v, out, PROMPTS, image=Image.open(image))


@pytest.mark.slow
@torch.no_grad()
def test_pipefusion_patches_over_frames_match_one_process(saved_i2v, tmp_path):
    """PipeFusion 2 (2 processes) with one warm-up step, image-to-video, guidance 4: the later steps run as
    two patches of whole token rows across the 3 latent frames (every frame's rows one under the other),
    the embedding reading the given frame's latents beside each; the video is that of the same schedule
    run item by item on one process (tests/test_families.py sequential_pipefusion), and the patches ran
    (whole steps differ)."""
    from PIL import Image

    from configs import load_config
    from models.families import family_named
    from models.sampler import Sampling
    from tests.conftest import ranks
    from tests.test_families import stale_patches

    image, out = first_frame(tmp_path), tmp_path / "video.npy"
    argv = infer_args(saved_i2v, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", NEGATIVE)
    argv += ["--steps", "3", "--guidance", "4", "--seed", "5", "--output", str(out), "--image", str(image)]
    done = ranks(2, "infer.py", *argv, "parallel.pipefusion=2", "parallel.pipefusion_warmup=1", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PipeFusion: 2 patches, 1 warm-up step(s)" in done.stdout, done.stdout
    family, cfg = family_named("hunyuan_video15"), load_config(argv[1], argv[2:7])
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    sampling = Sampling([PROMPTS[0]], [5], (5, 24, 40), 3, 4.0, NEGATIVE, cfg.text_encoder.max_length,
                        [Image.open(image)])  # fmt: skip
    diff, stale = stale_patches(family, parts, sampling, np.load(out))
    print(f"PipeFusion over frames vs one process item by item {diff:.2e} (vs whole steps {stale:.2e})")
    assert diff <= 1e-5 and stale > 10 * diff


def test_refusals(saved, saved_i2v, tmp_path, capsys):
    """What is its own to refuse: one error line naming it, before any process group."""
    import infer
    import train
    from tests.conftest import run_main

    base = infer_args(saved, tmp_path)
    cases = [
        (infer, ["parallel.pipefusion=2", "sample.cache=first_block"], "cannot run under PipeFusion"),
        (infer, ["--image", "x.png"], "--image: model.pretrained="),
        (train, ["model.task=i2v"], "leaves it at t2v"),
        (train, [f"model.pretrained={saved_i2v}"], "sample.images is empty"),  # its previews' frames
        (train, ["sample.images=[x.png]"], "sample.images=['x.png']: HunyuanVideo 1.5's previews from"),
        (train, ["data.audio=true"], "data.audio=true: the training of HunyuanVideo 1.5 reads no sound"),
        (
            infer,
            ["sample.modality_guidance=2"],
            "sample.modality_guidance=2.0: HunyuanVideo 1.5 takes no such guidance",
        ),
    ]
    from tests.test_families import parts_of_another_width

    # the glyphs' encoder's width (the VAE's and the text's, and its sizes and layouts: its row of
    # tests/test_families.py)
    glyphs = parts_of_another_width(saved, tmp_path, ("text_encoder_2",))
    cases += [(infer, extra, words) for extra, words in glyphs]
    rescaled = tmp_path / "rescaled"  # the folder with a guider tessera does not reproduce
    shutil.copytree(saved, rescaled)
    config = rescaled / "guider" / "guider_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_rescale": 0.7}))
    cases.append((infer, [f"model.pretrained={rescaled}"], "guidance_rescale=0.7"))
    for program, extra, expected in cases:
        argv = base[: base.index("--frames")] if program is train else base  # train.py takes no sizes
        assert run_main(program, [*argv, *extra]) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()


@torch.no_grad()
def test_first_block_cache_matches_diffusers_from_a_first_frame(saved_i2v, tmp_path, capsys):
    """sample.cache=first_block from a first frame (the embedding reads the given frame's latents) against
    diffusers' own first-block cache hooks on the image-to-video pipeline's transformer, unguided, 8 steps,
    threshold 0.4: the same steps run every block (fewer than 8) and the same video (text-to-video, and
    ring 2: the row of tests/test_families.py)."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock
    from PIL import Image

    import infer
    from tests.conftest import run_main
    from tests.test_families import pipeline_image

    out, image = tmp_path / "video.npy", first_frame(tmp_path)
    argv = infer_args(saved_i2v, tmp_path, "--prompt", PROMPTS[0], "--steps", "8", "--guidance", "1")
    argv += ["--seed", "5", "--output", str(out), "sample.cache=first_block", "--image", str(image)]
    argv += ["sample.cache_first_block_threshold=0.4", "sample.cache_max_skips=8"]
    at = argv.index("--height")
    del argv[at : at + 4]  # the size the image picks
    assert run_main(infer, argv) == 0
    full = float(capsys.readouterr().out.split("[tessera] step cache: ")[1].split(" of 8")[0])
    metadata = TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
    TransformerBlockRegistry.register(model_class=HunyuanVideo15TransformerBlock, metadata=metadata)
    pipe = DiffusionPipeline.from_pretrained(saved_i2v)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
    calls = []  # the last block's attention runs only when every block runs
    pipe.transformer.transformer_blocks[-1].attn.register_forward_hook(lambda *a: calls.append(1))
    want = pipeline_image(pipe, "hunyuan_video15", PROMPTS[0], 8, 5, 1.0, image=Image.open(image))
    diff = float(np.abs(np.load(out) - want).max())
    print(f"first_block: {full:g} of 8 steps ran every block (diffusers {len(calls)}), max abs {diff:.2e}")
    assert 1 < full < 8 and full == len(calls) and want.std() > 0.01
    assert diff <= 1e-5
