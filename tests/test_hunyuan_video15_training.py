"""train.py on HunyuanVideo 1.5 (models/hunyuan_video15/), text-to-video, against diffusers (code no one here
wrote): each step's loss is the flow-matching loss on the pipeline's own text encoding, VAE and transformer;
a full and a LoRA run train, preview and checkpoint; the LoRA exported in diffusers' names loads with the
transformer's load_lora_adapter (the pipeline has no load_lora_weights) and the full fine-tuning exported
with --pipeline samples in diffusers what infer.py samples from the run; precomputed latents train as the
videos do; under parallel.ulysses=2 each step's loss is one process's; a distilled student exported
samples in diffusers what infer.py samples."""

import json
import sys
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import infer
import train
from configs import load_config
from data.loader import encode_family_batch
from models.families import family_named
from models.flow import RectifiedFlow
from parallel.drive.family_training import FamilyRun, family_batch
from tests.conftest import ROOT, ranks, run_main
from tests.test_hunyuan_video15 import (  # noqa: F401 (fixtures)
    NEGATIVE,
    PROMPTS,
    SIZE,
    infer_args,
    saved,
    saved_i2v,
)

sys.path.insert(0, str(ROOT / "scripts"))
import export  # noqa: E402

CAPTIONS = ['a sign reading "open" on a red door', "a dog"]  # a glyph text in one, none in the other


def train_args(folder, run, *extra) -> list:
    """Five frames at 24 x 40 (3 x 6 x 10 latents: 180 tokens), synthetic clips, 2 per batch."""
    argv = infer_args(folder, run.parent, "--frames")  # the recipe and the folder; no sizes
    return [
        *argv[: argv.index("--frames")],
        f"run.output_dir={run}",
        "data.manifest=null",
        "data.resolutions=[]",
        "data.aspect_ratios=[]",
        "data.frame_counts=[]",
        "data.frames=5",
        "data.height=24",
        "data.width=40",
        "data.synthetic_samples=8",
        "data.num_workers=0",
        "train.batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.lr=1e-3",
        "train.ema_decay=0",  # the EMA the raw weights: exports show what the steps changed
        "train.log_every=1",
        "train.checkpoint_every=1",
        "sample.steps=2",
        "sample.guidance=4",
        "sample.frames=5",
        "sample.height=24",
        "sample.width=40",
        "sample.prompts=[a red door]",
        "logging.wandb=false",
        "parallel.timeout_s=60",
        *extra,
    ]


def metrics(run) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_py_loss(folder, image=None) -> tuple:
    """(videos, their latents, noise, sigmas, train.py's loss, the loss without an image condition) of two
    random 5-frame clips at 24 x 40 from `folder`, the second caption dropped: encode_family_batch,
    family_batch and the family's objective.loss (the flow's, on its velocity), at sigmas 0.3 and 0.85.
    `image`: (2, 3, 24, 40) uint8, the frames a manifest names (the batch's "image")."""
    family = family_named("hunyuan_video15")
    argv = train_args(folder, folder.parent / "unused")
    cfg = load_config(ROOT / "configs" / "hunyuanvideo-1.5-480p.yaml", argv[2:])
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (2, 3, 5, 24, 40), generator=generator, dtype=torch.uint8)
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    batch = {"caption": CAPTIONS, "video": video, **({"image": image} if image is not None else {})}
    encoded = encode_family_batch(run, batch, [False, True], "cpu")
    x0, cond = family_batch(run, SimpleNamespace(sp_size=1), encoded, "cpu")
    noise, sigma = torch.randn(x0.shape, generator=generator), torch.tensor([0.3, 0.85])
    loss = partial(family.objective.loss, parts, RectifiedFlow(cfg.flow, (1, 1, 1)), parts.transformer, x0)
    plain = loss(replace(cond, image=None, image_latents=None), noise, sigma)
    return video, x0, noise, sigma, loss(cond, noise, sigma), plain


@torch.no_grad()
def test_the_loss_is_diffusers(saved):  # noqa: F811
    """Two 5-frame clips, the second caption dropped (the empty prompt), two noise levels: train.py's loss
    (encode_family_batch, family_batch, the family's objective.loss: the flow's on its velocity) is the loss
    on the pipeline's encode_prompt, its VAE (the posterior's mode, scaled) and its transformer told the
    zero condition of text-to-video."""
    from diffusers import DiffusionPipeline

    video, x0, noise, sigma, ours, _ = train_py_loss(saved)

    pipe = DiffusionPipeline.from_pretrained(saved)
    text, text_mask, glyph, glyph_mask = pipe.encode_prompt([CAPTIONS[0], ""], device="cpu", batch_size=2)
    vae = pipe.vae
    # one clip at a time: diffusers' VAE attention mask does not broadcast over a batch (0.42)
    z = [vae.encode(v[None].float() / 127.5 - 1).latent_dist.mode() for v in video]
    want_x0 = torch.cat(z) * vae.config.scaling_factor
    s = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * want_x0 + s * noise
    given = torch.zeros(2, x_t.shape[1] + 1, *x_t.shape[2:])  # text-to-video's condition latents and mask
    pred = pipe.transformer(
        hidden_states=torch.cat([x_t, given], dim=1),
        timestep=sigma * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=torch.zeros(2, 3, pipe.transformer.config.image_embed_dim),
        return_dict=False,
    )[0]
    want = torch.nn.functional.mse_loss(pred, noise - want_x0)
    print(f"train.py's loss {ours.item():.6f}, diffusers' {want.item():.6f}", file=sys.__stderr__)
    assert float((x0 - want_x0).abs().max()) <= 1e-5
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()


@torch.no_grad()
def test_the_image_to_video_loss_is_diffusers(saved_i2v):  # noqa: F811
    """From the image-to-video folder, each clip's own first frame given: train.py's loss is the loss on
    HunyuanVideo15ImageToVideoPipeline's parts, its prepare_cond_latents_and_mask (the frame's latents and
    mask beside the noise) and encode_image (SigLIP) on the clip's first frame, every frame noised and in
    the loss (as the release's trainer has it); without the frame it is not."""
    video, _, noise, sigma, ours, plain = train_py_loss(saved_i2v)
    want = diffusers_i2v_loss(saved_i2v, video, [clip[:, 0] for clip in video], noise, sigma)
    print(
        f"image-to-video: train.py's loss {ours.item():.6f}, diffusers' {want.item():.6f}; without the "
        f"frame {plain.item():.6f}",
        file=sys.__stderr__,
    )
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()
    assert abs(plain.item() - want.item()) > 1e-3


@pytest.mark.slow
@torch.no_grad()
def test_a_manifest_frame_is_the_image_to_video_condition(saved_i2v):  # noqa: F811
    """A manifest line's "image" replaces its clip's first frame as HunyuanVideo15ImageToVideoPipeline's
    image (as tessera's DiT takes it): the loss is diffusers' with those frames, not the clips' own."""
    image = torch.randint(
        0, 256, (2, 3, 24, 40), generator=torch.Generator().manual_seed(7), dtype=torch.uint8
    )
    video, _, noise, sigma, ours, _ = train_py_loss(saved_i2v, image)
    want = diffusers_i2v_loss(saved_i2v, video, list(image), noise, sigma)
    own = diffusers_i2v_loss(saved_i2v, video, [clip[:, 0] for clip in video], noise, sigma)
    assert abs(ours.item() - want.item()) <= 1e-5 * want.item() and abs(own.item() - want.item()) > 1e-4


def diffusers_i2v_loss(folder, video, frames, noise, sigma):
    """The loss on HunyuanVideo15ImageToVideoPipeline's parts of `video` (B, 3, T, H, W) uint8 at `sigma`,
    each clip given its frame of `frames` ((3, H, W) uint8) as the pipeline's image."""
    from diffusers import DiffusionPipeline
    from PIL import Image

    pipe = DiffusionPipeline.from_pretrained(folder)
    text, text_mask, glyph, glyph_mask = pipe.encode_prompt([CAPTIONS[0], ""], device="cpu", batch_size=2)
    z = [pipe.vae.encode(v[None].float() / 127.5 - 1).latent_dist.mode() for v in video]
    want_x0 = torch.cat(z) * pipe.vae.config.scaling_factor
    x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * want_x0 + sigma.view(-1, 1, 1, 1, 1) * noise
    given, embeds = [], []
    for frame, latents in zip(frames, x_t):
        image = Image.fromarray(frame.permute(1, 2, 0).numpy())
        condition, mask = pipe.prepare_cond_latents_and_mask(
            latents[None], image, 1, 24, 40, torch.float32, "cpu"
        )
        given.append(torch.cat([condition, mask], dim=1))
        embeds.append(pipe.encode_image(image, 1, "cpu", torch.float32))
    pred = pipe.transformer(
        hidden_states=torch.cat([x_t, torch.cat(given)], dim=1),
        timestep=sigma * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=torch.cat(embeds),
        return_dict=False,
    )[0]
    return torch.nn.functional.mse_loss(pred, noise - want_x0)


KINDS = {"full": [], "lora": ["lora.rank=4", "train.lr=1e-2"]}


@pytest.fixture(scope="module")
def runs(saved, tmp_path_factory):  # noqa: F811
    """{"full": a 2-step full fine-tuning's run, "lora": a 2-step LoRA run (the family's targets)}."""
    root = tmp_path_factory.mktemp("hunyuan_video15-runs")
    for kind, extra in KINDS.items():
        assert run_main(train, train_args(saved, root / kind, *extra)) == 0
    return {kind: root / kind for kind in KINDS}


def test_runs_train_and_preview(runs):
    """Both runs log two positive losses, write a preview video and checkpoint; the LoRA trained the
    family's own layers only (lora.targets unset)."""
    for run in runs.values():
        assert [m["step"] for m in metrics(run)] == [1, 2] and all(m["loss"] > 0 for m in metrics(run))
        assert (run / "samples" / "step_2_0.mp4").stat().st_size > 0
        assert (run / "checkpoints" / "step_2" / "checksums.json").is_file()
    state = torch.load(runs["lora"] / "checkpoints" / "step_2" / "trainer_rank0.pt", weights_only=False)
    record = state["lora"]
    assert record["targets"] == list(family_named("hunyuan_video15").lora_targets)
    assert {"blocks.0.attn.to_q", "blocks.1.ff_context.net.2"} <= set(record["modules"])
    assert not any(m.startswith("context_embedder") for m in record["modules"])


def pipeline_video(pipe) -> np.ndarray:
    from diffusers.guiders import ClassifierFreeGuidance

    pipe.guider = ClassifierFreeGuidance(guidance_scale=4.0)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(1)
    return pipe(
        prompt=PROMPTS[0],
        negative_prompt=NEGATIVE,
        num_inference_steps=2,
        **SIZE,
        generator=generator,
        output_type="np",
    ).frames[0]


def infer_video(folder, tmp_path, out, *extra) -> np.ndarray:
    argv = infer_args(folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", NEGATIVE, "--steps", "2")
    argv += ["--guidance", "4", "--seed", "1", "--output", str(tmp_path / out), *extra]
    assert run_main(infer, argv) == 0
    return np.load(tmp_path / out)


@torch.no_grad()
def test_exports_load_in_diffusers(saved, runs, tmp_path):  # noqa: F811
    """The LoRA run exported (diffusers' names) loads with the transformer's load_lora_adapter and gives the
    video infer.py --lora gives with the file and infer.py --checkpoint with the run; the full fine-tuning
    exported with --pipeline samples in diffusers what infer.py --checkpoint samples."""
    from diffusers import DiffusionPipeline

    base = pipeline_video(DiffusionPipeline.from_pretrained(saved))
    lora = tmp_path / "lora.safetensors"
    assert export.main(["--checkpoint", str(runs["lora"]), "--lora", "--output", str(lora)]) == 0
    pipe = DiffusionPipeline.from_pretrained(saved)
    pipe.transformer.load_lora_adapter(str(lora), prefix="transformer")
    want = pipeline_video(pipe)
    got = [
        infer_video(saved, tmp_path, "file.npy", "--lora", str(lora)),
        infer_video(saved, tmp_path, "run.npy", "--checkpoint", str(runs["lora"])),
    ]
    diffs, changed = [float(np.abs(g - want).max()) for g in got], float(np.abs(want - base).max())
    print(
        f"LoRA: diffusers vs infer.py --lora, --checkpoint {diffs[0]:.1e}, {diffs[1]:.1e}; base {changed:.1e}"
    )
    assert max(diffs) <= 1e-4 and changed > 1e-3

    exported = tmp_path / "pipeline"
    assert export.main(["--checkpoint", str(runs["full"]), "--pipeline", "--output", str(exported)]) == 0
    want = pipeline_video(DiffusionPipeline.from_pretrained(exported))
    got = infer_video(saved, tmp_path, "full.npy", "--checkpoint", str(runs["full"]))
    diff, changed = float(np.abs(got - want).max()), float(np.abs(want - base).max())
    print(f"full: diffusers on the export vs infer.py --checkpoint {diff:.2e}; the base {changed:.2e}")
    assert diff <= 1e-5 and changed > 1e-3


def test_image_to_video_lora_trains_and_loads_in_diffusers(saved_i2v, tmp_path):  # noqa: F811
    """A 2-step LoRA run from the image-to-video folder (each clip's first frame given; sample.images
    previews from an image): exported in diffusers' names, the i2v pipeline's transformer takes it with
    load_lora_adapter and samples from an image what infer.py --checkpoint --image samples; without
    sample.images the run is refused by name. Precomputed latents (the first frames' too) train alike."""
    from diffusers import DiffusionPipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from PIL import Image

    from tests.test_hunyuan_video15 import first_frame

    image, run = first_frame(tmp_path), tmp_path / "run"
    argv = train_args(saved_i2v, run, *KINDS["lora"])
    assert run_main(train, argv) != 0  # sample.images unset: refused before anything starts
    assert not (run / "checkpoints").exists()
    assert run_main(train, [*argv, f"sample.images=[{image}]"]) == 0
    assert (run / "samples" / "step_2_0.mp4").stat().st_size > 0
    lora = tmp_path / "lora.safetensors"
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(lora)]) == 0

    def sample(pipe) -> np.ndarray:
        pipe.guider = ClassifierFreeGuidance(guidance_scale=4.0)
        pipe.set_progress_bar_config(disable=True)
        args = dict(prompt=PROMPTS[0], negative_prompt=NEGATIVE, num_inference_steps=2, num_frames=5)
        out = pipe(
            **args, image=Image.open(image), generator=torch.Generator().manual_seed(1), output_type="np"
        )
        return out.frames[0]

    base = sample(DiffusionPipeline.from_pretrained(saved_i2v))
    pipe = DiffusionPipeline.from_pretrained(saved_i2v)
    pipe.transformer.load_lora_adapter(str(lora), prefix="transformer")
    want = sample(pipe)
    got = infer_video(saved_i2v, tmp_path, "i2v.npy", "--checkpoint", str(run), "--image", str(image))
    diff, changed = float(np.abs(got - want).max()), float(np.abs(want - base).max())
    print(
        f"image-to-video LoRA: diffusers vs infer.py --checkpoint --image {diff:.1e}; the base {changed:.1e}"
    )
    assert got.shape == want.shape and diff <= 1e-4 and changed > 1e-3

    import precompute_latents  # the first frames' latents, mask and SigLIP tokens stored with the texts

    latents, stored = tmp_path / "latents", tmp_path / "stored"
    given = [*argv, f"sample.images=[{image}]"]
    assert run_main(precompute_latents, [*given, "--out", str(latents)]) == 0
    assert run_main(train, [*given, f"data.latents={latents}", f"run.output_dir={stored}"]) == 0
    keys = ("loss", "grad_norm")
    pairs = [(a[k], b[k]) for a, b in zip(metrics(run), metrics(stored), strict=True) for k in keys]
    assert max(abs(b - a) / abs(a) for a, b in pairs) <= 1e-6, pairs


def test_precomputed_latents_train_as_the_videos_do(saved, runs, tmp_path):  # noqa: F811
    """scripts/precompute_latents.py stores each clip's latents and both texts' real tokens (a caption
    without quoted text has no glyph tokens); training on them takes the full run's steps."""
    import precompute_latents

    latents = tmp_path / "latents"
    argv = train_args(saved, tmp_path / "unused")
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    assert (latents / "empty.safetensors").is_file() and len(list((latents / "latents").iterdir())) == 8
    stored = tmp_path / "stored"
    assert run_main(train, train_args(saved, stored, f"data.latents={latents}")) == 0
    pairs = [
        (a[k], b[k])
        for a, b in zip(metrics(runs["full"]), metrics(stored), strict=True)
        for k in ("loss", "grad_norm")
    ]
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(f"on latents vs on videos, largest relative difference {worst:.1e}", file=sys.__stderr__)
    assert worst <= 1e-6, pairs


@pytest.mark.slow
def test_ulysses_training_is_one_process(saved, runs, tmp_path):  # noqa: F811
    """Two processes sharing each clip's 180 tokens by heads (parallel.ulysses=2): every step's loss and
    gradient norm are the one-process run's."""
    two = tmp_path / "two"
    done = ranks(2, "train.py", *train_args(saved, two, "parallel.ulysses=2"), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    pairs = [
        (a[k], b[k])
        for a, b in zip(metrics(runs["full"]), metrics(two), strict=True)
        for k in ("loss", "grad_norm")
    ]
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(f"ulysses 2: losses and gradient norms within {worst:.1e} (relative) of one process's")
    assert worst <= 1e-5, pairs


@pytest.mark.slow  # a run, an export and three samplings
def test_a_distilled_student_samples_in_diffusers_what_infer_samples(saved, tmp_path):  # noqa: F811
    """train.objective=dmd, 2 steps of a 2-step student (its turn and the critic's at both): the exported
    LoRA, on the transformer in the pipeline at 2 steps with its guider at scale 1 (no guidance), samples
    what infer.py --checkpoint samples from the run (which takes the student's steps and drops guidance by
    itself)."""
    from diffusers import DiffusionPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    run, lora = tmp_path / "student", tmp_path / "student.safetensors"
    dmd = ["train.objective=dmd", "lora.rank=4", "distill.steps=2", "distill.critic_updates=1"]
    dmd += ["train.lr=1e-2"]
    assert run_main(train, train_args(saved, run, *dmd)) == 0
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(lora)]) == 0
    argv = infer_args(saved, tmp_path, "--prompt", PROMPTS[0], "--seed", "1", "--checkpoint", str(run))
    assert run_main(infer, [*argv, "--output", str(tmp_path / "ours.npy")]) == 0
    ours = np.load(tmp_path / "ours.npy")  # one video: (frames, height, width, 3)
    pipe = DiffusionPipeline.from_pretrained(saved)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    pipe.set_progress_bar_config(disable=True)
    sample = lambda: pipe(  # noqa: E731
        prompt=PROMPTS[0], num_inference_steps=2, **SIZE, generator=torch.Generator().manual_seed(1),
        output_type="np",
    ).frames[0]  # fmt: skip
    with torch.no_grad():
        base = sample()
        pipe.transformer.load_lora_adapter(str(lora), prefix="transformer")
        theirs = sample()
    diff, moved = float(np.abs(theirs - ours).max()), float(np.abs(base - ours).max())
    print(f"HunyuanVideo 1.5 student: diffusers vs infer.py {diff:.1e}; the base at its steps {moved:.1e}")
    assert diff <= 1e-5 and moved > 100 * diff
