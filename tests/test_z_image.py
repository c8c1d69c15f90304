"""models/z_image against diffusers, code no one here wrote: a tiny random ZImageTransformer2DModel,
AutoencoderKL, Qwen3 text encoder and byte-level BPE tokenizer with a chat template (all built here, nothing
downloaded). The transformer with diffusers' weights gives diffusers' output, negated (float32 and bf16, a
non-square latent, captions of several lengths); the prompt encoding is the pipeline's; the noise levels
and timesteps are the scheduler's as the pipeline uses them; the single file's names map both ways."""

import pytest
import torch

from models.z_image.family import ZImage
from models.z_image.text import encode_prompt
from models.z_image.transformer import ZImageCond
from models.z_image.weights import build_transformer, diffusers_from_original, original_from_diffusers
from tests.test_qwen_image import tiny_tokenizer

TEXT_DIM = 16
TINY_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=48,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=TEXT_DIM,
    axes_dims=[8, 8, 8],
    axes_lens=[512, 64, 64],
)
VAE = dict(  # 4x spatial compression (the release's FLUX VAE: 8x), a shift and a scale that matter
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 16, 16],
    down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
    layers_per_block=1, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
)  # fmt: skip
SCHEDULER = dict(shift=3.0)  # Z-Image-Turbo's static shift
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
    "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def z_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def tiny_text_encoder(vocab_size: int):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=vocab_size, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3Model(config).eval()


def tiny_z_image_pipeline(**transformer):
    """The tiny diffusers ZImagePipeline, float32, seeded; its pad tokens and final layer not zero."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    tokenizer = z_tokenizer()
    encoder = tiny_text_encoder(len(tokenizer))
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(**{**TINY_TRANSFORMER, **transformer}).eval()
    with torch.no_grad():  # diffusers initialises these to zero; a test of them needs them not to be
        for name, p in model.named_parameters():
            if "pad_token" in name or "final_layer" in name or "adaLN" in name:
                p.normal_(0, 0.5 if "pad_token" in name else 0.1)
    torch.manual_seed(0)
    vae = AutoencoderKL(**VAE).eval()
    pipe = ZImagePipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae, encoder, tokenizer, model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return tiny_z_image_pipeline()


def tessera_model(pipe, dtype=torch.float32):
    model = build_transformer(dict(pipe.transformer.config))
    model.load_state_dict(ZImage().names.to_tessera(pipe.transformer.state_dict()), strict=True)
    return model.to(dtype).eval()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_matches_diffusers(pipe, dtype):
    """Two captions of 5 and 37 tokens (padded to 32 and 64), a 6 x 10 latent (30 tokens, padded to 32):
    tessera's velocity is the negated output of diffusers' model, given the caption list as the pipeline
    gives it."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, 1, 6, 10)
    t = torch.tensor([0.3, 0.8])
    lengths = (5, 37)
    text = torch.randn(2, max(lengths), TEXT_DIM)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    theirs = pipe.transformer.to(dtype)
    try:
        want = theirs(list(x.to(dtype).unbind(0)), t, [text[i, :n].to(dtype) for i, n in enumerate(lengths)])
        want = -torch.stack([o.float() for o in want[0]])
    finally:
        pipe.transformer.float()
    got = tessera_model(pipe, dtype)(x.to(dtype), t, ZImageCond(text.to(dtype), mask))
    assert got.dtype == torch.float32 and got.shape == x.shape and want.std() > 0.1
    diff = float((got - want).abs().max())
    print(f"{dtype}: max abs diff {diff:.2e}")
    assert diff <= (1e-5 if dtype == torch.float32 else 1e-3)  # 0.0 and 0.0 here


@torch.no_grad()
def test_prompt_encoding_matches_the_pipeline(pipe):
    prompts = ["a cat", "a much longer prompt about a lighthouse at night in the rain"]
    want = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=64)[0]
    got, mask = encode_prompt(prompts, pipe.tokenizer, pipe.text_encoder, 64)
    assert mask is not None and [int(m.sum()) for m in mask] == [len(w) for w in want]
    for i, w in enumerate(want):
        assert torch.equal(got[i, : len(w)], w) and not got[i, len(w) :].any()


@pytest.mark.parametrize("steps", [1, 4, 9])
@pytest.mark.parametrize("config", [dict(shift=3.0), dict(shift=6.0), dict(use_dynamic_shifting=True)])
def test_schedule_matches_the_scheduler(config, steps):
    """The levels and the model's time the pipeline derives from FlowMatchEulerDiscreteScheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    latents = torch.zeros(1, 4, 1, 40, 24)
    mu = calculate_shift(20 * 12)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)

    class Parts:
        scheduler_config = dict(scheduler.config)

    schedule = ZImage().steps.schedule(Parts, steps, latents)
    assert torch.equal(schedule.sigmas, scheduler.sigmas)
    assert torch.equal(schedule.timesteps, (1000 - scheduler.timesteps) / 1000)


def test_single_file_names_round_trip(pipe):
    """The release's names (fused qkv, attention.out, q_norm) under ComfyUI's prefix and without, as
    diffusers' own single-file conversion reads them."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    state = pipe.transformer.state_dict()
    for prefix in ("", "model.diffusion_model."):
        original = original_from_diffusers(state, prefix)
        assert any(k.endswith("attention.qkv.weight") for k in original)
        theirs = convert_z_image_transformer_checkpoint_to_diffusers(dict(original))
        ours = diffusers_from_original(original)
        assert ours.keys() == theirs.keys() == state.keys()
        assert all(torch.equal(ours[k], state[k]) and torch.equal(theirs[k], state[k]) for k in state)
    assert diffusers_from_original(state).keys() == state.keys()  # diffusers' names pass as they are


@torch.no_grad()
@pytest.mark.parametrize(
    "guidance, terms, processes",
    [
        (0.0, {}, 1),  # Turbo's: the prompt alone, no negative branch
        # the last 2 of 4 steps (1 - sigma 0.25, 0.5 at shift 3) unguided, the norm capped
        (3.0, dict(cfg_truncation=0.2, cfg_normalization=1.05), 1),
        # the same with the branches on two processes (parallel.cfg=2)
        pytest.param(3.0, dict(cfg_truncation=0.2, cfg_normalization=1.05), 2, marks=pytest.mark.slow),
    ],
)
def test_guidance_terms_match_the_pipeline(pipe, tmp_path, guidance, terms, processes):
    """infer.py with --guidance and sample.cfg_truncation / cfg_normalization gives ZImagePipeline's image
    for guidance_scale, cfg_truncation and cfg_normalization (a factor, as the pipeline reads it); each
    term changes the image."""
    import numpy as np

    import infer
    from tests.conftest import ROOT, ranks, run_main

    folder = tmp_path / "pipeline"
    pipe.save_pretrained(folder)
    parts = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    argv = ["--config", str(ROOT / "configs" / "z-image.yaml"), "model.size=auto", *parts, "--frames", "1",
            "--height", "40", "--width", "24", "--prompt", "a red square", "--negative-prompt", "blurry",
            "--steps", "4", "--seed", "3", "--guidance", str(guidance)]  # fmt: skip
    argv += [f"sample.{k}={v}" for k, v in terms.items()]
    argv += ["--output", str(tmp_path / "got.npy")]
    if processes == 1:
        assert run_main(infer, argv) == 0
    else:
        done = ranks(processes, "infer.py", *argv, "parallel.cfg=2", timeout=240)
        assert done.returncode == 0 and "cfg=2" in done.stdout, done.stderr[-3000:]

    def sample(**kwargs):
        keywords = dict(guidance_scale=guidance, cfg_truncation=1.0, cfg_normalization=0.0) | kwargs
        return pipe(
            "a red square", negative_prompt="blurry", height=40, width=24, num_inference_steps=4,
            generator=torch.Generator().manual_seed(3), output_type="np", **keywords,
        ).images[0]  # fmt: skip

    want, got = sample(**terms), np.load(tmp_path / "got.npy")[0]
    diff = float(np.abs(got - want).max())
    print(f"guidance {guidance} {terms}: infer.py vs ZImagePipeline max abs diff {diff:.2e}")
    assert diff <= 1e-5 and want.std() > 0.01
    for key in terms:  # each term alone left at its default gives another image
        assert float(np.abs(sample(**{k: v for k, v in terms.items() if k != key}) - want).max()) > 1e-3, key


def test_a_scheduler_config_without_its_step_count_reads_as_the_pipelines():
    """A scheduler_config.json without num_train_timesteps is diffusers' 1000 (it raised KeyError); another
    count is refused by name."""
    ZImage().check_scheduler({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    with pytest.raises(ValueError, match="num_train_timesteps=500"):
        ZImage().check_scheduler({"num_train_timesteps": 500})
