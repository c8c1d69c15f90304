"""Image-to-video against diffusers' WanImageToVideoPipeline, code no one here wrote: the same tiny random
pipeline folder (an I2V transformer, AutoencoderKLWan, UMT5, a CLIPVisionModel and its processor), image,
prompt, negative prompt, seed, steps and guidance give the same video from infer.py --image, for Wan2.1
I2V and FLF2V (--last-image); a model fine-tuned on its clips' first (and last) frames and exported with
--pipeline samples in diffusers what infer.py samples; and the refusals. Every sampling layout gives the
one-process image-to-video result in tests/pipefusion_worker.py."""

import sys

import numpy as np
import pytest
import torch

import infer
import train
from tests.conftest import ROOT, ranks, run_main
from tests.test_e2e import losses

sys.path.insert(0, str(ROOT / "scripts"))

from tests.test_wan_pipeline import (  # noqa: E402
    PROMPT,
    RECIPE,
    TINY_TRANSFORMER,
    diffusers_video,
    perturb,
    tiny_vae_and_text_encoder,
)

CLIP_TOKENS = 17  # a 32 px image in 8 px patches, plus the class token


def tiny_i2v_pipeline(folder, flf2v: bool):
    """The text-to-video test's tiny pipeline with an I2V transformer, a CLIPVisionModel and its processor."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import ByT5Tokenizer, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    image = dict(in_channels=12, image_dim=32, added_kv_proj_dim=64)  # 4 noisy + 4 mask + 4 condition in
    if flf2v:
        image["pos_embed_seq_len"] = 2 * CLIP_TOKENS
    transformer = WanTransformer3DModel(**dict(TINY_TRANSFORMER, **image))
    perturb(transformer)
    vae, text_encoder = tiny_vae_and_text_encoder()
    clip = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    WanImageToVideoPipeline(
        tokenizer=ByT5Tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        image_encoder=CLIPVisionModel(clip),
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    ).save_pretrained(folder)


@pytest.fixture(scope="module", params=["i2v", "flf2v"])
def i2v_pipeline(request, tmp_path_factory):
    from PIL import Image

    task = request.param
    root = tmp_path_factory.mktemp(task)
    tiny_i2v_pipeline(root / "pipe", flf2v=task == "flf2v")
    recipe = root / "i2v.yaml"
    extra = f"model:\n  task: {task}\n  image_dim: 32\n  image_tokens: {CLIP_TOKENS}\n"
    body = RECIPE.format(pipe=root / "pipe").replace("max_length: 40", "max_length: 512")  # diffusers' split
    recipe.write_text(body.replace("model:\n", extra, 1))
    g = np.random.default_rng(0)
    images = []
    for name in ("first.png", "last.png"):
        Image.fromarray(g.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / name)
        images.append(root / name)
    return task, root / "pipe", recipe, images


def diffusers_i2v(folder, first, last=None) -> np.ndarray:
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    return diffusers_video(
        WanImageToVideoPipeline.from_pretrained(folder),
        max_sequence_length=512,  # diffusers splits the image's tokens off 512 text tokens
        image=Image.open(first).convert("RGB"),
        last_image=None if last is None else Image.open(last).convert("RGB"),
    )


def sample_args(recipe, run, out, images, task):
    args = [
        "--config",
        str(recipe),
        f"run.output_dir={run}",
        "--frames",
        "5",
        "--height",
        "32",
        "--width",
        "32",
    ]
    args += ["--prompt", PROMPT, "--output", str(out), "--image", str(images[0])]
    return args + (["--last-image", str(images[1])] if task == "flf2v" else [])


@pytest.mark.timeout(240)
def test_infer_equals_wan_image_to_video_pipeline(i2v_pipeline, tmp_path):
    task, pipe_dir, recipe, images = i2v_pipeline
    expected = diffusers_i2v(pipe_dir, images[0], images[1] if task == "flf2v" else None)
    args = sample_args(recipe, tmp_path / "run", tmp_path / "one.npy", images, task)
    assert run_main(infer, args) == 0
    video = np.load(tmp_path / "one.npy")
    assert video.shape == expected.shape == (5, 32, 32, 3) and expected.std() > 0.05
    assert np.abs(video - expected).max() <= 1e-5, np.abs(video - expected).max()
    # the frames count: another first frame gives another video
    other = sample_args(recipe, tmp_path / "run", tmp_path / "other.npy", images[::-1], task)
    assert run_main(infer, other) == 0
    assert np.abs(np.load(tmp_path / "other.npy") - video).max() > 1e-3


def test_model_size_auto_reads_the_image_task(i2v_pipeline, tmp_path):
    """model.size=auto on an I2V / FLF2V folder: the task, the CLIP width and the image tokens (FLF2V's
    from its positions, I2V's from the pipeline's CLIP encoder)."""
    from configs import load_config
    from tests.test_wan_pipeline import architecture, auto_recipe

    task, _, recipe, _ = i2v_pipeline
    cfg = load_config(auto_recipe(recipe, tmp_path))
    assert (cfg.model.task, cfg.model.image_dim, cfg.model.image_tokens) == (task, 32, CLIP_TOKENS)
    assert architecture(cfg) == architecture(load_config(recipe))


def test_image_to_video_refusals_name_the_fix(i2v_pipeline, tmp_path, capsys):
    """Every refusal of infer.py and train.py names its cause before anything starts, for both tasks: the
    ones they share (naming the task), and each task's own frames: I2V takes no last frame; FLF2V needs
    one, and a video long enough to hold both."""
    task, _, recipe, images = i2v_pipeline
    base = sample_args(recipe, tmp_path / "run", tmp_path / "x.npy", images, task)
    no_image = base[: base.index("--image")]
    cases = [
        (no_image, f"model.task={task} needs --image"),
        (
            no_image + ["model.task=t2v", "model.image_dim=null", "--image", str(images[0])],
            "--image was given, but model.task=t2v",
        ),
        (no_image + ["model.task=t2v"], "model.image_dim=32 is image-to-video's: set model.task=i2v"),
        (base + ["vae.kind=identity"], "built for Wan's VAE"),
        (base[:-1] + [str(tmp_path / "missing.png")], "missing.png cannot be read as an image"),
        (base + ["--width", "64"], "is 32x32 and the video 64x32"),
        (base + ["image_encoder.pretrained=" + str(tmp_path)], "no CLIPVisionModel there"),
    ]
    if task == "i2v":
        cases.append((base + ["--last-image", str(images[1])], "--last-image was given, but model.task=i2v"))
    else:  # base ends with --last-image PATH
        at = base.index("--frames") + 1
        one_frame = base[:at] + ["1"] + base[at + 1 :]
        cases += [
            (base[:-2], "model.task=flf2v needs --last-image"),
            (one_frame, "model.task=flf2v needs videos of at least 5 frames"),
        ]
    for args, message in cases:
        assert run_main(infer, args) == 2, args
        assert message in capsys.readouterr().err, message
    # training: the previews' frames and the CLIP encoder's width, checked before anything starts
    training = train_args(recipe, tmp_path / "run", images, task)
    cases = [
        (training[:3], f"model.task={task} needs sample.images"),
        (
            training + ["data.frame_counts=[1,5]"],
            f"data.frame_counts: model.task={task} trains on clips of at least {2 if task == 'i2v' else 5}",
        ),
        (training + ["model.image_dim=16"], "model.image_dim=16, but the CLIP image encoder"),
        (training + ["sample.width=64"], "sample.images " + str(images[0]) + " is 32x32 and the video 64x32"),
    ]
    if task == "i2v":
        last = f"sample.last_images=[{images[1]}]"
        cases.append((training + [last], "sample.last_images was given, but model.task=i2v"))
    else:  # train_args ends with sample.last_images
        cases.append((training[:-1], "model.task=flf2v needs sample.last_images"))
    for args, message in cases:
        assert run_main(train, args) == 2, args
        assert message in capsys.readouterr().err, message
    assert not (tmp_path / "run").exists()  # refused before the run directory is written


def train_args(recipe, run, images, task):
    args = [
        "--config",
        str(recipe),
        f"run.output_dir={run}",
        f"sample.images=[{images[0]}]",
        "train.log_every=1",
    ]
    return args + ([f"sample.last_images=[{images[1]}]"] if task == "flf2v" else [])


@pytest.mark.slow  # 12 s a task: the fast tier keeps image-to-video's sampling, TI2V's training and refusals
@pytest.mark.timeout(300)
def test_fine_tuned_image_to_video_exports_what_infer_samples(i2v_pipeline, tmp_path):
    """Two steps of fine-tuning on the clips' first (FLF2V: and last) frames, from the pipeline folder.
    I2V also trains on 2 processes under ulysses 2 to one process's losses: one rank encodes the clips and
    their condition, the other receives them, so a rank with another condition would show. FLF2V also
    trains from precomputed latents (the condition and the CLIP features stored) to the same losses. The
    run exported with --pipeline samples in WanImageToVideoPipeline what infer.py samples from it."""
    import export
    import precompute_latents

    task, pipe_dir, recipe, images = i2v_pipeline
    one = tmp_path / "one"
    assert run_main(train, train_args(recipe, one, images, task)) == 0
    assert (one / "samples" / "step_2_0.mp4").is_file()  # the preview, from sample.images
    if task == "i2v":
        run = tmp_path / "two"
        args = train_args(recipe, run, images, task) + ["parallel.ulysses=2"]
        result = ranks(2, "train.py", *args, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        run, latents = one, tmp_path / "latents"
        assert run_main(precompute_latents, ["--config", str(recipe), "--out", str(latents)]) == 0
        args = train_args(recipe, tmp_path / "from_latents", images, task) + [f"data.latents={latents}"]
        assert run_main(train, args) == 0
    other = run if task == "i2v" else tmp_path / "from_latents"
    a, b = losses(one), losses(other)
    assert a.keys() == b.keys() == {1, 2} and all(b[s] == pytest.approx(a[s], rel=1e-4) for s in a), (a, b)
    exported = tmp_path / "exported"
    assert export.main(["--checkpoint", str(run), "--output", str(exported), "--pipeline", "--no-ema"]) == 0
    last = images[1] if task == "flf2v" else None
    expected = diffusers_i2v(exported, images[0], last)
    assert run_main(infer, sample_args(recipe, run, tmp_path / "t.npy", images, task) + ["--no-ema"]) == 0
    video = np.load(tmp_path / "t.npy")
    assert np.abs(video - expected).max() <= 1e-4, np.abs(video - expected).max()
    assert np.abs(expected - diffusers_i2v(pipe_dir, images[0], last)).max() > 1e-3  # training shows


@pytest.mark.timeout(240)
def test_wan22_image_to_video_a14b_samples_what_diffusers_samples(tmp_path):
    """Wan2.2 I2V-A14B: two I2V experts (36 channels in, no image encoder), boundary_ratio 0.9,
    guidance_scale_2: infer.py --image gives WanImageToVideoPipeline's video, on one process and under
    cfg 2, and not the high-noise expert's alone."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from transformers import ByT5Tokenizer

    experts = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        experts.append(WanTransformer3DModel(**dict(TINY_TRANSFORMER, in_channels=12)))
        perturb(experts[-1])
    vae, text_encoder = tiny_vae_and_text_encoder()
    parts = dict(tokenizer=ByT5Tokenizer(), text_encoder=text_encoder, vae=vae, transformer=experts[0])
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=3.0)
    WanImageToVideoPipeline(**parts, transformer_2=experts[1], boundary_ratio=0.9).save_pretrained(
        tmp_path / "pipe"
    )
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path / "pipe")
    pair = diffusers_video(
        pipe, max_sequence_length=512, image=Image.open(image).convert("RGB"), guidance_scale_2=3.0
    )
    alone = diffusers_video(  # the high-noise expert alone
        WanImageToVideoPipeline(**parts), max_sequence_length=512, image=Image.open(image).convert("RGB")
    )
    assert np.abs(pair - alone).max() > 1e-3  # the low-noise expert counts
    recipe = tmp_path / "a14b.yaml"
    body = RECIPE.format(pipe=tmp_path / "pipe").replace("max_length: 40", "max_length: 512")
    recipe.write_text(body.replace("model:\n", "model:\n  task: i2v\n", 1))
    args = sample_args(recipe, tmp_path / "run", tmp_path / "one.npy", [image], "i2v") + [
        "sample.guidance_2=3.0"
    ]
    assert run_main(infer, args) == 0
    video = np.load(tmp_path / "one.npy")
    assert np.abs(video - pair).max() <= 1e-5, np.abs(video - pair).max()  # measured 1.2e-7
    args[args.index("--output") + 1] = str(tmp_path / "cfg.npy")
    result = ranks(2, "infer.py", *args, "parallel.cfg=2", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.abs(np.load(tmp_path / "cfg.npy") - pair).max() <= 1e-5


@pytest.mark.timeout(300)
def test_wan22_ti2v_samples_and_trains_as_diffusers_does(tmp_path, monkeypatch):
    """Wan2.2 TI2V-5B's expand_timesteps, with a tiny 48-channel AutoencoderKLWan (patch 2, stride 16):
    with --image the frame's latent replaces the first latent frame and its tokens run at t = 0, as in
    WanImageToVideoPipeline(expand_timesteps=True); without, text-to-video as WanPipeline samples it; the
    image-to-video result also under PipeFusion 2, at 9 tokens (3 x 1 x 3), which 2 does not divide.
    model.size=auto reads the folder as TI2V. Fine-tuned (the clip's first frame given; ulysses 2 trains
    one process's losses), exported and sampled by diffusers: the same."""
    import export
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from PIL import Image
    from transformers import ByT5Tokenizer

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**dict(TINY_TRANSFORMER, in_channels=48, out_channels=48))
    perturb(transformer)
    g = torch.Generator().manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=16,
        latents_mean=(torch.randn(48, generator=g) * 0.1).tolist(),
        latents_std=(1 + torch.rand(48, generator=g)).tolist(),
    )
    _, text_encoder = tiny_vae_and_text_encoder()
    parts = dict(tokenizer=ByT5Tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer)
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=3.0)
    WanImageToVideoPipeline(**parts, expand_timesteps=True).save_pretrained(tmp_path / "pipe")
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 96, 3), dtype=np.uint8)).save(image)
    size = dict(
        height=32, width=96, num_frames=9, num_inference_steps=3, guidance_scale=5.0, output_type="np"
    )
    common = dict(prompt=PROMPT, negative_prompt="", max_sequence_length=40, **size)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path / "pipe")
    i2v = pipe(image=Image.open(image), generator=torch.Generator().manual_seed(0), **common).frames[0]
    t2v_pipe = WanPipeline(**{k: getattr(pipe, k) for k in parts}, expand_timesteps=True)
    t2v = t2v_pipe(generator=torch.Generator().manual_seed(0), **common).frames[0]
    recipe = tmp_path / "ti2v.yaml"
    recipe.write_text(RECIPE.format(pipe=tmp_path / "pipe").replace("model:\n", "model:\n  task: ti2v\n", 1))
    from configs import load_config
    from tests.test_wan_pipeline import architecture, auto_recipe

    auto = load_config(auto_recipe(recipe, tmp_path))  # expand_timesteps in model_index.json: ti2v
    assert auto.model.task == "ti2v" and architecture(auto) == architecture(load_config(recipe))
    base = ["--config", str(recipe), f"run.output_dir={tmp_path / 'run'}", "--prompt", PROMPT]
    base += ["--frames", "9", "--height", "32", "--width", "96"]
    for out, extra, expected in (("i2v.npy", ["--image", str(image)], i2v), ("t2v.npy", [], t2v)):
        assert run_main(infer, base + extra + ["--output", str(tmp_path / out)]) == 0
        video = np.load(tmp_path / out)
        assert video.shape == expected.shape == (9, 32, 96, 3) and expected.std() > 0.05
        assert np.abs(video - expected).max() <= 1e-5, (out, np.abs(video - expected).max())
    assert np.abs(i2v - t2v).max() > 1e-3  # the image counts
    # PipeFusion 2, the one sampling layout run here: with a warm-up over every step it is exact (the
    # pipelined steps reuse stale activations). Ulysses 2 runs the per-token rows in the training below;
    # cfg, ulysses and ring sampling were measured once, not in the suite (docs/image_to_video.md).
    pipefusion = ["parallel.pipefusion=2", "parallel.pipefusion_warmup=3"]
    args = base + ["--image", str(image), "--output", str(tmp_path / "pipefusion.npy"), *pipefusion]
    result = ranks(2, "infer.py", *args, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.abs(np.load(tmp_path / "pipefusion.npy") - i2v).max() <= 1e-5
    # fine-tuning: the clip's first latent frame given at t = 0, the loss on the rest; ulysses 2 trains
    # one process's losses; the run exported with --pipeline samples in diffusers what infer.py samples
    train_args = ["--config", str(recipe), f"sample.images=[{image}]", "train.log_every=1"]
    train_args += ["data.frames=9", "data.height=32", "data.width=96"]
    from models.flow import RectifiedFlow

    seen, training_loss = [], RectifiedFlow.training_loss
    monkeypatch.setattr(
        RectifiedFlow,
        "training_loss",
        lambda *a, **k: seen.append(k.get("from_frame")) or training_loss(*a, **k),
    )
    assert run_main(train, train_args + [f"run.output_dir={tmp_path / 'one'}"]) == 0
    assert seen == [1, 1]  # the given first latent frame has no loss
    result = ranks(2, "train.py", *train_args, f"run.output_dir={tmp_path / 'two'}", "parallel.ulysses=2")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2} and all(b[s] == pytest.approx(a[s], rel=1e-4) for s in a), (a, b)
    exported = tmp_path / "exported"
    assert (
        export.main(
            ["--checkpoint", str(tmp_path / "two"), "--output", str(exported), "--pipeline", "--no-ema"]
        )
        == 0
    )
    tuned = WanPipeline.from_pretrained(exported)
    assert tuned.config.expand_timesteps
    tuned_i2v = WanImageToVideoPipeline(**{k: getattr(tuned, k) for k in parts}, expand_timesteps=True)
    for out, extra, reference in (
        ("tuned_t2v.npy", [], tuned),
        ("tuned_i2v.npy", ["--image", str(image)], tuned_i2v),
    ):
        extra = extra + ["--output", str(tmp_path / out), f"run.output_dir={tmp_path / 'two'}", "--no-ema"]
        assert run_main(infer, base[:2] + base[3:] + extra) == 0
        given = dict(image=Image.open(image)) if extra[0] == "--image" else {}
        expected = reference(generator=torch.Generator().manual_seed(0), **common, **given).frames[0]
        assert np.abs(np.load(tmp_path / out) - expected).max() <= 1e-4, out
    assert np.abs(expected - i2v).max() > 1e-3  # two steps of training show
