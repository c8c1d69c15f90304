"""models/qwen_image against diffusers, code no one here wrote: a tiny random QwenImageTransformer2DModel,
AutoencoderKLQwenImage, Qwen2.5-VL text encoder and byte-level BPE tokenizer (all built here, nothing
downloaded). The transformer with diffusers' weights gives diffusers' velocity (float32 and bf16, a
non-square latent, a padded text mask); the prompt encoding is the pipeline's encode_prompt; the sigmas
are the scheduler's; and a short loop of the family's pieces gives QwenImagePipeline's image."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.families import family_named
from models.qwen_image import (
    JointAttention,
    QwenImageCond,
    QwenImageFormatError,
    build_transformer,
    calculate_shift,
    denormalize_latents,
    diffusers_config_from_kwargs,
    diffusers_state_dict_from_original,
    diffusers_state_dict_from_tessera,
    encode_prompt,
    image_tokens,
    initial_noise,
    normalize_latents,
    original_state_dict_from_diffusers,
    pack_latents,
    sigmas,
    tessera_state_dict_from_diffusers,
    transformer_kwargs_from_diffusers_config,
    true_cfg,
    unpack_latents,
)
from models.qwen_image.transformer import QwenRope

TEXT_DIM = 16  # the tiny text encoder's width = the transformer's joint_attention_dim
TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,  # 4 latent channels, packed 2x2
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=TEXT_DIM,
    axes_dims_rope=(4, 6, 6),
)
VAE_CONFIG = dict(  # 4x spatial compression; a mean and std that matter
    base_dim=24,
    z_dim=4,
    dim_mult=[1, 2, 4],
    num_res_blocks=1,
    temperal_downsample=[False, True],
    latents_mean=[0.1, -0.2, 0.3, 0.05],
    latents_std=[0.5, 1.5, 2.0, 0.8],
)
# Qwen-Image's released scheduler_config.json (dynamic shift from the image token count, shift_terminal)
QWEN_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def tiny_tokenizer():
    """A byte-level BPE over the 256 byte symbols and a few merges, with Qwen's chat special tokens."""
    from tokenizers import AddedToken
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {symbol: i for i, symbol in enumerate(specials + sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "a"), ("Ġ", "t"), ("e", "r"), ("i", "n"), ("o", "n"), ("Ġ", "s")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in specials[1:]], special_tokens=True)
    return tokenizer


def tiny_text_encoder(vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}
    text = dict(
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_scaling=rope,
        rope_theta=1e6,
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=vocab_size, hidden_size=16)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def pipe():
    return tiny_qwen_pipeline()


def tiny_qwen_pipeline(**transformer):
    """The tiny diffusers QwenImagePipeline, float32, seeded (`transformer`: config keys over TINY's)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = tiny_tokenizer()
    text_encoder = tiny_text_encoder(len(tokenizer))
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(**{**TINY_TRANSFORMER, **transformer}).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**VAE_CONFIG).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    pipe = QwenImagePipeline(scheduler, vae, text_encoder, tokenizer, transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def model(pipe):
    """tessera's transformer from the diffusers config, holding the diffusers model's weights."""
    model = build_transformer(dict(pipe.transformer.config)).eval()
    model.load_state_dict(tessera_state_dict_from_diffusers(pipe.transformer.state_dict()), strict=True)
    return model


def diffusers_velocity(transformer, x, sigma, text, mask):
    """The diffusers transformer as its pipeline calls it: packed latents, timestep (1000 sigma in the
    latents' dtype) / 1000, the mask as a long tensor; unpacked back to (B, C, 1, H, W)."""
    grid = (1, x.shape[3] // 2, x.shape[4] // 2)
    out = transformer(
        hidden_states=pack_latents(x),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=None if mask is None else mask.long(),
        timestep=(sigma * 1000).to(x.dtype) / 1000,
        img_shapes=[[grid]] * x.shape[0],
        return_dict=False,
    )[0]
    return unpack_latents(out, grid)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_transformer_matches_diffusers(pipe, model, dtype):
    """A non-square latent (10 x 14: a 5 x 7 token grid, so the image's RoPE centre and the text's offset
    max(h//2, w//2) differ by axis), two samples at different sigmas, the second's text padded."""
    theirs, ours = pipe.transformer.to(dtype), model.to(dtype)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 4, 1, 10, 14, generator=g).to(dtype)
        text = torch.randn(2, 7, TEXT_DIM, generator=g).to(dtype)
        mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
        sigma = torch.tensor([0.7, 0.3])
        reference = diffusers_velocity(theirs, x, sigma, text, mask)
        velocity = ours(x, sigma, QwenImageCond(text, mask))
        unmasked = ours(x, sigma, QwenImageCond(text, None))
    finally:
        theirs.float(), ours.float()
    diff = (velocity.float() - reference.float()).abs().max().item()
    print(f"transformer ({dtype}) max abs difference from diffusers: {diff:.3g}")
    assert velocity.shape == reference.shape == (2, 4, 1, 10, 14)
    # bf16: the same ops in the same order (0 here); the bound still catches a timestep or RoPE rounded
    # differently, which moves the output by more than half its range
    assert diff <= (1e-5 if dtype == torch.float32 else 1e-2 * reference.float().abs().max().item())
    # the mask matters (the padded sample changes without it), so the comparison above can fail
    assert (unmasked[1] - velocity[1]).abs().max() > 1e-3 and torch.equal(unmasked[0], velocity[0])


def test_rope_matches_diffusers():
    """The angles of diffusers' QwenEmbedRope (scale_rope) for a video-shaped grid with odd sides: image
    angles with the tokens first (they travel through sequence.shard), then the text's."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    grid, text_len = (2, 5, 4), 9
    image, text = QwenRope((4, 6, 6))(grid, text_len, "cpu")
    ref_image, ref_text = QwenEmbedRope(10000, [4, 6, 6], scale_rope=True)([grid], "cpu", text_len)
    assert image.shape == (2 * 5 * 4, 8, 2) and text.shape == (text_len, 8, 2)
    assert torch.equal(image, torch.view_as_real(ref_image))
    assert torch.equal(text, torch.view_as_real(ref_text))


def test_joint_attention_operator():
    """The single-device contract: heads in dim 1, both streams out, padded text keys without influence,
    and the result of one attention over [text, image]."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    tq, tk, tv = (torch.randn(2, 3, 4, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    op = JointAttention()
    assert op.kind == "joint"
    image, text = op(q, k, v, tq, tk, tv, mask)
    assert image.shape == q.shape and text.shape == tq.shape
    noise = torch.randn(2, 3, 2, 8, generator=g)
    tk2, tv2 = tk.clone(), tv.clone()
    tk2[1, :, 2:], tv2[1, :, 2:] = noise[1], noise[1]  # change only the padded text keys and values
    image2, text2 = op(q, k, v, tq, tk2, tv2, mask)
    assert torch.allclose(image, image2, atol=1e-6) and torch.allclose(text, text2, atol=1e-6)
    joint = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([tq, q], 2), torch.cat([tk, k], 2), torch.cat([tv, v], 2)
    )
    image3, text3 = op(q, k, v, tq, tk, tv, None)
    assert torch.allclose(image3, joint[:, :, 4:], atol=1e-6)
    assert torch.allclose(text3, joint[:, :, :4], atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("max_len", [512, 20])
def test_text_encoding_matches_pipeline(pipe, max_len):
    """Two prompts of different lengths (padded to the longer, masked), and one alone (no mask); with
    max_len 20 both are cut."""
    for prompts in (["a red fox jumping over the lazy dog at dawn", "a cat"], "a lone lighthouse"):
        embeddings, mask = encode_prompt(prompts, pipe.tokenizer, pipe.text_encoder, max_len)
        ref, ref_mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=max_len)
        assert embeddings.shape == ref.shape and torch.equal(embeddings, ref)
        if ref_mask is None:
            assert mask is None
        else:
            assert torch.equal(mask, ref_mask.bool()) and not mask.all()
        assert embeddings.shape[1] == 20 if max_len == 20 else embeddings.shape[1] > 20  # cut / not cut


@pytest.mark.parametrize("config", [{}, QWEN_SCHEDULER, dict(shift=3.0)], ids=["default", "qwen", "static"])
@pytest.mark.parametrize("steps,tokens", [(3, 15), (50, 4096), (28, 16384)])
def test_schedule_matches_scheduler(config, steps, tokens):
    """The sigmas (and so the timesteps 1000 sigma) diffusers' scheduler sets for the pipeline's sigmas
    and mu, and one Euler step equal to scheduler.step."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as diffusers_shift

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
    mu = diffusers_shift(tokens, *(scheduler.config[k] for k in keys))
    assert calculate_shift(tokens, *(scheduler.config[k] for k in keys)) == mu
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = sigmas(steps, tokens, dict(scheduler.config))
    assert ours.dtype == torch.float32 and torch.equal(ours, scheduler.sigmas)
    assert torch.equal(ours[:-1] * 1000, scheduler.timesteps)
    x, v = torch.randn(1, 4, 1, 4, 6), torch.randn(1, 4, 1, 4, 6)
    stepped = scheduler.step(v, scheduler.timesteps[0], x, return_dict=False)[0]
    assert torch.equal(x + (ours[1] - ours[0]) * v, stepped)


def test_latent_normalisation_round_trip():
    vae_config = dict(z_dim=4, latents_mean=VAE_CONFIG["latents_mean"], latents_std=VAE_CONFIG["latents_std"])
    z = torch.randn(2, 4, 1, 6, 8)
    x = normalize_latents(z, vae_config)
    expected = (z - torch.tensor([0.1, -0.2, 0.3, 0.05]).view(1, 4, 1, 1, 1)) / torch.tensor(
        [0.5, 1.5, 2.0, 0.8]
    ).view(1, 4, 1, 1, 1)
    assert torch.allclose(x, expected, atol=1e-6)
    assert torch.allclose(denormalize_latents(x, vae_config), z, atol=1e-6)


@torch.no_grad()
def test_pipeline_end_to_end(pipe, model):
    """QwenImagePipeline (two prompts and negative prompts of different lengths, seed, 40 x 24 pixels, 3
    steps, true CFG 4) against a loop of the family's pieces: the same image."""
    prompts = ["a red fox jumping over the lazy dog at dawn", "a cat"]
    negatives = ["blurry", "low quality, deformed hands, text"]
    height, width, steps, scale, seed = 40, 24, 3, 4.0, 0
    reference = pipe(
        prompt=prompts,
        negative_prompt=negatives,
        true_cfg_scale=scale,
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images

    # test-only scaffolding: tessera's sampler runs the real loop
    text, text_mask = encode_prompt(prompts, pipe.tokenizer, pipe.text_encoder)
    negative, negative_mask = encode_prompt(negatives, pipe.tokenizer, pipe.text_encoder)
    assert text_mask is not None and negative_mask is not None  # both batches are padded
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor  # the latent: 10 x 6
    x = initial_noise((2, 4, 1, h, w), torch.Generator().manual_seed(seed))
    levels = sigmas(steps, image_tokens(h, w), dict(pipe.scheduler.config))
    for i in range(steps):
        t = levels[i].expand(2)
        v = model(x, t, QwenImageCond(text, text_mask))
        v = true_cfg(v, model(x, t, QwenImageCond(negative, negative_mask)), scale)
        x = x + (levels[i + 1] - levels[i]) * v  # the scheduler's Euler step
    image = pipe.vae.decode(denormalize_latents(x, pipe.vae.config), return_dict=False)[0][:, :, 0]
    image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()

    diff = float(np.abs(image - reference).max())
    print(f"end to end: max abs difference from QwenImagePipeline: {diff:.3g}")
    assert image.shape == reference.shape == (2, height, width, 3) and reference.std() > 0.01
    assert diff <= 1e-5


def test_weight_names_round_trip(pipe, model):
    """diffusers <-> tessera (identity but for blocks.), and the single-file layout <-> diffusers, on the
    tiny model's keys; scaled-fp8 files are refused with a message."""
    theirs = pipe.transformer.state_dict()
    ours = tessera_state_dict_from_diffusers(theirs)
    assert set(ours) == set(model.state_dict()) and "blocks.1.attn.to_out.0.weight" in ours
    assert diffusers_state_dict_from_tessera(ours).keys() == theirs.keys()
    for prefix in ("", "model.diffusion_model."):
        original = original_state_dict_from_diffusers(theirs, prefix)
        assert all(k.startswith(prefix) for k in original) and len(original) == len(theirs)
        back = diffusers_state_dict_from_original(original)
        assert back.keys() == theirs.keys() and all(back[k] is theirs[k] for k in theirs)
    with pytest.raises(QwenImageFormatError, match="scaled-fp8"):
        diffusers_state_dict_from_original({**theirs, "img_in.scale_weight": torch.ones(())})


def test_config_and_folder_detection(pipe, tmp_path):
    """The module from any config's depth and width, the config back, and a folder recognised by its
    model_index.json or its transformer config.json."""
    config = dict(pipe.transformer.config)
    kwargs = transformer_kwargs_from_diffusers_config(config)
    assert kwargs["in_channels"] == 4 and kwargs["hidden_size"] == 48 and kwargs["depth"] == 2
    back = diffusers_config_from_kwargs(kwargs)
    assert build_transformer(config).architecture() == kwargs
    assert {k: back[k] for k in TINY_TRANSFORMER} == {**TINY_TRANSFORMER, "axes_dims_rope": [4, 6, 6]}
    deeper = build_transformer({**config, "num_layers": 3, "num_attention_heads": 2})
    assert len(deeper.blocks) == 3 and deeper.img_in.out_features == 32
    with pytest.raises(QwenImageFormatError, match="guidance_embeds"):
        build_transformer({**config, "guidance_embeds": True})
    assert build_transformer({**config, "zero_cond_t": True}).zero_cond_t  # Edit-2511's

    pipeline, transformer, other = tmp_path / "pipeline", tmp_path / "transformer", tmp_path / "wan"
    for folder in (pipeline / "transformer", transformer, other):
        folder.mkdir(parents=True)
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    (pipeline / "transformer" / "config.json").write_text(json.dumps(config))
    pipe.transformer.save_pretrained(transformer)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    family = family_named("qwen_image")
    assert family.recognises(pipeline) and family.recognises(transformer) and not family.recognises(other)
    none = SimpleNamespace(pretrained=None)
    cfg = SimpleNamespace(
        model=SimpleNamespace(pretrained=str(pipeline), attention_backend="sdpa"), vae=none, text_encoder=none
    )
    assert len(family.meta_transformer(cfg).blocks) == 2  # built from the pipeline's transformer/config.json
