"""The Sana family (models/sana/) against diffusers, code no one here wrote: the transformer at a non-square
size with a padded text mask, the weight names both ways (diffusers' own single-file converter reads the
original names), the prompt encoding against SanaPipeline.encode_prompt, the schedule and solver step by
step against DPMSolverMultistepScheduler, and a sampling loop written here from the family's pieces against
the whole tiny SanaPipeline. Every model is tiny, random and float32; the tokenizer is built here."""

import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.families import family_named
from models.sana import (
    COMPLEX_HUMAN_INSTRUCTION,
    ORIGINAL_ONLY,
    RELEASE_SCHEDULER,
    SanaConditioning,
    SanaFormatError,
    build_sana,
    classifier_free_guidance,
    denormalize_latents,
    diffusers_from_original,
    diffusers_from_tessera,
    dpm_solver_step,
    encode_text,
    flow_schedule,
    latent_shape,
    original_from_diffusers,
    tessera_from_diffusers,
)

TINY = dict(  # the release's options (no positions, no q/k norms, patch 1) at toy sizes
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=12,
    sample_size=8,
    patch_size=1,
)
# the other options: Sana 1.5's q/k norms, the 2K/4K releases' sin-cos positions, patch 2, biases
TINY_VARIANT = dict(
    TINY, patch_size=2, interpolation_scale=1.0, qk_norm="rms_norm_across_heads", attention_bias=True
)
RELEASE_1600M = {  # Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json
    "_class_name": "SanaTransformer2DModel",
    "_diffusers_version": "0.32.0.dev0",
    "attention_bias": False,
    "attention_head_dim": 32,
    "caption_channels": 2304,
    "cross_attention_dim": 2240,
    "cross_attention_head_dim": 112,
    "dropout": 0.0,
    "in_channels": 32,
    "mlp_ratio": 2.5,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 70,
    "num_cross_attention_heads": 20,
    "num_layers": 20,
    "out_channels": 32,
    "patch_size": 1,
    "sample_size": 32,
}
PROMPTS = ["  A Small RED Cat, sleeping on a sunny windowsill, surrounded by flowers  ", "a dog"]
NEGATIVE = "Blurry, low quality"
MAX_LENGTH = 12  # the release's is 300; short here so that the first prompt is cut and the second padded


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small gain nothing from a second thread, which only adds waiting (on a busy 2-core
    machine the sampling test ran 5x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_diffusers_transformer(config, seed=0):
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(seed)
    model = SanaTransformer2DModel(**config)
    with torch.no_grad():  # every weight perturbed, so that no default value hides a wrong path
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tessera_copy(reference):
    model = build_sana(dict(reference.config)).eval()
    model.load_state_dict(tessera_from_diffusers(reference.state_dict()), strict=True)
    return model


@pytest.mark.parametrize("config", [TINY, TINY_VARIANT], ids=["release", "variant"])
def test_transformer_matches_diffusers(config):
    reference = tiny_diffusers_transformer(config)
    model = tessera_copy(reference)
    p, gen = config["patch_size"], torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6 * p, 10 * p, generator=gen)  # a 6 x 10 token grid
    text = torch.randn(2, 7, 12, generator=gen)
    mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])  # the second sample's text is padded
    t = torch.tensor([0.999, 0.2537], dtype=torch.float64)
    with torch.no_grad():
        want = reference(x, text, timestep=(t * 1000).float(), encoder_attention_mask=mask).sample
        got = model(x.unsqueeze(2), t, SanaConditioning(text, mask))
        padded, real = text.clone(), text.clone()
        padded[1, 3:], real[1, 2] = 100.0, 100.0
        padded = model(x.unsqueeze(2), t, SanaConditioning(padded, mask))
        real = model(x.unsqueeze(2), t, SanaConditioning(real, mask))
    diff = (got[:, :, 0] - want).abs().max().item()
    print(f"sana transformer ({'variant' if config is TINY_VARIANT else 'release'}) max abs diff {diff:.2e}")
    assert got.shape == (2, 4, 1, 6 * p, 10 * p)
    assert diff <= 1e-5
    assert torch.allclose(padded, got, atol=1e-6) and not torch.allclose(real[1], got[1])  # the mask works


def test_operators_split_as_parallel_needs():
    """The contracts parallel/ builds on: the linear attention's sums add over token shards (a padded token
    with k = 0 adds nothing), and the grid convolution of whole rows plus one halo row is exact."""
    block = build_sana(TINY).blocks[0]
    kinds = block.attn1.inner_attention.kind, block.attn2.inner_attention.kind, block.ff.conv_depth.kind
    assert kinds == ("linear", "cross", "grid_conv")
    op, gen = block.attn1.inner_attention, torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 10, 8, generator=gen) for _ in range(3))
    q, k = q.relu(), k.relu()
    shards = op.key_value_sums(k[:, :, :6], v[:, :, :6]) + op.key_value_sums(k[:, :, 6:], v[:, :, 6:])
    assert torch.allclose(op.attend(q, shards), op(q, k, v), atol=1e-6)
    extra_k, extra_v = torch.rand(2, 2, 3, 8, generator=gen), torch.randn(2, 2, 3, 8, generator=gen)
    alone = op.key_value_sums(k, v)
    padded = op.key_value_sums(torch.cat([k, extra_k], 2), torch.cat([v, extra_v], 2))
    zeroed = op.key_value_sums(torch.cat([k, 0 * extra_k], 2), torch.cat([v, extra_v], 2))
    assert not torch.allclose(padded, alone) and torch.allclose(zeroed, alone, atol=1e-6)
    conv, (h, w) = block.ff.conv_depth, (5, 7)
    tokens = torch.randn(2, h * w, conv.in_channels, generator=gen)
    with torch.no_grad():
        whole = conv(tokens, (1, h, w))
        top = conv(tokens[:, : 3 * w], (1, 3, w))[:, : 2 * w]  # rows 0-1 and the halo row 2
        bottom = conv(tokens[:, w:], (1, h - 1, w))[:, w:]  # halo row 1, then rows 2-4
    assert torch.allclose(torch.cat([top, bottom], 1), whole, atol=1e-6)


def test_release_config_builds_like_diffusers():
    from diffusers import SanaTransformer2DModel

    with torch.device("meta"):
        ours = build_sana(RELEASE_1600M)
        theirs = SanaTransformer2DModel.from_config(RELEASE_1600M)
    assert ours.interpolation_scale is None and theirs.patch_embed.pos_embed is None  # no positions at 1024px
    shapes = {k: v.shape for k, v in tessera_from_diffusers(theirs.state_dict()).items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == shapes
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    with pytest.raises(SanaFormatError, match="Sprint"):
        build_sana(dict(RELEASE_1600M, guidance_embeds=True))


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_weight_names_round_trip():
    from diffusers.loaders.single_file_utils import convert_sana_transformer_to_diffusers

    state = tiny_diffusers_transformer(TINY).state_dict()
    original = original_from_diffusers(state)
    assert original["blocks.1.attn.qkv.weight"].shape == (48, 16)  # q, k, v fused
    assert original["blocks.1.cross_attn.kv_linear.bias"].shape == (32,)
    # an original checkpoint as shared: prefixed, with the two tensors diffusers has no place for
    checkpoint = {f"model.diffusion_model.{k}": v for k, v in original.items()}
    checkpoint["model.diffusion_model.pos_embed"] = torch.zeros(1, 64, 16)
    checkpoint["model.diffusion_model.y_embedder.y_embedding"] = torch.zeros(MAX_LENGTH, 12)
    assert_same_tensors(convert_sana_transformer_to_diffusers(dict(checkpoint)), state)  # diffusers' reading
    assert_same_tensors(diffusers_from_original({"state_dict": checkpoint}), state)
    assert set(ORIGINAL_ONLY) <= {k.removeprefix("model.diffusion_model.") for k in checkpoint}
    # Sana 1.5's q/k norms and biased q, k, v: both ways
    variant = tiny_diffusers_transformer(dict(TINY_VARIANT, interpolation_scale=None)).state_dict()
    variant_original = original_from_diffusers(variant)
    assert {"blocks.0.attn.qkv.bias", "blocks.0.cross_attn.k_norm.weight"} <= variant_original.keys()
    assert_same_tensors(diffusers_from_original(variant_original), variant)
    assert_same_tensors(original_from_diffusers(diffusers_from_original(variant_original)), variant_original)
    assert_same_tensors(diffusers_from_tessera(tessera_from_diffusers(state)), state)
    with pytest.raises(SanaFormatError, match="blocks.0.attn.extra"):
        diffusers_from_original({**original, "blocks.0.attn.extra": torch.zeros(1)})


def test_folder_detection_and_loading(tmp_path):
    reference = tiny_diffusers_transformer(TINY)
    reference.save_pretrained(tmp_path / "sana" / "transformer")
    (tmp_path / "sana" / "model_index.json").write_text(json.dumps({"_class_name": "SanaPipeline"}))
    (tmp_path / "wan").mkdir()
    (tmp_path / "wan" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    family = family_named("sana")
    assert family.recognises(tmp_path / "sana") and family.recognises(tmp_path / "sana" / "transformer")
    assert not family.recognises(tmp_path / "wan") and not family.recognises(tmp_path)
    none = SimpleNamespace(pretrained=None)
    folder = SimpleNamespace(pretrained=str(tmp_path / "sana" / "transformer"))
    cfg = SimpleNamespace(model=folder, vae=none, text_encoder=none)
    model = family.load_transformer(cfg, torch.float32)
    assert_same_tensors(diffusers_from_tessera(model.state_dict()), reference.state_dict())


def tiny_tokenizer():
    """A character-level Gemma tokenizer over the characters the tests use (<bos> added, as Gemma's)."""
    from transformers import GemmaTokenizer

    text = "\n".join(COMPLEX_HUMAN_INSTRUCTION) + "".join(PROMPTS) + NEGATIVE
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for char in sorted(set(text.lower().replace(" ", "\u2581"))):
        vocab[char] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)


@pytest.fixture(scope="module")
def tiny_pipeline():
    return tiny_sana_pipeline()


def tiny_sana_pipeline(stages: int = 2):
    """A tiny random SanaPipeline, float32: Gemma-2 encoder, diffusers' own tiny DC-AE (`stages`: its
    compression is 2 ** (stages - 1); the release's 32x has 6), the release's scheduler."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            head_dim=8,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=2,
            vocab_size=len(tokenizer),
            attn_implementation="eager",
        )
    ).eval()
    transformer = tiny_diffusers_transformer(dict(TINY, caption_channels=16, sample_size=32))
    torch.manual_seed(0)
    vae = AutoencoderDC(  # diffusers' own tiny DC-AE (its SanaPipeline tests): 2x down, 4 channels
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock",) * (stages - 1) + ("EfficientViTBlock",),
        decoder_block_types=("ResBlock",) * (stages - 1) + ("EfficientViTBlock",),
        encoder_block_out_channels=(8,) * stages,
        decoder_block_out_channels=(8,) * stages,
        encoder_qkv_multiscales=((),) * (stages - 1) + ((5,),),
        decoder_qkv_multiscales=((),) * (stages - 1) + ((5,),),
        encoder_layers_per_block=(1,) * stages,
        decoder_layers_per_block=[1] * stages,
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    ).eval()
    scheduler = DPMSolverMultistepScheduler(**RELEASE_SCHEDULER)
    pipe = SanaPipeline(tokenizer, text_encoder, vae, transformer, scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_text_encoding_matches_pipeline(tiny_pipeline):
    from diffusers import SanaPipeline

    pipe = tiny_pipeline
    assert (
        COMPLEX_HUMAN_INSTRUCTION
        == inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    )
    pipe.tokenizer.padding_side = "left"  # Gemma's default; encode_text must pad right itself
    text, mask = encode_text(pipe.tokenizer, pipe.text_encoder, PROMPTS, MAX_LENGTH)
    negative, negative_mask = encode_text(
        pipe.tokenizer, pipe.text_encoder, [NEGATIVE] * 2, MAX_LENGTH, instruction=None
    )
    with torch.no_grad():
        want = pipe.encode_prompt(
            PROMPTS,
            True,
            negative_prompt=NEGATIVE,
            device=torch.device("cpu"),
            max_sequence_length=MAX_LENGTH,
            complex_human_instruction=COMPLEX_HUMAN_INSTRUCTION,
        )
    ours = (text, mask, negative, negative_mask)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, want))
    print(f"sana text encoding max abs diff {diff:.2e}")
    assert text.shape == (2, MAX_LENGTH, 16) and mask[0].all() and not mask[1].all()
    assert diff == 0.0


@pytest.mark.parametrize("steps", [1, 2, 4, 20])
def test_schedule_and_solver_match_scheduler(steps):
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(**RELEASE_SCHEDULER)
    scheduler.set_timesteps(steps)
    schedule = flow_schedule(steps, RELEASE_SCHEDULER["flow_shift"])
    assert torch.equal(schedule.sigmas, scheduler.sigmas)
    assert torch.equal((schedule.timesteps * 1000).float(), scheduler.timesteps.float())  # exact integers
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(2, 4, 5, 7, generator=gen)
    x, previous, worst = want.unsqueeze(2), None, 0.0
    for i, t in enumerate(scheduler.timesteps):
        velocity = torch.randn(2, 4, 5, 7, generator=gen) + 0.5 * want  # the same for both solvers
        want = scheduler.step(velocity, t, want).prev_sample
        x, previous = dpm_solver_step(x, velocity.unsqueeze(2), schedule.sigmas, i, previous)
        worst = max(worst, (x[:, :, 0] - want).abs().max().item())
    print(f"sana DPM-Solver++ {steps} steps max abs diff {worst:.2e}")
    assert worst <= 1e-6


def sample_with_family_pieces(pipe, model, prompt, negative, steps, scale, height, width, seed):
    """The release's sampling loop from models/sana's pieces (test scaffolding; tessera's sampler is the
    real loop): encode, noise as the pipeline draws it, schedule, velocity, guidance, solver, decode."""
    text, mask = encode_text(pipe.tokenizer, pipe.text_encoder, [prompt], MAX_LENGTH)
    neg, neg_mask = encode_text(pipe.tokenizer, pipe.text_encoder, [negative], MAX_LENGTH, instruction=None)
    cond = SanaConditioning(torch.cat([neg, text]), torch.cat([neg_mask, mask]))  # one [uncond, cond] batch
    schedule = flow_schedule(steps, RELEASE_SCHEDULER["flow_shift"])
    vae_scale = 2 ** (len(pipe.vae.config.encoder_block_out_channels) - 1)
    shape = latent_shape(height, width, model.in_channels, vae_scale)
    x = torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed))  # (1, C, 1, h, w)
    previous = None
    with torch.no_grad():
        for i in range(steps):
            velocity = model(torch.cat([x, x]), schedule.timesteps[i].expand(2), cond).float()
            guided = classifier_free_guidance(*velocity.chunk(2), scale)
            x, previous = dpm_solver_step(x, guided, schedule.sigmas, i, previous)
        image = pipe.vae.decode(denormalize_latents(x[:, :, 0], pipe.vae.config.scaling_factor)).sample
    return (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_sampling_loop_matches_pipeline(tiny_pipeline):
    pipe = tiny_pipeline
    model = tessera_copy(pipe.transformer)
    args = dict(steps=4, scale=4.5, height=32, width=64, seed=7)
    want = pipe(
        prompt=PROMPTS[0],
        negative_prompt=NEGATIVE,
        num_inference_steps=args["steps"],
        guidance_scale=args["scale"],
        height=args["height"],
        width=args["width"],
        generator=torch.Generator().manual_seed(args["seed"]),
        max_sequence_length=MAX_LENGTH,
        use_resolution_binning=False,
        output_type="np",
    ).images
    got = sample_with_family_pieces(pipe, model, PROMPTS[0], NEGATIVE, **args)
    diff = float(np.abs(got - want).max())
    print(f"sana sampling loop vs SanaPipeline max abs diff {diff:.2e}")
    assert got.shape == want.shape == (1, 32, 64, 3)
    assert diff <= 1e-4
