"""train.py on every family that trains from its pipeline's folder alone (a row of tests/test_families.py's
ROWS): the loss each step computes is the flow-matching loss diffusers' training scripts compute with the
pipeline's own text encoding, VAE and transformer (code no one here wrote); a run trains, previews,
checkpoints and resumes (full and LoRA); and under parallel.ulysses=2 and parallel.ring=2 (an image's token
count no degree divides) each step's loss and gradient norm are one process's."""

import inspect
import json
import sys
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
from models.lora import DEFAULT_TARGETS
from parallel.drive.family_training import FamilyRun, family_batch
from tests.conftest import ROOT, ranks, run_main
from tests.test_families import ROWS, cached_and_uncached, infer_args, negative, pipeline_image, saved_folder
from tests.test_sana import MAX_LENGTH

sys.path.insert(0, str(ROOT / "scripts"))
import export  # noqa: E402

# every row but LTX-2's, whose clips carry sound the rows' synthetic clips do not: its training against
# diffusers, sound and video, is tests/test_ltx2_training.py's (the image-to-video folders': the DiT's
# tests/test_image_to_video.py, HunyuanVideo 1.5's tests/test_hunyuan_video15_training.py)
VIDEO_ROWS = ("dit", "hunyuan_video15")  # the video rows whose loss against the pipeline is written here
TRAINED = [name for name in ROWS if ROWS[name].frames == 1 or name in VIDEO_ROWS]


@pytest.fixture(scope="module", params=TRAINED)
def saved(request, tmp_path_factory):
    """(family, its tiny pipeline saved as a diffusers folder), for the families that train."""
    return saved_folder(request.param, tmp_path_factory)


# height, width: an image's 3 x 5 tokens, which neither degree 2 divides (Z-Image pads them to 32); the
# video rows' clips are their rows' frames (the DiT's 2 x 3 x 5 tokens, HunyuanVideo 1.5's 3 x 6 x 10)
TRAIN_SIZE = dict(qwen_image=(48, 80), sana=(96, 160), z_image=(24, 40), flux2=(24, 40), flux2_dev=(24, 40),
                  dit=(48, 80), hunyuan_video15=(24, 40))  # fmt: skip
CAPTIONS = ["a red square on a white wall", "a dog"]
# HunyuanVideo 1.5's: a quoted glyph text in one (its ByT5 encoder's), none in the other
ROW_CAPTIONS = dict(hunyuan_video15=['a sign reading "open" on a red door', "a dog"])


def family_overrides(name, folder) -> list:
    return [
        "model.size=auto",
        f"model.pretrained={folder}",
        f"vae.pretrained={folder}",
        f"text_encoder.pretrained={folder}",
        f"text_encoder.max_length={ROWS[name].max_length}",
        *(["train.guidance=null"] if name == "flux2_dev" else []),  # its family's default, diffusers' 3.5
    ]


def train_args(name, folder, run, *extra) -> list:
    height, width = TRAIN_SIZE[name]
    return [
        "--config",
        str(ROOT / "configs" / ROWS[name].recipe),
        *family_overrides(name, folder),
        "data.manifest=null",  # the synthetic images, one bucket
        "data.resolutions=[]",
        "data.aspect_ratios=[]",
        "data.frame_counts=[]",
        f"data.frames={ROWS[name].frames}",
        f"data.height={height}",
        f"data.width={width}",
        "data.synthetic_samples=8",
        "data.num_workers=0",
        "train.batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.lr=1e-3",
        "train.log_every=1",
        "train.checkpoint_every=1",
        "sample.steps=2",
        "sample.height=null",
        "sample.width=null",
        "sample.prompts=[a red square]",
        "train.compile=false",  # the DiT's recipes compile (a minute cold here): the steps are compared
        "data.tokens_per_batch=0",  # train.batch_size clips a batch (the DiT's recipes fill a token budget)
        "parallel.auto=false",  # the degrees each test gives (the DiT's recipes choose them)
        "logging.wandb=false",
        "parallel.timeout_s=60",
        f"run.output_dir={run}",
        *extra,
    ]


def metrics(run) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def diffusers_loss(name, pipe, pixels, prompts, noise, sigma) -> torch.Tensor:
    """The loss of diffusers' train_dreambooth_lora_{qwen_image,sana}.py for these pixels, prompts, noise and
    noise levels: the pipeline's encode_prompt, its VAE with the scripts' normalisation, its transformer.
    Z-Image, which diffusers has no script for: musubi-tuner's, the pipeline's pieces (its latents
    (z - shift) x scale, the model told 1 - sigma, its output negated) on the velocity."""
    s = sigma.view(-1, 1, 1, 1, 1)
    if name in VIDEO_LOSSES:
        return VIDEO_LOSSES[name](pipe, pixels, prompts, noise, s)
    if name.startswith("flux2"):  # klein: the pipeline's pieces on the velocity (diffusers has no script);
        # dev: train_dreambooth_lora_flux2.py's, the transformer given its --guidance_scale's default, 3.5
        embeds, text_ids = pipe.encode_prompt(list(prompts))
        guidance = torch.full((len(prompts),), 3.5) if name == "flux2_dev" else None
        x0 = pipe._encode_vae_image(pixels[:, :, 0], None)  # packed 2 x 2, batch-norm normalised
        x_t = (1 - s[:, :, 0]) * x0 + s[:, :, 0] * noise[:, :, 0]
        B, C, h, w = x0.shape
        pred = pipe.transformer(
            hidden_states=pipe._pack_latents(x_t), encoder_hidden_states=embeds, timestep=sigma,
            img_ids=pipe._prepare_latent_ids(x_t), txt_ids=text_ids, guidance=guidance, return_dict=False,
        )[0]  # fmt: skip
        pred = pred.transpose(1, 2).reshape(B, C, 1, h, w)
        x0 = x0.unsqueeze(2)
    elif name == "z_image":
        embeds = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False)[0]
        vae = pipe.vae.config
        x0 = (pipe.vae.encode(pixels[:, :, 0]).latent_dist.mode() - vae.shift_factor) * vae.scaling_factor
        x0 = x0.unsqueeze(2)
        x_t = (1 - s) * x0 + s * noise
        pred = -torch.stack(pipe.transformer(list(x_t.unbind(0)), 1 - sigma, embeds, return_dict=False)[0])
    elif name == "qwen_image":
        embeds, mask = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=512)
        vae = pipe.vae.config
        z = pipe.vae.encode(pixels).latent_dist.mode()
        mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (vae.latents_mean, vae.latents_std))
        x0 = (z - mean) * (1.0 / std)
        x_t = (1 - s) * x0 + s * noise
        B, C, _, h, w = x0.shape
        pred = pipe.transformer(
            hidden_states=pipe._pack_latents(x_t[:, :, 0], B, C, h, w),
            timestep=sigma,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=[[(1, h // 2, w // 2)]] * B,
            return_dict=False,
        )[0]
        pred = pipe._unpack_latents(pred, *pixels.shape[-2:], pipe.vae_scale_factor)
    else:
        instruction = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
        embeds, mask, _, _ = pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_LENGTH,
            complex_human_instruction=instruction,
        )
        x0 = (pipe.vae.encode(pixels[:, :, 0]).latent * pipe.vae.config.scaling_factor).unsqueeze(2)
        x_t = (1 - s) * x0 + s * noise
        pred = pipe.transformer(
            x_t[:, :, 0], encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=sigma * 1000
        )[0].unsqueeze(2)
    return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())


def wan_loss(pipe, pixels, prompts, noise, s) -> torch.Tensor:
    """Wan's (diffusers has no training script): the pipeline's pieces (its T5 encoding, its VAE's posterior
    mode normalised by latents_mean and latents_std, its transformer told 1000 sigma) on the velocity."""
    length = ROWS["dit"].max_length
    embeds = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=length)
    embeds = embeds[0]
    vae = pipe.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (vae.latents_mean, vae.latents_std))
    x0 = (pipe.vae.encode(pixels).latent_dist.mode() - mean) / std
    x_t = (1 - s) * x0 + s * noise
    pred = pipe.transformer(x_t, s.flatten() * 1000, embeds, return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())


def hunyuan_video15_loss(pipe, pixels, prompts, noise, s) -> torch.Tensor:
    """HunyuanVideo 1.5's (diffusers has no training script): the pipeline's encode_prompt (both texts), its
    VAE (the posterior's mode, scaled), its transformer told text-to-video's zero condition; the velocity."""
    text, text_mask, glyph, glyph_mask = pipe.encode_prompt(list(prompts), device="cpu", batch_size=len(s))
    # one clip at a time: diffusers' VAE attention mask does not broadcast over a batch (0.42)
    z = torch.cat([pipe.vae.encode(v[None]).latent_dist.mode() for v in pixels])
    x0 = z * pipe.vae.config.scaling_factor
    x_t = (1 - s) * x0 + s * noise
    given = torch.zeros(len(x0), x_t.shape[1] + 1, *x_t.shape[2:])  # the condition latents and their mask
    pred = pipe.transformer(
        hidden_states=torch.cat([x_t, given], dim=1),
        timestep=s.flatten() * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=torch.zeros(len(x0), 3, pipe.transformer.config.image_embed_dim),
        return_dict=False,
    )[0]
    return torch.nn.functional.mse_loss(pred, noise - x0)


VIDEO_LOSSES = dict(dit=wan_loss, hunyuan_video15=hunyuan_video15_loss)


def trained_parts(family, cfg):
    """The family's parts in float32 with model.pretrained's transformer, as train.py starts from them: a
    family whose weights are not a folder's tensors as they are (the DiT's, from a Wan folder's) filled as
    parallel/build fills it."""
    from dataclasses import replace

    from parallel.build.components import fill_unsharded, open_pretrained

    if family.loading.from_pretrained:
        return family.load(cfg, torch.device("cpu"), torch.float32)
    model = family.meta_transformer(cfg)
    fill_unsharded(model, cfg.train.seed, open_pretrained(cfg, model))
    parts = family.load(cfg, torch.device("cpu"), torch.float32, transformer=False)
    return replace(parts, transformer=model.eval())


@torch.no_grad()
def test_the_loss_is_diffusers(saved):
    """Two images (clips), one caption dropped (the empty prompt), two noise levels: the loss train.py's step
    computes (encode_family_batch, family_batch, the family's objective.loss on its velocity) is
    the loss of diffusers' training scripts on the pipeline's own parts."""
    from diffusers import DiffusionPipeline

    name, folder = saved
    family = family_named(name)
    cfg = load_config(ROOT / "configs" / ROWS[name].recipe, family_overrides(name, folder))
    parts = trained_parts(family, cfg)
    height, width = TRAIN_SIZE[name]
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, ROWS[name].frames, height, width)
    video = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    captions = ROW_CAPTIONS.get(name, CAPTIONS)
    encoded = encode_family_batch(run, {"caption": captions, "video": video}, [False, True], "cpu")
    x0, cond = family_batch(run, SimpleNamespace(sp_size=1), encoded, "cpu")
    noise = torch.randn(x0.shape, generator=generator)
    sigma = torch.tensor([0.3, 0.85])
    flow = RectifiedFlow(cfg.flow, (1, 1, 1))
    ours = family.objective.loss(parts, flow, parts.transformer, x0, cond, noise, sigma)
    pipe = DiffusionPipeline.from_pretrained(folder)
    want = diffusers_loss(name, pipe, video.float() / 127.5 - 1, [captions[0], ""], noise, sigma)
    diff = abs(ours - want).item()
    print(
        f"{name}: train.py's loss {ours.item():.6f}, diffusers' {want.item():.6f}: {diff:.1e}",
        file=sys.__stderr__,
    )
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()


@pytest.fixture(scope="module")
def runs(saved, tmp_path_factory):
    """(family, folder, {"full": a 3-step full fine-tuning's run, "lora": a 3-step LoRA run}), the EMA the
    raw weights (train.ema_decay=0), so that exports and samples show what the steps changed."""
    name, folder = saved
    root = tmp_path_factory.mktemp(f"{name}-runs")
    for kind, extra in KINDS.items():
        assert run_main(train, train_args(name, folder, root / kind, *extra)) == 0
    return name, folder, {kind: root / kind for kind in KINDS}


KINDS = {  # full fine-tuning and LoRA (the family's own layers); 3 steps; the EMA the raw weights
    "full": ["train.max_steps=3", "train.ema_decay=0"],
    "lora": ["train.max_steps=3", "train.ema_decay=0", "lora.rank=4", "train.lr=1e-2"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_trains_and_resumes(runs, tmp_path, capsys, kind):
    """A run trains, previews and checkpoints each step; stopped after step 1, the same command with
    max_steps=3 resumes, and its third step's loss is the straight run's: the second step's update took
    the resumed AdamW state (Qwen-Image's last text layers have none until then)."""
    name, folder, made = runs
    straight = metrics(made[kind])
    assert [m["step"] for m in straight] == [1, 2, 3] and all(m["loss"] > 0 for m in straight)
    assert (made[kind] / "samples" / "step_3_0.mp4").stat().st_size > 0
    assert f"family: {name}" in (made[kind] / "config.yaml").read_text()
    resumed = tmp_path / "resumed"
    assert run_main(train, train_args(name, folder, resumed, *KINDS[kind][1:], "train.max_steps=1")) == 0
    capsys.readouterr()
    assert run_main(train, train_args(name, folder, resumed, *KINDS[kind])) == 0
    assert f"resumed from {resumed / 'checkpoints' / 'step_1'} at step 1" in capsys.readouterr().out
    assert all((resumed / "checkpoints" / f"step_{n}" / "checksums.json").is_file() for n in (2, 3))
    got = metrics(resumed)
    assert [m["step"] for m in got] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        assert got[-1][key] == pytest.approx(straight[-1][key], rel=1e-6), key
    if kind == "lora":
        state = torch.load(resumed / "checkpoints" / "step_3" / "trainer_rank0.pt", weights_only=False)
        record = state["lora"]  # the family's own layers, as resolve_family chose (lora.targets unset)
        targets = list(family_named(name).lora_targets or DEFAULT_TARGETS)  # the DiT's: the schema's
        assert record["rank"] == 4 and record["targets"] == targets
        layers = dict(sana="blocks.0.attn1.to_q", z_image="blocks.0.attention.to_q", dit="blocks.0.attn.qkv")
        layer = layers.get(name, "blocks.0.attn.to_q")  # Qwen-Image's and FLUX.2's
        assert layer in record["modules"]
        assert got[-1]["loss"] != metrics(made["full"])[-1]["loss"]  # the adapters alone trained


def test_lora_on_a_float8_base_trains_within_the_tolerance(runs, tmp_path):
    """model.base_dtype=float8 (models/float8.py) on the family's transformer: the same three LoRA steps
    (previews and checkpoints included) as on the full-precision base, each loss within tests/test_float8.py's
    tolerance of that run's and not equal to it (the base is float8)."""
    from tests.test_float8 import TOLERANCE

    name, folder, made = runs
    run = tmp_path / "float8"
    assert run_main(train, train_args(name, folder, run, *KINDS["lora"], "model.base_dtype=float8")) == 0
    full, ours = ({m["step"]: m["loss"] for m in metrics(r)} for r in (made["lora"], run))
    assert full.keys() == ours.keys() == {1, 2, 3}
    assert all(0 < abs(ours[s] - full[s]) <= TOLERANCE * full[s] for s in full), (full, ours)
    print(f"{name}: float8 base {ours}, full {full}", file=sys.__stderr__)


def test_precomputed_latents_train_as_the_images_do(saved, tmp_path, monkeypatch):
    """scripts/precompute_latents.py encodes the images and captions (and the empty prompt) once; training
    on them (the text encoder freed once the previews' prompts are encoded) takes the steps training on
    the images takes: the same losses and gradient norms, half the captions dropped."""
    import precompute_latents

    name, folder = saved
    extra = ["train.text_dropout=0.5", "train.max_steps=2"]
    latents = tmp_path / "latents"
    argv = train_args(name, folder, tmp_path / "media", *extra)
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    assert (latents / "empty.safetensors").is_file() and len(list((latents / "latents").iterdir())) == 8
    assert run_main(train, argv) == 0
    seen, encode = [], train.encode_family_batch

    def spy(run, batch, dropped, device):  # what each step of the run on latents read, and dropped
        seen.append(("stored" in batch, run.parts.text_encoder is None, sum(dropped)))
        return encode(run, batch, dropped, device)

    monkeypatch.setattr(train, "encode_family_batch", spy)
    family, loaded = family_named(name), []
    load = type(family).load
    monkeypatch.setattr(
        type(family), "load", lambda self, *a, **k: loaded.append(k.get("texts", True)) or load(self, *a, **k)
    )
    stored_run = tmp_path / "stored"
    assert run_main(train, train_args(name, folder, stored_run, *extra, f"data.latents={latents}")) == 0
    assert len(seen) == 2 and all(s[0] and s[1] for s in seen) and sum(s[2] for s in seen) >= 1, seen
    assert loaded == [False], loaded  # the previews' conditionings stored too: no text encoder read at all
    check_stored_previews(name, argv, latents)
    media, stored = metrics(tmp_path / "media"), metrics(stored_run)
    assert [m["step"] for m in stored] == [1, 2] and (stored_run / "samples" / "step_2_0.mp4").is_file()
    worst = max(abs(b[k] - a[k]) / abs(a[k]) for a, b in zip(media, stored) for k in ("loss", "grad_norm"))
    print(f"{name}: on latents vs on images, largest relative difference {worst:.1e}", file=sys.__stderr__)
    # the VAE encodes a batch on images, one image at a time for the latents: float32 rounding, which the
    # tiny Z-Image's random modulations magnify more (4e-7 here alone, 2e-6 beside another test process)
    assert worst <= (1e-5 if name == "z_image" else 1e-6)


@torch.no_grad()
def check_stored_previews(name, argv, latents):
    """The previews' conditionings precompute_latents.py stored (for the recipe `argv`) are those training
    would encode itself; a recipe with other previews finds none."""
    from dataclasses import fields

    from parallel.drive.family_training import preview_references
    from parallel.drive.stored_previews import PREVIEWS, preview_identity, preview_sampling, read_previews

    family, cfg = family_named(name), load_config(argv[1], argv[2:])
    sampling = preview_sampling(cfg, family, preview_references(cfg, family))
    identity = preview_identity(cfg, family, sampling, torch.float32)
    stored = read_previews(latents / PREVIEWS, family, identity, "cpu")
    parts = family.load(cfg, torch.device("cpu"), torch.float32, transformer=False)
    fresh = family.conditionings(parts, sampling)
    bare = family.load(cfg, torch.device("cpu"), torch.float32, transformer=False, texts=False)
    assert bare.text_encoder is None  # what training on the latents loads
    assert stored is not None and (stored[1] is None) == (fresh[1] is None)
    for ours, theirs in zip(stored, fresh):
        for f in fields(theirs) if theirs is not None else ():
            a, b = getattr(ours, f.name), getattr(theirs, f.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, f.name
    other = {**identity, "prompts": ["another prompt"]}
    assert read_previews(latents / PREVIEWS, family, other, "cpu") is None


def test_buckets_by_aspect_ratio(saved, tmp_path):
    """Buckets of two sizes and three aspect ratios (a video row's at its frame count), each side a multiple
    of the family's VAE stride times its patch: the run trains on more than one of them, each a latent the
    transformer takes."""
    name, folder = saved
    side = TRAIN_SIZE[name][0]
    buckets = [f"data.resolutions=[{side},{2 * side}]", "data.aspect_ratios=['1:1','16:9','9:16']"]
    run = tmp_path / "run"
    frames = ROWS[name].frames
    argv = train_args(
        name, folder, run, "data.synthetic_samples=16", "train.max_steps=6", f"data.frame_counts=[{frames}]"
    )
    assert run_main(train, [*argv, *buckets]) == 0
    trained = {bucket for m in metrics(run) for bucket in m["buckets"]}
    assert len(trained) >= 2, trained
    # the tiny pipelines: Sana 32, HunyuanVideo 1.5's VAE 4 x its 1 x 1 patch, Wan's 8 x the DiT's 2 x 2,
    # the others' 4 x their 2 x 2
    multiple = {"sana": 32, "hunyuan_video15": 4, "dit": 16}.get(name, 8)
    for bucket in trained:
        count, height, width = map(int, bucket.split("x"))
        assert count == frames and height % multiple == 0 and width % multiple == 0, bucket


@pytest.mark.slow
def test_eval_demo_judges_what_infer_samples(runs, tmp_path):
    """scripts/eval_demo.py takes a family's run as it takes the DiT's: the held-out prompts of a colour,
    sampled by infer.py at the recipe's data.* size, judged; its report is the judge's reading of infer.py's
    own videos of those prompts and seeds."""
    import eval_demo

    from data.synthetic import held_out_prompts

    name, folder, made = runs
    config, *overrides = train_args(name, folder, made["full"])[1:]
    report = tmp_path / "r.json"
    argv = ["--config", config, *overrides, "--seeds", "1", "--colors", "orange", "--first-seed", "3"]
    assert run_main(eval_demo, [*argv, "--output", str(report), "--sheet", str(tmp_path / "s.png")]) == 0
    rows = json.loads(report.read_text())["rows"]
    prompts = held_out_prompts(["orange"])
    assert [r["prompt"] for r in rows] == prompts and (tmp_path / "s.png").stat().st_size > 0
    height, width = TRAIN_SIZE[name]
    size = ["--frames", str(ROWS[name].frames), "--height", str(height), "--width", str(width)]
    out = tmp_path / "v.npy"
    assert run_main(infer, ["--config", config, *overrides, "--prompt", *prompts, "--seed", "3", *size,
                            "--output", str(out)]) == 0  # fmt: skip
    videos = [np.load(tmp_path / f"v_{i:03d}.npy") for i in range(len(prompts))]
    palette = {**eval_demo.COLORS, "orange": eval_demo.PALETTE["orange"]}  # as --colors orange reads them
    assert rows == [eval_demo.judge(p, v, palette) for p, v in zip(prompts, videos, strict=True)]


@pytest.mark.slow
def test_a_calibrated_step_cache_for_a_family_run(runs, tmp_path, capsys):
    """scripts/calibrate_cache.py calibrates a family's run through infer.py (its own loop and solver);
    infer.py with sample.cache=calibrated then calls the model on the steps the table's budget leaves (2 of
    4), the image other than the uncached one; the table is refused for the LoRA run's weights, by name."""
    import calibrate_cache

    name, folder, made = runs
    config, *overrides = train_args(name, folder, made["full"])[1:]
    table = tmp_path / "c.json"
    assert run_main(calibrate_cache, ["--config", config, *overrides, "--steps", "4", "--seeds", "1",
                                      "--output", str(table)]) == 0  # fmt: skip
    assert json.loads(table.read_text())["steps"] == 4
    cached = ["sample.cache=calibrated", f"sample.cache_calibration={table}", "sample.cache_threshold=100"]
    argv = ["--config", config, *overrides, "--steps", "4", "--prompt", "a red square", "--seed", "3"]
    image, uncached = cached_and_uncached(argv, cached, tmp_path, capsys)
    assert np.isfinite(image).all() and np.abs(image - uncached).max() > 1e-4
    lora = [f"run.output_dir={made['lora']}" if o.startswith("run.output_dir=") else o for o in argv]
    assert run_main(infer, [*lora, *cached, "--output", str(tmp_path / "l.npy")]) == 2
    assert "weights: " in capsys.readouterr().err and not (tmp_path / "l.npy").exists()


@pytest.mark.parametrize(
    "world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 8]
)
def test_parallel_auto_trains_under_a_split_the_family_takes(saved, tmp_path, monkeypatch, world):
    """train.py with parallel.auto on `world` processes (one node): a layout of all of them whose split the
    family trains every bucket under (Sana's halo: a row and one per rank of its 3 x 5 tokens, so dp takes
    what ring cannot), the same degrees given by hand accepted; checked before any process group."""
    name, folder = saved
    monkeypatch.setattr(train, "world_from_env", lambda: (0, world, 0))
    monkeypatch.setattr(train, "local_world_size", lambda: world)

    def layout_of(*extra):
        argv = train_args(name, folder, tmp_path / "run", *extra)
        return train.check_before_start(load_config(argv[1], argv[2:])).layout

    chosen = layout_of("parallel.auto=true")
    assert chosen.world_size == world and chosen.sequence_parallel > 1, chosen
    degrees = [f"parallel.{k}={getattr(chosen, k)}" for k in ("dp", "ulysses", "ring")]
    assert layout_of(*degrees) == chosen


def infer_image(name, folder, tmp_path, out, *extra):
    prompt = ROWS[name].prompts[0]  # HunyuanVideo 1.5's with a glyph text
    argv = infer_args(name, folder, tmp_path, "--prompt", prompt, "--negative-prompt", negative(name))
    argv += ["--steps", "2", "--guidance", "4", "--seed", "1", "--output", str(tmp_path / out), *extra]
    assert run_main(infer, argv) == 0
    return np.load(tmp_path / out)


def load_lora(pipe, lora) -> None:
    """`lora` (diffusers' names) into the pipeline as its users load it: load_lora_weights, or for one that
    has none (HunyuanVideo 1.5's) its transformer's load_lora_adapter."""
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(lora)
    else:
        pipe.transformer.load_lora_adapter(str(lora), prefix="transformer")


@torch.no_grad()
def test_exports_load_in_diffusers(runs, tmp_path):
    """A LoRA trained here, exported (diffusers' names), loads in the pipeline (load_lora) and gives the image
    infer.py --lora gives with the file, and infer.py --checkpoint with the run (and the export in
    ComfyUI's names, read by infer.py --lora; FLUX.2's, in BFL's, by diffusers too); a full fine-tuning
    exported with --pipeline samples in diffusers what infer.py --checkpoint samples from the run."""
    from diffusers import DiffusionPipeline

    name, folder, made = runs
    prompt = ROWS[name].prompts[0]  # HunyuanVideo 1.5's with a glyph text
    base = pipeline_image(DiffusionPipeline.from_pretrained(folder), name, prompt)
    lora = tmp_path / "lora.safetensors"
    assert export.main(["--checkpoint", str(made["lora"]), "--lora", "--output", str(lora)]) == 0
    pipe = DiffusionPipeline.from_pretrained(folder)
    load_lora(pipe, lora)
    want = pipeline_image(pipe, name, prompt)
    with_file = infer_image(name, folder, tmp_path, "file.npy", "--lora", str(lora))
    with_run = infer_image(name, folder, tmp_path, "run.npy", "--checkpoint", str(made["lora"]))
    images = [with_file, with_run]
    if "comfyui" in family_named(name).names.lora_formats:  # ComfyUI's names, read back by infer.py --lora
        comfy = tmp_path / "comfy.safetensors"
        argv = ["--checkpoint", str(made["lora"]), "--lora", "--format", "comfyui", "--output", str(comfy)]
        assert export.main(argv) == 0
        images.append(infer_image(name, folder, tmp_path, "comfy.npy", "--lora", str(comfy)))
        if family_named(name).names.lora_release_names:  # BFL's names, ai-toolkit's: diffusers reads it
            pipe = DiffusionPipeline.from_pretrained(folder)
            pipe.load_lora_weights(comfy)
            images.append(pipeline_image(pipe, name, prompt))
    diffs = [float(np.abs(got - want).max()) for got in images]
    changed = float(np.abs(want - base).max())
    found = ", ".join(f"{d:.1e}" for d in diffs)
    print(
        f"{name} LoRA: diffusers vs infer.py --lora, --checkpoint (, ComfyUI's) {found}; base {changed:.1e}"
    )
    assert max(diffs) <= 1e-4 and changed > 1e-3

    exported = tmp_path / "pipeline"
    assert export.main(["--checkpoint", str(made["full"]), "--pipeline", "--output", str(exported)]) == 0
    want = pipeline_image(DiffusionPipeline.from_pretrained(exported), name, prompt)
    got = infer_image(name, folder, tmp_path, "full.npy", "--checkpoint", str(made["full"]))
    diff, changed = float(np.abs(got - want).max()), float(np.abs(want - base).max())
    print(f"{name} full: diffusers on the export vs infer.py --checkpoint {diff:.2e}; the base {changed:.2e}")
    assert diff <= 1e-5 and changed > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("degree", ["parallel.ulysses=2", "parallel.ring=2"])
def test_sequence_parallel_training_is_one_process(runs, tmp_path, degree):
    """Two processes sharing each image's tokens: every step's loss and gradient norm are one process's
    (the operators' collectives carry their gradients back). Sana's operators split the tokens alike under
    both degrees (no head split): ring alone runs for it."""
    name, folder, made = runs
    if name == "sana" and degree == "parallel.ulysses=2":
        pytest.skip("Sana under ulysses runs the operators parallel.ring=2 runs")
    one, two = made["full"], tmp_path / "two"
    done = ranks(2, "train.py", *train_args(name, folder, two, *KINDS["full"], degree), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    pairs = [
        (want[k], got[k])
        for want, got in zip(metrics(one), metrics(two), strict=True)
        for k in ("loss", "grad_norm")
    ]
    worst = max(abs(got - want) / abs(want) for want, got in pairs)
    print(f"{name} {degree}: losses and gradient norms within {worst:.1e} (relative) of one process's")
    assert worst <= 1e-5, pairs


@torch.no_grad()
def test_a_distilled_student_samples_in_diffusers_what_infer_samples(saved, tmp_path):
    """train.objective=dmd, 2 steps of a 2-step student (its turn and the critic's at both): the
    exported LoRA, in the pipeline at 2 steps and the family's no-guidance scale, samples what infer.py
    samples from the run (which takes the student's steps and drops guidance by itself)."""
    from diffusers import DiffusionPipeline

    name, folder = saved
    run = tmp_path / "student"
    dmd = [
        "train.objective=dmd",
        "lora.rank=4",
        "distill.steps=2",
        "distill.critic_updates=1",
        "train.lr=1e-2",
        "train.ema_decay=0.0",  # the student itself, not its average (the recipes' 0.999)
    ]
    with torch.enable_grad():
        assert run_main(train, train_args(name, folder, run, *dmd)) == 0
    lora = tmp_path / "student.safetensors"
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(lora)]) == 0
    prompt = ROWS[name].prompts[0]
    argv = infer_args(name, folder, tmp_path, "--prompt", prompt, "--seed", "1", "--checkpoint", str(run))
    assert run_main(infer, argv + ["--output", str(tmp_path / "ours.npy")]) == 0
    ours = np.load(tmp_path / "ours.npy")  # (frames, height, width, 3)
    pipe = DiffusionPipeline.from_pretrained(folder)
    unguided = dict(prompt=prompt, guidance=family_named(name).guidance.unguided, negative=False)
    base = pipeline_image(pipe, name, **unguided)
    load_lora(pipe, lora)
    theirs = pipeline_image(pipe, name, **unguided)
    assert theirs.shape == ours.shape, (theirs.shape, ours.shape)
    diff, moved = float(np.abs(theirs - ours).max()), float(np.abs(base - ours).max())
    print(f"{name} student: diffusers vs infer.py {diff:.1e}; the base at the same steps {moved:.1e}")
    assert diff <= 1e-5 and moved > 100 * diff  # measured: 2.4e-7 (the DiT) to 1.1e-6 (FLUX.2 klein)


@pytest.mark.slow  # 4 commands on a tiny Qwen-Image: the README's path, end to end
def test_the_readmes_lora_commands_run_on_a_folder_of_images(tmp_path_factory, tmp_path):
    """The README's "Your own LoRA" commands, as a user runs them on a folder of captioned images with a
    card recipe (configs/cards/qwen-image-lora-48gb.yaml: precomputed latents, a float8 base): the latents,
    a LoRA trained on them, the run sampled, its LoRA exported for ComfyUI and sampled on the base with
    --checkpoint none: the same image as the run's (at strength 1), and not the base's."""
    import precompute_latents
    from PIL import Image

    name, folder = saved_folder("qwen_image", tmp_path_factory)
    images = tmp_path / "my_images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(["a red square", "a blue circle", "a green wall", "a dog"]):
        Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(caption)
    recipe = ROOT / "configs" / "cards" / "qwen-image-lora-48gb.yaml"
    card = ["--config", str(recipe), *family_overrides(name, folder)]
    tiny = ["data.resolutions=[]", "data.aspect_ratios=[]", "data.frame_counts=[]", "data.height=48",
            "data.width=80", "data.num_workers=0", "train.batch_size=2", "train.max_steps=2", "train.lr=1e-2",
            "train.checkpoint_every=2", "train.sample_every=0", "train.ema_decay=0", "logging.wandb=false",
            f"data.latents={tmp_path / 'latents'}", f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    encode = [*card, *tiny, f"data.manifest={images}", "--out", str(tmp_path / "latents")]
    assert run_main(precompute_latents, encode) == 0
    assert run_main(train, [*card, *tiny]) == 0
    sample = ["--prompt", "a red square", "--frames", "1", "--height", "48", "--width", "80"]
    assert run_main(infer, [*card, *tiny, *sample, "--output", str(tmp_path / "run.npy")]) == 0
    lora = tmp_path / "my_lora.safetensors"
    assert export.main(["--checkpoint", str(tmp_path / "run"), "--lora", "--format", "comfyui",
                        "--output", str(lora)]) == 0  # fmt: skip
    base = [*card, "--checkpoint", "none", *sample]
    assert run_main(infer, [*base, "--lora", f"{lora}:1", "--output", str(tmp_path / "lora.npy")]) == 0
    assert run_main(infer, [*base, "--output", str(tmp_path / "base.npy")]) == 0
    run, with_lora, bare = (np.load(tmp_path / f"{n}.npy") for n in ("run", "lora", "base"))
    assert np.abs(with_lora - run).max() <= 1e-5 * np.abs(run).max()
    assert np.abs(bare - run).max() > 1e-4 * np.abs(run).max()  # 2 steps move it 3.9e-4
