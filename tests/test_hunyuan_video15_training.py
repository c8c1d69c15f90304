"""train.py on HunyuanVideo 1.5's image-to-video folders (models/hunyuan_video15/) against diffusers (code no
one here wrote): each step's loss is the loss on HunyuanVideo15ImageToVideoPipeline's parts with the clip's
first frame (or a manifest's image) given; a LoRA run exported loads in that pipeline and samples from an
image what infer.py samples; precomputed latents train alike. Its text-to-video training is a row of
tests/test_family_training.py."""

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
from tests.conftest import ROOT, run_main
from tests.test_hunyuan_video15 import (  # noqa: F401 (fixtures)
    NEGATIVE,
    PROMPTS,
    infer_args,
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


def infer_video(folder, tmp_path, out, *extra) -> np.ndarray:
    argv = infer_args(folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", NEGATIVE, "--steps", "2")
    argv += ["--guidance", "4", "--seed", "1", "--output", str(tmp_path / out), *extra]
    assert run_main(infer, argv) == 0
    return np.load(tmp_path / out)


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
