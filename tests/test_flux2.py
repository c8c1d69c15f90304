"""models/flux2 against diffusers, code no one here wrote: a tiny random Flux2Transformer2DModel (klein:
no guidance embedding) with diffusers' weights gives diffusers' output (float32 and bf16, a non-square
grid, the 4-axis RoPE); the names map both ways."""

import contextlib
import io

import pytest
import torch

from models.flux2.transformer import Flux2Cond
from models.flux2.weights import build_transformer, to_diffusers, to_tessera

TEXT_DIM = 24  # 3 layers x the tiny Qwen3's 8
TINY_TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=TEXT_DIM, timestep_guidance_channels=256, mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=False,
)  # fmt: skip


def tiny_transformer(guidance: bool = False):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    theirs = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, "guidance_embeds": guidance}).eval()
    with torch.no_grad():  # zero-initialised by no one here, but small: give the modulations some weight
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = build_transformer(dict(theirs.config)).eval()
    ours.load_state_dict(to_tessera(theirs.state_dict(), 2), strict=True)
    return theirs, ours


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("guidance", [None, 3.5], ids=["klein", "dev"])
def test_transformer_matches_diffusers(dtype, guidance):
    """A 5 x 7 token grid, 9 text tokens, two samples at different sigmas: tessera's velocity is
    diffusers' output as Flux2KleinPipeline calls the model, and (dev) as Flux2Pipeline calls its
    guidance-embedding model with a scale, which moves the output."""
    theirs, ours = (m.to(dtype) for m in tiny_transformer(guidance is not None))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 1, 5, 7, generator=g).to(dtype)
    text = torch.randn(2, 9, TEXT_DIM, generator=g).to(dtype)
    sigma = torch.tensor([0.7, 0.3])
    h, w = 5, 7
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))[None]
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(9))[None]
    out = theirs(
        hidden_states=x.reshape(2, 16, h * w).transpose(1, 2),
        encoder_hidden_states=text,
        timestep=(sigma * 1000).to(dtype) / 1000,
        img_ids=img_ids.expand(2, -1, -1),
        txt_ids=txt_ids.expand(2, -1, -1),
        guidance=None if guidance is None else torch.full([2], guidance),
        return_dict=False,
    )[0]
    want = out.transpose(1, 2).reshape(2, 16, 1, h, w)
    scale = None if guidance is None else torch.full([2], guidance)
    got = ours(x, sigma, Flux2Cond(text, guidance=scale))
    if guidance is not None:  # the scale is an input that matters
        assert float((ours(x, sigma, Flux2Cond(text, guidance=scale * 2)) - got).abs().max()) > 1e-3
    diff = float((got.float() - want.float()).abs().max())
    print(f"{dtype}: max abs {diff:.2e}")
    assert got.shape == want.shape and float(want.float().std()) > 0.01
    assert diff <= (1e-5 if dtype == torch.float32 else 1e-2 * float(want.float().abs().max()))


def test_names_round_trip():
    theirs, ours = tiny_transformer()
    state = theirs.state_dict()
    assert to_diffusers(to_tessera(state, 2), 2).keys() == state.keys()
    assert to_tessera(state, 2).keys() == ours.state_dict().keys()


def test_bfl_names_as_diffusers_converts_them():
    """A single file in BFL's names (fused q/k/v, norms' `scale`, the final modulation as (shift, scale)):
    diffusers' own converter reads it back to the model's state dict, and so does tessera's renaming, with
    ComfyUI's `model.diffusion_model.` prefix too; the file's config comes from a folder beside it."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from models.flux2.weights import diffusers_from_original, original_from_diffusers

    state = tiny_transformer()[0].state_dict()
    bfl = original_from_diffusers(state)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.linear1.weight" in bfl
    assert "final_layer.adaLN_modulation.1.weight" in bfl and not any("transformer_" in k for k in bfl)
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    for names in (bfl, {f"model.diffusion_model.{k}": v for k, v in bfl.items()}):
        ours = diffusers_from_original(names)
        assert ours.keys() == theirs.keys() == state.keys()
        assert all(torch.equal(ours[k], state[k]) and torch.equal(theirs[k], state[k]) for k in state)


FLUX2_VAE = dict(  # 4x spatial compression (the release's 8x), then 2 x 2 packing: 16 channels
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 16, 16],
    down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1,
    norm_num_groups=4,
)  # fmt: skip
SCHEDULER = dict(use_dynamic_shifting=True, time_shift_type="exponential")


def tiny_text_encoder(vocab_size: int):
    """A tiny Qwen3 causal LM with the 28 layers the pipeline reads three of (9, 18, 27), 8 wide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=8, intermediate_size=16, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=vocab_size, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def tiny_vae_and_scheduler() -> tuple:
    """The tiny AutoencoderKLFlux2, seeded, its batch-norm statistics not the identity; the scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(**FLUX2_VAE).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(16) * 0.3)
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    return vae, FlowMatchEulerDiscreteScheduler(**SCHEDULER)


def tiny_flux2_pipeline(is_distilled: bool = False):
    """The tiny diffusers Flux2KleinPipeline, float32, seeded; its VAE's batch-norm statistics not the
    identity."""
    from diffusers import Flux2KleinPipeline

    from tests.test_z_image import z_tokenizer

    tokenizer = z_tokenizer()
    encoder = tiny_text_encoder(len(tokenizer))
    transformer = tiny_transformer()[0]
    vae, scheduler = tiny_vae_and_scheduler()
    pipe = Flux2KleinPipeline(scheduler, vae, encoder, tokenizer, transformer, is_distilled=is_distilled)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Mistral's chat template in miniature: the turns' text parts with their roles (the processor's format)
DEV_CHAT = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
    "[{{ m['role'] }}]{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
)
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def dev_processor():
    """The tiny byte-level tokenizer as Mistral 3's processor is called (chat turns of typed parts,
    padding on the left, as Mistral's). transformers' PixtralProcessor itself needs torchvision, which is
    not installed here; for text alone it renders the same template and tokenizes with its tokenizer, and
    tessera and the pipeline call the folder's one object alike (AutoProcessor)."""
    from tokenizers import AddedToken

    from tests.test_z_image import z_tokenizer

    tokenizer = z_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True) for t in PIXTRAL_TOKENS], special_tokens=True)
    tokenizer.padding_side, tokenizer.chat_template = "left", DEV_CHAT
    tokenizer.init_kwargs["padding_side"] = "left"  # saved with the folder, as Mistral's
    return tokenizer


def dev_text_encoder(tokenizer):
    """A tiny Mistral 3 with the 30 layers the pipeline reads three of (10, 20, 30), 8 wide."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", hidden_size=8, intermediate_size=16, num_hidden_layers=30,
                num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=len(tokenizer),
                max_position_embeddings=1024)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=4, image_size=16, patch_size=4)  # fmt: skip
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Mistral3ForConditionalGeneration(config).eval()


def tiny_flux2_dev_pipeline():
    """The tiny diffusers Flux2Pipeline (FLUX.2 dev: the guidance embedded, Mistral 3), float32, seeded."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel

    processor = dev_processor()
    encoder = dev_text_encoder(processor)
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, "guidance_embeds": True}).eval()
    with torch.no_grad():  # as tiny_transformer: the modulations some weight
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vae, scheduler = tiny_vae_and_scheduler()
    pipe = Flux2Pipeline(scheduler, vae, encoder, processor, transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("steps", [1, 4, 28])
@pytest.mark.parametrize("tokens", [15, 4096, 5000])
def test_schedule_matches_the_scheduler(steps, tokens):
    """The levels Flux2KleinPipeline sets: its linspace at the empirical mu (both of its branches)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from models.flux2.family import Flux2, empirical_mu

    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    mu = compute_empirical_mu(tokens, steps)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    class Parts:
        scheduler_config = dict(scheduler.config)

    latents = torch.zeros(1, 16, 1, 1, tokens)
    assert empirical_mu(tokens, steps) == mu
    assert torch.equal(Flux2().steps.schedule(Parts, steps, latents).sigmas, scheduler.sigmas)


@torch.no_grad()
def test_a_distilled_folder_samples_without_guidance(tmp_path, capsys):
    """A step-distilled folder (is_distilled): guidance 4 refused by name before anything loads; guidance 1
    gives the pipeline's image (which ignores any scale)."""
    import numpy as np

    import infer
    from tests.conftest import ROOT, run_main

    with torch.random.fork_rng():
        pipe = tiny_flux2_pipeline(is_distilled=True)
    pipe.save_pretrained(tmp_path / "pipeline")
    parts = [f"{key}.pretrained={tmp_path / 'pipeline'}" for key in ("model", "vae", "text_encoder")]
    recipe = str(ROOT / "configs" / "flux2-klein.yaml")
    argv = ["--config", recipe, "model.size=auto", *parts, "--frames", "1", "--height", "40", "--width", "24",
            "--prompt", "a red square", "--steps", "2", "--seed", "3"]  # fmt: skip
    argv += ["--output", str(tmp_path / "out.npy")]
    assert run_main(infer, [*argv, "--guidance", "4"]) != 0
    err = capsys.readouterr().err
    assert "step-distilled" in err and err.count("error:") == 1 and not (tmp_path / "out.npy").exists()
    assert run_main(infer, [*argv, "--guidance", "1"]) == 0
    want = pipe(
        prompt="a red square", height=40, width=24, num_inference_steps=2, guidance_scale=4.0,
        generator=torch.Generator().manual_seed(3), output_type="np",
    ).images[0]  # fmt: skip
    assert float(np.abs(np.load(tmp_path / "out.npy")[0] - want).max()) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize(
    "model, references", [("klein", 1), ("dev", 1), pytest.param("klein", 2, marks=pytest.mark.slow)]
)
def test_reference_images_match_the_pipeline(tmp_path, monkeypatch, model, references):
    """infer.py --image: the references' latents after the noisy tokens, each at its own size and time
    offset (10, 20): Flux2KleinPipeline's (dev: Flux2Pipeline's) image for image=[...], the output at the
    first one's size (one reference) or a given size (two: under cfg 2 x ulysses 2 on 4 processes, their
    tokens split too). dev's text encoder is gone before its transformer loads (Loading.texts_first)."""
    import numpy as np
    from PIL import Image

    import infer
    from models.image_condition import load_image
    from tests.conftest import ROOT, ranks, run_main

    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(((72, 88), (100, 64))[:references]):
        paths.append(tmp_path / f"ref{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    with torch.random.fork_rng():
        pipe = tiny_flux2_pipeline() if model == "klein" else tiny_flux2_dev_pipeline()
    pipe.save_pretrained(tmp_path / "pipeline")
    parts = [f"{key}.pretrained={tmp_path / 'pipeline'}" for key in ("model", "vae", "text_encoder")]
    recipe, out = str(ROOT / "configs" / f"flux2-{model}.yaml"), tmp_path / "out.npy"
    argv = ["--config", recipe, "model.size=auto", *parts, "--frames", "1", "--prompt", "make it blue",
            "--steps", "2", "--guidance", "4", "--seed", "3", "--output", str(out)]  # fmt: skip
    argv += ["--image", *map(str, paths)]
    size, order = {}, []
    if model == "dev":  # the order of its parts' lifecycle
        from models.family import Family
        from models.flux2.family import Flux2Dev

        def encode_first(self, parts, *rest):
            order.append("texts")
            first(self, parts, *rest)
            order.append("freed" if parts.text_encoder is None else "kept")

        def load_transformer(self, *rest):
            order.append("transformer")
            return load(self, *rest)

        first, load = Flux2Dev.encode_first, Family.load_transformer
        monkeypatch.setattr(Flux2Dev, "encode_first", encode_first)
        monkeypatch.setattr(Family, "load_transformer", load_transformer)
    if references == 1:
        assert run_main(infer, argv) == 0
        assert order == (["texts", "freed", "transformer"] if model == "dev" else []), order
    else:
        size = dict(height=40, width=24)
        argv += ["--height", "40", "--width", "24", "parallel.cfg=2", "parallel.ulysses=2"]
        done = ranks(4, "infer.py", *argv, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    want = pipe(
        image=[load_image(p) for p in paths], prompt="make it blue", num_inference_steps=2,
        guidance_scale=4.0, generator=torch.Generator().manual_seed(3), output_type="np", **size,
    ).images[0]  # fmt: skip
    got = np.load(out)[0]
    diff = float(np.abs(got - want).max())
    print(f"{model}, {references} reference(s): infer.py vs {type(pipe).__name__} {diff:.2e}, {got.shape}")
    assert got.shape == want.shape and diff <= 1e-5 and want.std() > 0.01


# of 8 unguided steps, some middle ones reuse (klein's pipeline runs each branch in a cache context of
# its own, tessera decides once for both: compared unguided, as in tests/test_families.py)
REFERENCE_THRESHOLD = 1.2


@torch.no_grad()
@pytest.mark.parametrize("case", ["first_block", pytest.param("pipefusion", marks=pytest.mark.slow)])
def test_reference_images_through_the_patch_pieces(tmp_path, case):
    """klein with a reference image, its tokens beside the noisy ones through the patch pieces: under
    sample.cache=first_block (8 steps, unguided), the steps that run every block and the image of
    diffusers' rule by hand on the pipeline (tests/test_families.py first_block_by_hand, which reads the
    image stream, the reference's tokens included); under PipeFusion 2 x ulysses 2 (4 processes, warm-up
    over every step, guidance 4), Flux2KleinPipeline's image (its stale patches: test_families.py and
    test_qwen_image_edit.py)."""
    import numpy as np
    from PIL import Image

    import infer
    from models.image_condition import load_image
    from tests.conftest import ROOT, ranks, run_main
    from tests.test_families import first_block_by_hand

    path = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (72, 88, 3), dtype=np.uint8)).save(path)
    with torch.random.fork_rng():
        pipe = tiny_flux2_pipeline()
    pipe.save_pretrained(tmp_path / "pipeline")
    parts = [f"{key}.pretrained={tmp_path / 'pipeline'}" for key in ("model", "vae", "text_encoder")]
    recipe, out = str(ROOT / "configs" / "flux2-klein.yaml"), tmp_path / "out.npy"
    argv = ["--config", recipe, "model.size=auto", *parts, "--frames", "1", "--prompt", "make it blue",
            "--seed", "3", "--height", "40", "--width", "24", "--output", str(out),
            "--image", str(path)]  # fmt: skip
    steps, guidance = (8, 1.0) if case == "first_block" else (3, 4.0)
    argv += ["--steps", str(steps), "--guidance", str(guidance)]
    calls = []  # the second block's attention runs only when every block runs
    if case == "first_block":
        argv += ["sample.cache=first_block", f"sample.cache_first_block_threshold={REFERENCE_THRESHOLD}",
                 "sample.cache_max_skips=8"]  # fmt: skip
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            assert run_main(infer, argv) == 0
        full = float(said.getvalue().split("[tessera] step cache: ")[1].split(" of 8")[0])
        first_block_by_hand(pipe.transformer, REFERENCE_THRESHOLD, steps=8)
        pipe.transformer.transformer_blocks[1].attn.register_forward_hook(lambda *a: calls.append(1))
    else:
        argv += ["parallel.pipefusion=2", "parallel.ulysses=2", "parallel.pipefusion_warmup=3"]
        done = ranks(4, "infer.py", *argv, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "PipeFusion: 2 patches, 3 warm-up step(s)" in done.stdout, done.stdout
    want = pipe(
        image=[load_image(path)], prompt="make it blue", num_inference_steps=steps, guidance_scale=guidance,
        height=40, width=24, generator=torch.Generator().manual_seed(3), output_type="np",
    ).images[0]  # fmt: skip
    diff = float(np.abs(np.load(out)[0] - want).max())
    if case == "first_block":
        print(f"first_block with a reference: {full:g} of 8 steps ran every block (the rule: {len(calls)})")
        assert 1 < full < 8 and full == len(calls)
    print(f"{case} with a reference: infer.py vs {type(pipe).__name__} {diff:.2e}")
    assert diff <= 1e-5 and want.std() > 0.01


def test_reference_refusals(tmp_path, capsys):
    """A reference under 64 pixels a side, or with --last-image: one error line each, before any model."""
    import numpy as np
    from PIL import Image

    import infer
    from tests.conftest import ROOT, run_main

    small = tmp_path / "small.png"
    Image.fromarray(np.zeros((32, 80, 3), dtype=np.uint8)).save(small)
    with torch.random.fork_rng():
        tiny_flux2_pipeline().save_pretrained(tmp_path / "pipeline")
    parts = [f"{key}.pretrained={tmp_path / 'pipeline'}" for key in ("model", "vae", "text_encoder")]
    recipe = str(ROOT / "configs" / "flux2-klein.yaml")
    argv = ["--config", recipe, "model.size=auto", *parts, "--frames", "1"]
    for extra, expected in (
        (["--image", str(small)], "at least 64 pixels a side"),
        (["--image", str(small), "--last-image", str(small)], "from --image alone"),
    ):
        assert run_main(infer, [*argv, *extra]) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err


@torch.no_grad()
def test_a_folder_of_shards(tmp_path):
    """The transformer's weights in several files (the double blocks' count is the whole model's, not a
    file's): the one file's image; and a stored text of another length than the recipe's refused."""
    import numpy as np

    import infer
    from models.flux2.family import Flux2
    from tests.conftest import ROOT, run_main

    with torch.random.fork_rng():
        pipe = tiny_flux2_pipeline()
    pipe.save_pretrained(tmp_path / "pipeline")
    pipe.transformer.save_pretrained(tmp_path / "sharded" / "transformer", max_shard_size="60KB")
    assert len(list((tmp_path / "sharded" / "transformer").glob("*.safetensors"))) > 3
    for part in ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"):
        (tmp_path / "sharded" / part).symlink_to(tmp_path / "pipeline" / part)
    recipe = str(ROOT / "configs" / "flux2-klein.yaml")

    def sample(folder, *extra):
        parts = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
        out = tmp_path / f"{len(list(tmp_path.glob('*.npy')))}.npy"
        argv = ["--config", recipe, "model.size=auto", *parts, "--frames", "1", "--height", "40",
                "--width", "24", "--prompt", "a red square", "--steps", "2", "--seed", "3"]  # fmt: skip
        argv += ["--output", str(out), *extra]
        return run_main(infer, argv), out

    (code, whole), (sharded_code, sharded) = sample(tmp_path / "pipeline"), sample(tmp_path / "sharded")
    # the same weights at other byte offsets: float32 rounding, not 0.0 (test_families' single file's)
    assert code == sharded_code == 0 and np.abs(np.load(whole) - np.load(sharded)).max() <= 1e-5
    with pytest.raises(ValueError, match="precompute the latents again"):
        Flux2().load_conditioning([{"text": torch.zeros(16, TEXT_DIM)}], 512)


def test_a_distilled_single_file_is_still_distilled(tmp_path):
    """A transformer file beside a step-distilled folder: is_distilled is the folder's, so a guidance scale
    is refused as for the folder itself."""
    from safetensors.torch import save_file

    from configs import load_config
    from models.flux2.family import Flux2

    with torch.random.fork_rng():
        pipe = tiny_flux2_pipeline(is_distilled=True)
    pipe.save_pretrained(tmp_path / "pipeline")
    single = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, single)
    folder = tmp_path / "pipeline"
    cfg = load_config(None, ["model.family=flux2", "model.size=auto", f"model.pretrained={single}",
                             f"vae.pretrained={folder}", f"text_encoder.pretrained={folder}"])  # fmt: skip
    with pytest.raises(ValueError, match="step-distilled"):
        Flux2().check_guidance(cfg, 4.0)
    Flux2().check_guidance(cfg, 1.0)


@pytest.mark.parametrize("targets", ["family", "q and v"])
def test_bfl_named_adapters_start_a_run_at_their_rank(targets):
    """lora.init_from with a LoRA in BFL's names (ComfyUI's export: each fused q/k/v one block-diagonal
    adapter of three times the rank; of two, where the run adapted q and v alone) starts a run of the rank
    that wrote it exactly: each projection's own block of the fused adapter, the same weight updates."""
    from models.families import family_named
    from models.lora import add_adapters
    from models.lora_formats import export_adapters, match_lora
    from tests.test_lora import adapters_of, assert_starts_alike, randomize_adapters

    family, config = family_named("flux2"), dict(tiny_transformer()[0].config)
    patterns = family.lora_targets if targets == "family" else ["blocks.*.attn.to_q", "blocks.*.attn.to_v"]
    source, run = build_transformer(config), build_transformer(config)
    add_adapters(source, rank=2, alpha=3.0, patterns=patterns)
    add_adapters(run, rank=2, alpha=8.0, patterns=patterns)
    randomize_adapters(source)
    projections, linears = family.projections(build_transformer(config))
    tensors = export_adapters(adapters_of(source), projections, "comfyui", alphas=False, release=True)
    fused = 6 if targets == "family" else 4
    assert tensors["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape[0] == fused
    assert_starts_alike(run, source, match_lora(tensors, projections, linears))


def test_shared_a_release_files_read_as_diffusers_converts_them():
    """musubi-tuner's and ai-toolkit's fused q/k/v as they write it: one A for the three (not block-diagonal),
    B on the weight's rows. Each projection's update is the one diffusers' converters make of the same file
    (kohya's keys with an alpha; ai-toolkit's without); a fused B of another height, and two keys naming
    one layer, are refused by name."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_kohya_flux2_lora_to_diffusers,
        _convert_non_diffusers_flux2_lora_to_diffusers,
    )

    from models.families import family_named
    from models.lora_formats import LoRAFormatError, match_lora

    family = family_named("flux2")
    projections, linears = family.projections(build_transformer(dict(tiny_transformer()[0].config)))
    module = {p.module: p.diffusers for found in projections.values() for p in found}
    g = torch.Generator().manual_seed(0)
    A, B, A2, B2 = (torch.randn(*shape, generator=g) for shape in ((4, 32), (96, 4), (4, 32), (32, 4)))
    kohya = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": A,
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": B,
             "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(8.0),
             "lora_unet_double_blocks_1_img_attn_proj.lora_down.weight": A2,
             "lora_unet_double_blocks_1_img_attn_proj.lora_up.weight": B2}  # fmt: skip
    toolkit = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": A,
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": B,
               "diffusion_model.double_blocks.1.img_attn.proj.lora_A.weight": A2,
               "diffusion_model.double_blocks.1.img_attn.proj.lora_B.weight": B2}  # fmt: skip
    for tensors, convert in ((kohya, _convert_kohya_flux2_lora_to_diffusers),
                             (toolkit, _convert_non_diffusers_flux2_lora_to_diffusers)):  # fmt: skip
        theirs = convert(dict(tensors))
        want = {
            key.removeprefix("transformer.").removesuffix(".lora_A.weight"): theirs[
                key.replace("lora_A", "lora_B")
            ] @ a
            for key, a in theirs.items()
            if key.endswith(".lora_A.weight")
        }
        ours = {module[m]: d for m, found in match_lora(tensors, projections, linears).deltas().items()
                for _, d in found}  # fmt: skip
        assert ours.keys() == want.keys() and len(want) == 4, (ours.keys(), want.keys())
        assert all(torch.allclose(ours[k], want[k], atol=1e-5) for k in want)
    with pytest.raises(LoRAFormatError, match="has 96 rows"):
        short = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": B[:32]}
        match_lora({**toolkit, **short}, projections, linears)
    twice = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": A,
             "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": B[:32]}  # fmt: skip
    with pytest.raises(LoRAFormatError, match="adapt the same layer blocks.0.attn.to_q"):
        match_lora({**toolkit, **twice}, projections, linears)


def test_a_transformer_of_the_other_flux2_is_refused(tmp_path, capsys):
    """klein's recipe with dev's transformer (a single file beside dev's folder), and the reverse: each
    would sample without error and wrongly (the guidance embedding unused, or missing); one error line
    naming the family the transformer is, before any model loads."""
    from safetensors.torch import save_file

    import infer
    from tests.conftest import ROOT, run_main

    cases = (("klein", "dev", tiny_flux2_dev_pipeline), ("dev", "klein", tiny_flux2_pipeline))
    for model, other, build in cases:
        folder = tmp_path / other
        with torch.random.fork_rng():
            pipe = build()
        pipe.save_pretrained(folder)
        save_file(pipe.transformer.state_dict(), folder / "transformer.safetensors")
        parts = [f"model.pretrained={folder / 'transformer.safetensors'}", f"vae.pretrained={folder}",
                 f"text_encoder.pretrained={folder}"]  # fmt: skip
        argv = ["--config", str(ROOT / "configs" / f"flux2-{model}.yaml"), "model.size=auto", *parts,
                "--frames", "1", "--height", "40", "--width", "24", "--prompt", "a red square",
                "--steps", "2", "--output", str(tmp_path / "out.npy")]  # fmt: skip
        assert run_main(infer, argv) != 0
        err = capsys.readouterr().err
        embeds = "True" if other == "dev" else "False"
        assert f"guidance_embeds={embeds}" in err and err.count("error:") == 1, err
        assert f"configs/flux2-{other}.yaml" in err and not (tmp_path / "out.npy").exists()
