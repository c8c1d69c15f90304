"""Qwen-Image-Edit-2509 / 2511 (diffusers' QwenImageEditPlusPipeline) against diffusers, code no one here
wrote: the transformer with reference images (their packed latents after the noisy tokens, each image's
RoPE frames from its index, the text after the largest half-side; 2511's references modulated at t = 0)
gives diffusers' output on the noisy tokens, in float32 and bf16."""

import json
import sys
from pathlib import Path

import pytest
import torch

from data.manifest import reference_paths
from models.qwen_image import (
    QwenImageCond,
    build_transformer,
    pack_latents,
    tessera_state_dict_from_diffusers,
)
from tests.test_qwen_image import TEXT_DIM, TINY_TRANSFORMER


@torch.no_grad()
@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["2509", "2511"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_transformer_with_references_matches_diffusers(zero_cond_t, dtype):
    """A 5 x 7 token output, references of 4 x 4 and 6 x 3 tokens (the second's half-side the largest),
    two samples at different sigmas, the second's text padded."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    theirs = QwenImageTransformer2DModel(**TINY_TRANSFORMER, zero_cond_t=zero_cond_t).eval()
    ours = build_transformer(dict(theirs.config)).eval()
    ours.load_state_dict(tessera_state_dict_from_diffusers(theirs.state_dict()))
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 1, 10, 14, generator=g).to(dtype)
    refs = [torch.randn(2, 4, 1, h, w, generator=g).to(dtype) for h, w in ((8, 8), (12, 6))]
    text = torch.randn(2, 7, TEXT_DIM, generator=g).to(dtype)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    sigma = torch.tensor([0.7, 0.3])
    grids = [(1, 5, 7), (1, 4, 4), (1, 6, 3)]
    packed = torch.cat([pack_latents(r) for r in refs], dim=1)
    out = theirs(
        hidden_states=torch.cat([pack_latents(x), packed], dim=1),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=mask.long(),
        timestep=(sigma * 1000).to(dtype) / 1000,
        img_shapes=[grids] * 2,
        return_dict=False,
    )[0][:, :35]
    cond = QwenImageCond(text, mask, packed, torch.tensor([grids[1:]] * 2))
    got = pack_latents(ours(x, sigma, cond))
    plain = pack_latents(ours(x, sigma, QwenImageCond(text, mask)))
    diff = float((got.float() - out.float()).abs().max())
    print(f"{dtype} zero_cond_t={zero_cond_t}: max abs {diff:.2e}")
    assert diff <= (1e-5 if dtype == torch.float32 else 1e-2 * float(out.float().abs().max()))
    assert float((plain.float() - out.float()).abs().max()) > 1e-3  # the references matter


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
EDIT_VAE = dict(  # 8x spatial compression: the pipeline sizes each reference to about 1024 x 1024 pixels
    base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
    latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[0.5, 1.5, 2.0, 0.8],
)  # fmt: skip


def edit_tokenizer():
    from tokenizers import AddedToken

    from tests.test_qwen_image import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True) for t in VISION_TOKENS], special_tokens=True)
    return tokenizer


def edit_text_encoder(tokenizer):
    """A tiny Qwen2.5-VL whose vision tower reads the images (its token ids the tokenizer's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(
        zip(
            ("vision_start", "image", "vision_end", "video"),
            map(tokenizer.convert_tokens_to_ids, VISION_TOKENS),
        )
    )
    rope = {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}
    text = dict(hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, rope_scaling=rope, rope_theta=1e6, vocab_size=len(tokenizer),
                bos_token_id=None, eos_token_id=2, pad_token_id=0)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(tokenizer), hidden_size=16,
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def images_only_processor(tokenizer):
    """transformers' Qwen2VLProcessor without its video processor, which needs torchvision (not installed
    here): its class check for that one argument skipped; everything the pipeline calls is transformers'."""
    from unittest import mock

    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    skip = lambda self, name, arg: None if arg is None else check(self, name, arg)  # noqa: E731
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", skip):
        return Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=None
        )


def tiny_edit_pipeline(zero_cond_t: bool = False):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )

    from tests.test_qwen_image import QWEN_SCHEDULER

    tokenizer = edit_tokenizer()
    encoder = edit_text_encoder(tokenizer)
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        **{**TINY_TRANSFORMER, "num_attention_heads": 2}, zero_cond_t=zero_cond_t
    )
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**EDIT_VAE).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**{**QWEN_SCHEDULER, "shift_terminal": 0.05})
    pipe = QwenImageEditPlusPipeline(
        scheduler, vae, encoder, tokenizer, images_only_processor(tokenizer), transformer.eval()
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save(pipe, folder):
    """The pipeline folder as save_pretrained writes it, the processor as its image processor and
    tokenizer (what a released processor/ holds besides the video processor's config)."""
    from unittest import mock

    from transformers import Qwen2VLProcessor

    def parts(processor, where, **kwargs):
        processor.image_processor.save_pretrained(where)
        processor.tokenizer.save_pretrained(where)

    with mock.patch.object(Qwen2VLProcessor, "save_pretrained", parts):
        pipe.save_pretrained(folder)


# the references' VAE size here (model.reference_area; the pipeline's VAE_IMAGE_SIZE patched to it): the
# pipeline's 1024 x 1024 gives each reference 4096 tokens, and the tests 5 times their time
AREA = 256 * 256


def test_the_reference_area_is_the_pipelines_by_default(edit, tmp_path, monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as theirs

    from models.qwen_image.edit import CONDITION_AREA, VAE_AREA

    monkeypatch.undo()  # small_references' patch: the pipeline's own constants
    assert (CONDITION_AREA, VAE_AREA) == (theirs.CONDITION_IMAGE_SIZE, theirs.VAE_IMAGE_SIZE)
    # unset, or set to the pipeline's: its area, and latents recorded as before the key existed
    from configs import load_config
    from models.families import family_named

    pipe, folder, paths = edit
    argv = [a for a in edit_args(folder, tmp_path, paths[:1]) if not a.startswith("model.reference_area")]
    family = family_named("qwen_image_edit")
    for given in ([], [f"model.reference_area={VAE_AREA}"]):
        cfg = load_config(argv[1], [*argv[2:7], *given])
        assert family.load(cfg, torch.device("cpu"), torch.float32).reference_area == VAE_AREA
        assert family.latent_record(cfg) == {}
    cfg = load_config(argv[1], [*argv[2:7], f"model.reference_area={AREA}"])
    assert family.latent_record(cfg) == {"reference_area": AREA}


@pytest.fixture(autouse=True)
def small_references(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as theirs

    monkeypatch.setattr(theirs, "VAE_IMAGE_SIZE", AREA)


@pytest.fixture(scope="module", params=[False, True], ids=["2509", "2511"])
def edit(request, tmp_path_factory):
    """(the pipeline, its folder, two reference images saved as PNG files)."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("edit")
    with torch.random.fork_rng():
        pipe = tiny_edit_pipeline(zero_cond_t=request.param)
    save(pipe, folder / "pipeline")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(((72, 88), (64, 40))):
        paths.append(folder / f"ref{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return pipe, folder / "pipeline", paths


@torch.no_grad()
def test_prompt_encoding_matches_the_pipeline(edit):
    """Two references sized for Qwen2.5-VL as the pipeline sizes them: the pipeline's encode_prompt
    (transformers' processor) and tessera's, token for token."""
    from models.image_condition import load_image
    from models.qwen_image.edit import CONDITION_AREA, pipeline_size
    from models.qwen_image.text import encode_edit_prompt

    pipe, _, paths = edit
    images = [load_image(p) for p in paths]
    small = [pipe.image_processor.resize(image, *pipeline_size(CONDITION_AREA, image)) for image in images]
    want, _ = pipe.encode_prompt("make it blue", image=small, device="cpu")
    got, mask = encode_edit_prompt(
        ["make it blue"], small, pipe.processor.image_processor, pipe.tokenizer, pipe.text_encoder
    )
    assert mask is None and torch.equal(got, want)


def edit_args(folder, tmp_path, paths, *extra):
    from tests.conftest import ROOT

    parts = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    recipe = str(ROOT / "configs" / "qwen-image-edit.yaml")
    return ["--config", recipe, "model.size=auto", *parts, f"run.output_dir={tmp_path / 'run'}",
            f"model.reference_area={AREA}",
            "--image", *map(str, paths), "--frames", "1", *extra]  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("references", [1, 2])
def test_infer_matches_the_pipeline(edit, tmp_path, references):
    """infer.py --image (one reference, then two) gives QwenImageEditPlusPipeline's image: the same
    prompt, negative prompt, true CFG 4, 2 steps, seed, at a given size (two prompts: each its own seed).
    Without a size it samples the pipeline's for the last reference (diffusers' calculate_dimensions: a
    1280 x 800 image for the second, which the sampling itself then need not spend a minute on)."""
    import numpy as np

    import infer
    from models.image_condition import load_image
    from tests.conftest import run_main

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:  # its flags: the transformer's, tested with diffusers'
        pytest.skip(
            "2511's references cover 2509's path (2509's image against its pipeline: "
            "test_first_block_cache_matches_diffusers[2509-one-process])"
        )
    paths = paths[:references]
    prompts = ["make it blue", "add a hat"]
    out = str(tmp_path / "out.npy")
    argv = edit_args(folder, tmp_path, paths, "--prompt", *prompts, "--negative-prompt", "blurry",
                     "--steps", "2", "--guidance", "4", "--seed", "5", "--output", out)  # fmt: skip
    size = dict(height=48, width=32) if references == 1 else dict(height=32, width=64)
    argv += ["--height", str(size["height"]), "--width", str(size["width"])]
    assert run_main(infer, argv) == 0
    images = [load_image(p) for p in paths]
    if references == 2:  # the size picked without one: the pipeline's, for the last reference
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        from configs import load_config
        from models.families import family_named

        cfg = load_config(argv[1], [a for a in argv[2:] if "=" in a and not a.startswith("-")])
        family = family_named("qwen_image_edit")
        picked = family.sampling_images(cfg, (paths, None), 1, (1, 0, 0), False)[2:]
        width, height = calculate_dimensions(1024 * 1024, images[-1].width / images[-1].height)
        multiple = pipe.vae_scale_factor * 2
        assert picked == (height // multiple * multiple, width // multiple * multiple) == (1280, 800)
    for i, prompt in enumerate(prompts):
        want = pipe(
            image=images, prompt=prompt, negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=2,
            generator=torch.Generator().manual_seed(5 + i), output_type="np", **size,
        ).images[0]  # fmt: skip
        got = np.load(tmp_path / f"out_{i:03d}.npy")[0]
        diff = float(np.abs(got - want).max())
        print(f"{references} reference(s), prompt {i}: infer.py vs the pipeline {diff:.2e}, {got.shape}")
        assert got.shape == want.shape and diff <= 1e-5 and want.std() > 0.01


def test_refusals(edit, tmp_path, capsys):
    """Each bad request: one error line naming it, before any model is built."""
    import infer
    from tests.conftest import run_main

    _, folder, paths = edit
    cases = [
        (edit_args(folder, tmp_path, [paths[0]] * 4), "takes 1 to 3"),
        (edit_args(folder, tmp_path, [tmp_path / "missing.png"]), "missing.png"),
        (edit_args(folder, tmp_path, paths, "--last-image", str(paths[0])), "--last-image"),
        ([a for a in edit_args(folder, tmp_path, []) if a != "--image"], "edits images: give 1 to 3"),
    ]
    for argv, expected in cases:
        assert run_main(infer, argv) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("split", ["parallel.ulysses=2", "parallel.ring=2"])
def test_split_layouts_match_the_pipeline(edit, tmp_path, split):
    """cfg 2 x ulysses 2 and cfg 2 x ring 2 (4 processes): the references' tokens are split with the
    noisy ones, each attended once; the image is the pipeline's."""
    import numpy as np

    from models.image_condition import load_image
    from tests.conftest import ranks

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("2511's launches cover 2509's split (its flags: the transformer's, tested alone)")
    out = tmp_path / "out.npy"
    argv = edit_args(folder, tmp_path, paths[:1], "--prompt", "make it blue", "--negative-prompt", "blurry",
                     "--steps", "2", "--guidance", "4", "--seed", "5", "--height", "48", "--width", "32",
                     "--output", str(out), "parallel.cfg=2", split)  # fmt: skip
    done = ranks(4, "infer.py", *argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    layout = done.stdout.split("layout ")[1].split(";")[0]  # the start-up line: the degrees it ran under
    assert "cfg=2" in layout and split.replace("parallel.", "") in layout, layout
    want = pipe(
        image=[load_image(paths[0])], prompt="make it blue", negative_prompt="blurry", true_cfg_scale=4.0,
        num_inference_steps=2, height=48, width=32, generator=torch.Generator().manual_seed(5),
        output_type="np",
    ).images[0]  # fmt: skip
    diff = float(np.abs(np.load(out)[0] - want).max())
    print(f"{split}: infer.py on 4 processes vs the pipeline {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
@torch.no_grad()
def test_pipefusion_with_references_matches_one_process(edit, tmp_path):
    """PipeFusion 2 x ulysses 2 (4 processes), one warm-up step of 3, true CFG 4 (both branches in turn on
    one pipeline): the references' tokens pass beside each patch after the text, whole on every rank
    (this rank's heads under ulysses), 2511's modulated at t = 0. The image is that of the same schedule
    run item by item on one process (tests/test_families.py sequential_pipefusion), and the patches ran
    (whole steps differ)."""
    import numpy as np

    from configs import load_config
    from models.families import family_named
    from models.image_condition import load_image
    from models.sampler import Sampling
    from tests.conftest import ranks
    from tests.test_families import stale_patches

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("2511's launch covers 2509's path (its references' flags besides)")
    out = tmp_path / "out.npy"
    argv = edit_args(folder, tmp_path, paths[:1], "--prompt", "make it blue", "--negative-prompt", "blurry",
                     "--steps", "3", "--guidance", "4", "--seed", "5", "--height", "128", "--width", "64",
                     "--output", str(out), "parallel.pipefusion=2", "parallel.ulysses=2",
                     "parallel.pipefusion_warmup=1")  # fmt: skip
    done = ranks(4, "infer.py", *argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PipeFusion: 2 patches, 1 warm-up step(s)" in done.stdout, done.stdout
    family, cfg = family_named("qwen_image_edit"), load_config(argv[1], argv[2:8])
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    sampling = Sampling(["make it blue"], [5], (1, 128, 64), 3, 4.0, "blurry", cfg.text_encoder.max_length,
                        [[load_image(paths[0])]])  # fmt: skip
    diff, stale = stale_patches(family, parts, sampling, np.load(out))
    print(f"PipeFusion with a reference vs one process item by item {diff:.2e} (vs whole steps {stale:.2e})")
    # the references' 252 tokens (model.reference_area: 256 x 256 pixels) outweigh the 32 noisy
    # ones in each attention: the stale patches move the image by little, still 10 times the difference
    assert diff <= 1e-5 and stale > 10 * diff


@pytest.mark.slow
def test_a_calibrated_step_cache_with_references(edit, tmp_path, capsys):
    """scripts/calibrate_cache.py --image: the references given to the sampling it records, through
    infer.py (another reference, another table); infer.py with sample.cache=calibrated then calls the
    model on the steps the table's budget leaves (2 of 4), for other references too (the table carries
    over to them, as to other prompts), the image other than the uncached one."""
    import numpy as np

    from tests.conftest import ROOT, run_main
    from tests.test_families import cached_and_uncached

    sys.path.insert(0, str(ROOT / "scripts"))
    import calibrate_cache

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("2511's run covers 2509's path")
    argv = edit_args(folder, tmp_path, [])[:-3]  # the recipe and its parts, no --image
    tables = [tmp_path / "c.json", tmp_path / "other.json"]
    for path, table in zip(paths, tables):
        calibrate = ["--image", str(path), "--steps", "4", "--seeds", "1", "--prompts", "make it blue"]
        assert run_main(calibrate_cache, [*argv, *calibrate, "--output", str(table)]) == 0
    change = [json.loads(table.read_text())["change"] for table in tables]
    assert change[0] != change[1], change  # the references reached the sampling it recorded
    table = tables[0]
    cached = ["sample.cache=calibrated", f"sample.cache_calibration={table}", "sample.cache_threshold=100"]
    argv += ["--image", str(paths[1]), "--frames", "1", "--steps", "4", "--prompt", "add a hat",
             "--seed", "3", "--height", "48", "--width", "32"]  # fmt: skip
    image, uncached = cached_and_uncached(argv, cached, tmp_path, capsys)
    assert np.isfinite(image).all() and np.abs(image - uncached).max() > 1e-4


# the first-block cache's thresholds (2509, 2511): of 8 steps, some middle ones reuse (compared unguided:
# diffusers decides per branch, as for Qwen-Image in tests/test_families.py). 2511's rule reads mostly its
# references' residual, which moves little (their tokens modulated at t = 0 and 42 times the noisy ones
# here): a threshold 8 times lower, amid the gap where 4 steps run every block (0.0375 to 0.04 here)
FIRST_BLOCK_THRESHOLDS = {False: 0.3, True: 0.039}


@torch.no_grad()
@pytest.mark.parametrize("layout", ["one-process", pytest.param("ulysses2", marks=pytest.mark.slow)])
def test_first_block_cache_matches_diffusers(edit, tmp_path, capsys, layout):
    """sample.cache=first_block with a reference image against diffusers' own first-block cache hooks on
    the pipeline (diffusers.hooks.apply_first_block_cache, code no one here wrote), 8 steps, unguided:
    the same steps run every block (fewer than 8) and the same image. Its rule reads the image stream's
    residual, the references' tokens included, which pass beside the noisy ones in tessera's pieces;
    under ulysses 2 (2511) they pass whole on both ranks and their residual counts once."""
    import numpy as np
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    import infer
    from models.image_condition import load_image
    from tests.conftest import ranks, run_main

    pipe, folder, paths = edit
    out, threshold = tmp_path / "out.npy", FIRST_BLOCK_THRESHOLDS[pipe.transformer.config.zero_cond_t]
    argv = edit_args(folder, tmp_path, paths[:1], "--prompt", "make it blue", "--steps", "8", "--guidance",
                     "1", "--seed", "5", "--height", "48", "--width", "32", "--output", str(out),
                     "sample.cache=first_block",
                     f"sample.cache_first_block_threshold={threshold}",
                     "sample.cache_max_skips=8")  # fmt: skip
    if layout == "one-process":
        assert run_main(infer, argv) == 0
        said = capsys.readouterr().out
    else:
        if not pipe.transformer.config.zero_cond_t:
            pytest.skip("2511's launch: its references' residual decides its steps (2509's do not)")
        done = ranks(2, "infer.py", *argv, "parallel.ulysses=2", timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        said = done.stdout
    full = float(said.split("[tessera] step cache: ")[1].split(" of 8")[0])
    transformer = type(pipe.transformer).from_pretrained(folder / "transformer")  # the module's stays bare
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    calls = []  # the second block's attention runs only when every block runs
    transformer.transformer_blocks[1].attn.register_forward_hook(lambda *a: calls.append(1))
    cached = type(pipe)(**{**pipe.components, "transformer": transformer})
    cached.set_progress_bar_config(disable=True)
    want = cached(
        image=[load_image(paths[0])], prompt="make it blue", true_cfg_scale=1.0, num_inference_steps=8,
        height=48, width=32, generator=torch.Generator().manual_seed(5), output_type="np",
    ).images[0]  # fmt: skip
    diff = float(np.abs(np.load(out)[0] - want).max())
    print(f"{full:g} of 8 steps ran every block (diffusers: {len(calls)}), max abs {diff:.2e}")
    assert 1 < full < 8 and full == len(calls) and want.std() > 0.01
    assert diff <= 1e-5


def test_the_folder_is_edit_not_qwen_image(edit):
    """Its transformer's class is Qwen-Image's: model.size=auto tells the folder by its pipeline's class,
    and a Qwen-Image folder stays Qwen-Image's."""
    import json

    from configs import load_config

    _, folder, _ = edit
    family = lambda: load_config(None, ["model.size=auto", f"model.pretrained={folder}"]).model.family  # noqa: E731
    assert family() == "qwen_image_edit"
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImagePipeline"}))
    try:
        assert family() == "qwen_image"
    finally:
        (folder / "model_index.json").write_text(json.dumps(index))


def test_a_single_file_takes_the_folders_config(edit, tmp_path):
    """One transformer file beside the release's folder (vae.pretrained): its config is the folder's
    transformer/config.json, 2511's zero_cond_t included (the file's shapes do not hold it)."""
    from safetensors.torch import save_file

    from configs import load_config
    from models.families import family_named

    pipe, folder, _ = edit
    single = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, single)
    overrides = ["model.family=qwen_image_edit", "model.size=auto", f"model.pretrained={single}",
                 f"vae.pretrained={folder}", f"text_encoder.pretrained={folder}"]  # fmt: skip
    cfg = load_config(None, overrides)
    model = family_named("qwen_image_edit").meta_transformer(cfg)
    assert model.zero_cond_t == pipe.transformer.config.zero_cond_t


def edit_train_args(folder, run, manifest, *extra):
    from tests.conftest import ROOT

    parts = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    data = ["data.resolutions=[]", "data.aspect_ratios=[]", "data.frame_counts=[]", "data.frames=1",
            "data.height=48", "data.width=32", "data.num_workers=0", f"data.manifest={manifest}"]  # fmt: skip
    steps = ["train.batch_size=1", "train.max_steps=2", "train.warmup_steps=1", "train.lr=1e-3",
             "train.log_every=1", "train.checkpoint_every=2", "train.sample_every=2"]  # fmt: skip
    previews = ["sample.steps=2", "sample.height=48", "sample.width=32", "sample.prompts=[make it blue]"]
    rest = ["logging.wandb=false", "parallel.timeout_s=60", f"run.output_dir={run}"]
    recipe = str(ROOT / "configs" / "qwen-image-edit.yaml")
    area = [f"model.reference_area={AREA}"]
    return ["--config", recipe, "model.size=auto", *parts, *area, *data, *steps, *previews, *rest, *extra]


def edit_pairs(folder, paths) -> object:
    """A manifest of two edit pairs: 48 x 32 targets, one reference each (then both for the second)."""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    lines = []
    for i, refs in enumerate(([paths[0]], paths)):
        Image.fromarray(rng.integers(0, 256, (48, 32, 3), dtype=np.uint8)).save(folder / f"target{i}.png")
        lines.append(dict(path=f"target{i}.png", caption=["make it blue", "swap them"][i],
                          references=[str(p) for p in refs], width=32, height=48, num_frames=1))  # fmt: skip
    manifest = folder / "pairs.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def test_a_folder_of_edit_pairs_is_the_manifest(tmp_path):
    """The simple form: a target with its caption and its input images beside it, numbered a_0.png, a_1.png,
    ... (in their numbers' order, 10 after 2), gives the lines a manifest with `references` gives; an
    uncaptioned image that is no one's input is left out as before, a numbered captioned one is a target."""
    import numpy as np
    from PIL import Image

    from data.manifest import read_manifest
    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    rng = np.random.default_rng(0)

    def image(name, size=(48, 32)):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp_path / name)
        return str(tmp_path / name)

    pairs = {"sky.png": ["sky_0.png"], "cat.jpg": ["cat_0.png", "cat_2.png", "cat_10.png"], "dog_1.png": []}
    for target, refs in pairs.items():
        image(target)
        (tmp_path / target).with_suffix(".txt").write_text(f"edit {target}")
        for ref in refs:
            image(ref, (40, 40))
    stray = image("stray.png")
    plain = read_manifest(tmp_path, {})  # a family that reads no references: numbered images are not inputs
    assert not any(e.get("references") for e in plain)
    left_out = {}
    entries = {Path(e["path"]).name: e for e in read_manifest(tmp_path, left_out, references=True)}
    assert sorted(entries) == sorted(pairs) and list(left_out) == [stray]
    for target, refs in pairs.items():
        assert reference_paths(entries[target]) == [str(tmp_path / r) for r in refs]
        assert entries[target]["caption"] == f"edit {target}" and entries[target]["height"] == 48
    manifest = tmp_path / "pairs.jsonl"  # the same pairs as a manifest
    lines = [dict(path=t, caption=f"edit {t}", **({"references": r} if r else {})) for t, r in pairs.items()]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    listed = {Path(e["path"]).name: reference_paths(e) for e in read_manifest(manifest)}
    assert listed == {t: reference_paths(e) for t, e in entries.items()}
    import index_folder  # scripts/index_folder.py --references writes the manifest read back the same

    written = tmp_path / "indexed.jsonl"
    assert index_folder.main([str(tmp_path), "--references", "--out", str(written)]) == 0
    assert {Path(e["path"]).name: reference_paths(e) for e in read_manifest(written)} == listed


def test_a_pixel_aligned_reference_is_cropped_as_its_target(edit, tmp_path):
    """A before/after pair of one size, cropped to a bucket of another aspect ratio: the reference of the
    target's own size is cropped and resized as the target is (a copy of the target loads as the target's
    pixels), one of another size comes as it is."""
    import numpy as np
    from PIL import Image

    from configs import load_config
    from data.loader import build_buckets, build_dataset

    pipe, folder, _ = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("the data path is the same for 2509 and 2511")
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (60, 32, 3), dtype=np.uint8)  # taller than the 48 x 32 bucket
    Image.fromarray(pixels).save(tmp_path / "after.png")
    Image.fromarray(pixels).save(tmp_path / "before.png")  # aligned: the target's own size
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "other.png")
    line = dict(path="after.png", caption="x", references=["before.png", "other.png"])
    manifest = tmp_path / "pair.jsonl"
    manifest.write_text(json.dumps(line) + "\n")
    argv = edit_train_args(folder, tmp_path / "run", manifest)
    cfg = load_config(argv[1], argv[2:])
    dataset = build_dataset(cfg, build_buckets(cfg))
    sample = dataset.load(dataset.entries[0], dataset.table.buckets[0], None)
    aligned, other = sample["references"]
    assert tuple(sample["video"].shape) == (3, 1, 48, 32) and torch.equal(aligned, sample["video"][:, 0])
    assert tuple(other.shape) == (3, 40, 40)


@torch.no_grad()
def test_the_edit_loss_is_the_pipelines(edit, tmp_path):
    """An edit pair's loss as train.py computes it (the loader's references, encode_family_batch,
    family_batch, the loss on the noisy tokens) against the same loss from the pipeline's own pieces: its
    prompt encoding with the images, its target and reference latents, its img_shapes."""
    from types import SimpleNamespace

    from configs import load_config
    from data.loader import build_buckets, build_dataset, encode_family_batch
    from models.families import family_named
    from models.flow import RectifiedFlow
    from models.qwen_image import pack_latents, unpack_latents
    from parallel.drive.family_training import FamilyRun, family_batch

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:  # its flags: the transformer's, tested with diffusers'
        pytest.skip("2511's loss covers 2509's path: the pairs, their encoding and the loss are one code")
    manifest = edit_pairs(tmp_path, paths)
    argv = edit_train_args(folder, tmp_path / "run", manifest)
    cfg = load_config(argv[1], argv[2:])
    family = family_named("qwen_image_edit")
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    dataset = build_dataset(cfg, build_buckets(cfg))
    sample = dataset.load(dataset.entries[1], dataset.table.buckets[0], None)
    batch = {"caption": ["swap them"], "video": sample["video"][None], "references": [sample["references"]]}
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    x0, cond = family_batch(
        run, SimpleNamespace(sp_size=1), encode_family_batch(run, batch, [False], "cpu"), "cpu"
    )
    g = torch.Generator().manual_seed(0)
    noise, sigma = torch.randn(x0.shape, generator=g), torch.tensor([0.4])
    ours = family.objective.loss(
        parts, RectifiedFlow(cfg.flow, (1, 1, 1)), parts.transformer, x0, cond, noise, sigma
    )

    from models.image_condition import load_image
    from models.qwen_image.edit import CONDITION_AREA, pipeline_size

    images = [load_image(p) for p in paths]
    small = [pipe.image_processor.resize(im, *pipeline_size(CONDITION_AREA, im)) for im in images]
    embeds, mask = pipe.encode_prompt("swap them", image=small, device="cpu")
    vae_images = [
        pipe.image_processor.preprocess(im, *pipeline_size(AREA, im)).unsqueeze(2) for im in images
    ]
    target = pipe._encode_vae_image(sample["video"][None].float() / 127.5 - 1, None)
    _, refs = pipe.prepare_latents(vae_images, 1, 4, 48, 32, torch.float32, "cpu", None)
    x_t = (1 - sigma) * target + sigma * noise
    shapes = [[(1, 3, 2), *[(1, v.shape[-2] // 16, v.shape[-1] // 16) for v in vae_images]]]
    pred = pipe.transformer(hidden_states=torch.cat([pack_latents(x_t), refs], dim=1), timestep=sigma,
                            encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, img_shapes=shapes,
                            return_dict=False)[0][:, :6]  # fmt: skip
    want = torch.nn.functional.mse_loss(unpack_latents(pred, (1, 3, 2)), noise - target)
    print(f"edit loss: train.py {ours.item():.6f}, the pipeline's pieces {want.item():.6f}")
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()


@pytest.mark.slow
def test_precomputed_edit_pairs_train_as_the_pairs_do(edit, tmp_path, monkeypatch):
    """scripts/precompute_latents.py stores each pair's target latent, its instruction read with its images,
    its references' latents and grids, and its instruction dropped (the empty one read with its images);
    training on them takes the steps training on the pairs takes: the same losses and gradient norms, some
    instructions dropped. A reference changed since is encoded again."""
    import shutil
    import sys

    from PIL import Image

    import train
    from tests.conftest import ROOT, run_main

    sys.path.insert(0, str(ROOT / "scripts"))
    import precompute_latents

    pipe, folder, shared = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("2511's stored conditioning is 2509's (its flags are the transformer's, not stored)")
    paths = [Path(shutil.copy(p, tmp_path / f"input{i}.png")) for i, p in enumerate(shared)]  # changed below
    manifest, images = edit_pairs(tmp_path, paths), f"sample.images=[{paths[0]}]"
    extra = [images, "train.text_dropout=0.5", "train.max_steps=4", "train.checkpoint_every=4"]
    extra += ["train.sample_every=0"]  # no previews: what is compared is the steps
    latents = tmp_path / "latents"
    argv = edit_train_args(folder, tmp_path / "media", manifest, *extra)
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    assert run_main(train, argv) == 0
    seen, encode = [], train.encode_family_batch

    def spy(run, batch, dropped, device):  # what each step on latents read, and dropped
        seen.append(("stored" in batch, sum(dropped)))
        return encode(run, batch, dropped, device)

    monkeypatch.setattr(train, "encode_family_batch", spy)
    stored_run = tmp_path / "stored"
    argv_stored = edit_train_args(folder, stored_run, manifest, *extra, f"data.latents={latents}")
    assert run_main(train, argv_stored) == 0
    assert len(seen) == 4 and all(s[0] for s in seen) and sum(s[1] for s in seen) >= 1, seen
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    media, stored = read(tmp_path / "media"), read(stored_run)
    worst = max(abs(b[k] - a[k]) / abs(a[k]) for a, b in zip(media, stored) for k in ("loss", "grad_norm"))
    print(f"edit pairs on latents vs on images: largest relative difference {worst:.1e}")
    assert len(stored) == len(media) == 4 and worst <= 1e-5
    from configs import load_config
    from data.latents import read_latent_index

    at_default = [a for a in argv_stored[2:] if not a.startswith("model.reference_area")]
    with pytest.raises(ValueError, match=f"family.reference_area: {AREA} there, None here"):
        read_latent_index(latents, load_config(argv_stored[1], at_default))  # references of another size
    index = lambda: [json.loads(line)["path"] for line in (latents / "index.jsonl").read_text().splitlines()]  # noqa: E731
    before = index()
    Image.open(paths[1]).transpose(Image.FLIP_LEFT_RIGHT).save(paths[1])  # the second pair's own reference
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    after = index()
    assert after[0] == before[0] and after[1] != before[1]  # the first pair's file kept, the second's new


@pytest.mark.slow
def test_a_lora_trained_on_edit_pairs_loads_in_the_pipeline(edit, tmp_path):
    """Three steps of a rank-4 LoRA on two edit pairs (the previews editing sample.images), exported in
    diffusers' names: QwenImageEditPlusPipeline.load_lora_weights gives infer.py --lora's image, and the
    LoRA moves it."""
    import numpy as np

    import infer
    import train
    from models.image_condition import load_image
    from tests.conftest import ROOT, run_main

    sys_path = str(ROOT / "scripts")
    import sys

    sys.path.insert(0, sys_path)
    import export

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("a LoRA's training, export and loading are one path for 2509 and 2511: 2511's covers it")
    manifest, run = edit_pairs(tmp_path, paths), tmp_path / "train"  # infer.py's run.output_dir is "run"
    steps = ["train.max_steps=3", "train.checkpoint_every=3", "train.sample_every=3", "train.lr=2e-1"]
    argv = edit_train_args(folder, run, manifest, "lora.rank=4", *steps, f"sample.images=[{paths[0]}]")
    assert run_main(train, argv) == 0
    assert (run / "samples" / "step_3_0.mp4").stat().st_size > 0
    lora = tmp_path / "lora.safetensors"
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(lora)]) == 0
    out = tmp_path / "out.npy"
    args = edit_args(folder, tmp_path, paths[:1], "--prompt", "make it blue", "--steps", "2", "--guidance",
                     "1", "--seed", "5", "--height", "48", "--width", "32", "--output", str(out))  # fmt: skip
    args += ["--lora", str(lora)]
    assert run_main(infer, args) == 0

    @torch.no_grad()
    def sample():
        image, generator = load_image(paths[0]), torch.Generator().manual_seed(5)
        return pipe(image=[image], prompt="make it blue", num_inference_steps=2, height=48, width=32,
                    generator=generator, output_type="np").images[0]  # fmt: skip

    base = sample()
    pipe.load_lora_weights(lora, adapter_name="edit")
    try:
        want = sample()
    finally:
        pipe.delete_adapters("edit")
    diff, moved = float(np.abs(np.load(out)[0] - want).max()), float(np.abs(want - base).max())
    print(f"edit LoRA: infer.py --lora vs the pipeline {diff:.2e}; the LoRA moves it {moved:.2e}")
    # the tiny VAE's images move little (2e-4 here after 3 steps): the LoRA's effect against the agreement
    assert diff <= 1e-5 and moved > 100 * diff


def test_training_refusals(edit, tmp_path, capsys):
    """Before anything starts, one error line each: two pairs a rank a step, no preview images, a manifest
    line whose references are not a list, a line without references or with more than 3, a line whose
    reference is missing (as a missing file: the only line, so above data.max_missing_fraction), a preview
    image that is missing."""
    import json

    import train
    from tests.conftest import run_main

    _, folder, paths = edit
    manifest = edit_pairs(tmp_path, paths)

    def lines(name, references):
        path = tmp_path / name
        line = {
            "path": "target0.png",
            "caption": "x",
            **({} if references is None else {"references": references}),
        }
        path.write_text(json.dumps(line) + chr(10))
        return f"data.manifest={path}"

    images = f"sample.images=[{paths[0]}]"
    cases = [
        (train, [images, "train.batch_size=2"], "train.batch_size=2"),
        (train, [], "sample.images is empty"),
        (train, [images, lines("text.jsonl", "ref0.png")], "'references' must be a list"),
        (train, [images, lines("none.jsonl", None)], "names 0 references"),
        (train, [images, lines("four.jsonl", [str(paths[0])] * 4)], "names 4 references"),
        (train, [images, lines("gone.jsonl", [str(tmp_path / "gone.png")])], "missing"),
        (train, [f"sample.images=[{tmp_path / 'gone.png'}]"], "sample.images: "),
    ]
    for i, (program, extra, expected) in enumerate(cases):
        run = tmp_path / f"run{i}"
        assert run_main(program, edit_train_args(folder, run, manifest, *extra)) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
        assert not (run / "checkpoints").exists()  # a missing file's refusal leaves its data report alone


@pytest.mark.slow
@pytest.mark.parametrize("degree", ["parallel.ring=2"])
def test_edit_training_under_a_split_is_one_process(edit, tmp_path, degree):
    """Two processes sharing each pair's tokens, the references' with the target's (2511: their flags
    for the t = 0 modulation split alike): every step's loss and gradient norm are one process's. The
    references join the sequence before it is split, the same under either degree; ulysses' operators
    train in tests/test_family_training.py's Qwen-Image row and split references in the sampling above."""
    import json

    import train
    from tests.conftest import ranks, run_main

    pipe, folder, paths = edit
    if not pipe.transformer.config.zero_cond_t:
        pytest.skip("2511's launch covers 2509's operators and its own flags")
    manifest, images = edit_pairs(tmp_path, paths), f"sample.images=[{paths[0]}]"
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert run_main(train, edit_train_args(folder, tmp_path / "one", manifest, images)) == 0
    argv = edit_train_args(folder, tmp_path / "two", manifest, images, degree)
    done = ranks(2, "train.py", *argv, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    pairs = [(a[k], b[k]) for a, b in zip(read(tmp_path / "one"), read(tmp_path / "two"), strict=True)
             for k in ("loss", "grad_norm")]  # fmt: skip
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(f"edit {degree}: losses and gradient norms within {worst:.1e} (relative) of one process's")
    assert len(pairs) == 4 and worst <= 1e-5, pairs
