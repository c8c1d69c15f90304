"""train.py on LTX-2 (models/ltx2/), against code no one here wrote: each step's loss is the sum of the
video's and the audio's flow-matching losses on LTX2Pipeline's own prompt encoding, connectors, VAEs and
transformer, each stream at its own sigma; the sigmas follow Lightricks' shifted logit-normal (its
distribution, worked out by hand); with data.audio=false the video trains alone and every audio parameter
ends a run bit for bit as loaded."""

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import train
from data.loader import encode_family_batch
from models.families import family_named
from models.ltx2.training import draw, draw_sigma, is_audio_parameter, shift_for
from parallel.drive.family_training import FamilyRun, family_batch
from tests.conftest import ROOT, run_main
from tests.test_ltx2_pipeline import MAX_LENGTH, tiny_pipeline

sys.path.insert(0, str(ROOT / "scripts"))
import export  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny LTX2Pipeline, with an audio VAE that compresses the sound as the release's does."""
    folder = tmp_path_factory.mktemp("ltx2_training") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline(encodes=True).save_pretrained(folder)
    return folder


CAPTIONS = ["a red fox runs through snow", "waves on a beach"]
FRAMES, HEIGHT, WIDTH, FPS = 9, 32, 64, 24


def training_recipe(folder, *extra):
    """configs/ltx-2.yaml on the tiny pipeline, training 9 frames at 32 x 64 and 24 fps."""
    from configs import load_config

    overrides = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    overrides += [f"text_encoder.max_length={MAX_LENGTH}", f"data.fps={FPS}", *extra]
    return load_config(ROOT / "configs" / "ltx-2.yaml", overrides)


def pipeline_audio(pipe, waveforms) -> torch.Tensor:
    """The clips' audio latents as the pipeline's parts make them: the stereo log-mel (models/ltx2/audio.py,
    checked against transformers' in tests/test_ltx2_audio.py), its audio VAE's posterior mode, packed
    and normalised by its _pack_audio_latents and _normalize_audio_latents: (B, L, C_a M)."""
    from models.ltx2.audio import log_mel

    vae = pipe.audio_vae
    mel = log_mel(waveforms, vae.config.sample_rate, vae.config.mel_hop_length, vae.config.mel_bins)
    packed = pipe._pack_audio_latents(vae.encode(mel).latent_dist.mode())
    return pipe._normalize_audio_latents(packed, vae.latents_mean, vae.latents_std)


def pipeline_loss(pipe, captions, video, sound, noise, sigmas, own_shifts=True, given=None) -> torch.Tensor:
    """The loss on LTX2Pipeline's parts: encode_prompt and its connectors, its video VAE's posterior mode
    normalised by its _normalize_latents, its transformer (packed latents, its coords at 24 fps, the
    streams' timesteps; the audio-video gates told the other stream's sigma, their scale and shift each
    stream's own, as Lightricks' model has them; `own_shifts` False: diffusers' use_cross_timestep alone);
    `sound`: pipeline_audio's packed latents, or None (the video alone: the modality-isolated pass);
    `given` (B,) bool: the clips given their first latent frame as Lightricks' trainer gives it (clean,
    its tokens at timestep 0 as LTX2ImageToVideoPipeline's per-token timestep, out of the trainer's masked
    loss: the squared errors times the mask over the mask's mean, here each clip's, then over clips)."""
    embeds, mask, _, _ = pipe.encode_prompt(
        captions, do_classifier_free_guidance=False, max_sequence_length=MAX_LENGTH, device="cpu"
    )
    text, audio_text, text_mask = pipe.connectors(embeds, mask, padding_side="left")
    vae = pipe.vae
    z = torch.cat([vae.encode(v[None].float() / 127.5 - 1).latent_dist.mode() for v in video])
    x0 = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    s = sigmas[:, 0].view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise[0]
    if sound is None:  # any audio (B, 3 frames, C_a M): the isolated video never sees it
        a_t, audio_sigma = torch.randn(len(captions), 3, pipe.transformer.config.audio_in_channels), s
    else:
        audio_noise, audio_sigma = pipe._pack_audio_latents(noise[1]), sigmas[:, 1].view(-1, 1, 1)
        a_t = (1 - audio_sigma) * sound + audio_sigma * audio_noise
    B, _, T, H, W = x0.shape
    video_timestep, keep = sigmas[:, 0] * 1000, None
    if given is not None:
        first = torch.zeros(B, 1, T, 1, 1, dtype=torch.bool)
        first[given, :, 0] = True
        x_t = torch.where(first, x0, x_t)
        keep = pipe._pack_latents((~first).float().expand(B, 1, T, H, W))  # (B, N, 1)
        video_timestep = video_timestep[:, None] * keep[..., 0]
    # Lightricks' model: each stream's a2v / v2a scale and shift read its own timestep (diffusers'
    # use_cross_timestep=True below gives the other stream's to the gates, and to these two, which the hooks
    # give back their own)
    own = {
        "av_cross_attn_video_scale_shift": video_timestep.flatten(),
        "av_cross_attn_audio_scale_shift": audio_sigma.flatten() * 1000,
    }
    hooks = [
        getattr(pipe.transformer, name).register_forward_pre_hook(
            lambda module, args, kwargs, t=t: ((t, *args[1:]), kwargs), with_kwargs=True
        )
        for name, t in own.items()
        if own_shifts
    ]
    out, audio_out = pipe.transformer(
        hidden_states=pipe._pack_latents(x_t),
        audio_hidden_states=a_t,
        encoder_hidden_states=text,
        audio_encoder_hidden_states=audio_text,
        timestep=video_timestep,
        audio_timestep=audio_sigma.flatten() * 1000,
        sigma=sigmas[:, 0] * 1000,  # what each stream's audio-video modulations read of the other's
        audio_sigma=audio_sigma.flatten() * 1000,
        use_cross_timestep=True,  # the pipeline's default
        encoder_attention_mask=text_mask,
        audio_encoder_attention_mask=text_mask,
        num_frames=T,
        height=H,
        width=W,
        fps=float(FPS),
        audio_num_frames=a_t.shape[1],
        video_coords=pipe.transformer.rope.prepare_video_coords(B, T, H, W, "cpu", fps=float(FPS)),
        audio_coords=pipe.transformer.audio_rope.prepare_audio_coords(B, a_t.shape[1], "cpu"),
        isolate_modalities=sound is None,
        return_dict=False,
    )
    for hook in hooks:
        hook.remove()
    loss = torch.nn.functional.mse_loss(out, pipe._pack_latents(noise[0] - x0))
    if keep is not None:  # each clip's (a batch of one is Lightricks'), then over clips
        squares, keep = (out - pipe._pack_latents(noise[0] - x0)).square(), keep.expand_as(out)
        loss = torch.stack([q.mul(k).div(k.mean()).mean() for q, k in zip(squares, keep, strict=True)]).mean()
    if sound is None:
        return loss
    return loss + torch.nn.functional.mse_loss(audio_out, audio_noise - sound)


@torch.no_grad()
def test_the_video_loss_is_diffusers(saved):
    """data.audio=false: two 9-frame clips, the second caption dropped (the empty prompt): train.py's
    loss (encode_family_batch, family_batch, the family's draw and loss) is the video's loss on the
    pipeline's parts, on the modality-isolated pass."""
    from diffusers import LTX2Pipeline

    family = family_named("ltx2")
    cfg = training_recipe(saved)
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (2, 3, FRAMES, HEIGHT, WIDTH), generator=generator, dtype=torch.uint8)
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    encoded = encode_family_batch(run, {"caption": CAPTIONS, "video": video}, [False, True], "cpu")
    x0, cond = family_batch(run, SimpleNamespace(sp_size=1), encoded, "cpu")
    assert cond.audio_x0 is None
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    noise, sigmas = family.objective.draw(parts, None, x0, cond, gens)
    ours = family.objective.loss(parts, None, parts.transformer, x0, cond, noise, sigmas)
    want = pipeline_loss(LTX2Pipeline.from_pretrained(saved), [CAPTIONS[0], ""], video, None, noise, sigmas)
    print(
        f"video alone: train.py's loss {ours.item():.6f}, diffusers' {want.item():.6f}", file=sys.__stderr__
    )
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()


def tones(count: int, samples: int) -> torch.Tensor:
    """`count` stereo clips' sound (count, 2, samples) at 16 kHz: a tone of its own per clip and channel
    that rises through the clip (a spectrum that changes in time), with a little noise."""
    t = torch.arange(samples) / 16000
    g = torch.Generator().manual_seed(1)
    waves = [
        0.4 * torch.sin(2 * math.pi * (220 * (i + 1) + 300 * c) * t * (1 + t))
        + 0.01 * torch.randn(samples, generator=g)
        for i in range(count)
        for c in range(2)
    ]
    return torch.stack(waves).view(count, 2, samples)


@torch.no_grad()
def test_the_audio_video_loss_is_diffusers(saved):
    """data.audio=true: two 9-frame clips with their sound (6,000 samples at 16 kHz: 10 audio latents),
    the second caption dropped: train.py's loss is the video's plus the audio's on the pipeline's parts,
    each stream at its own sigma; told one sigma for both, it is not."""
    from diffusers import LTX2Pipeline

    family = family_named("ltx2")
    cfg = training_recipe(saved, "data.audio=true")
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (2, 3, FRAMES, HEIGHT, WIDTH), generator=generator, dtype=torch.uint8)
    sound = tones(2, round(FRAMES / FPS * 16000))
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    batch = {"caption": CAPTIONS, "video": video, "audio": sound}
    x0, cond = family_batch(
        run, SimpleNamespace(sp_size=1), encode_family_batch(run, batch, [False, True], "cpu"), "cpu"
    )
    assert cond.audio_x0.shape == (2, 2, 10, 2)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    noise, sigmas = family.objective.draw(parts, None, x0, cond, gens)
    assert float((sigmas[:, 0] - sigmas[:, 1]).abs().min()) > 1e-2  # two sigmas per clip
    ours = family.objective.loss(parts, None, parts.transformer, x0, cond, noise, sigmas)
    pipe = LTX2Pipeline.from_pretrained(saved)
    packed = pipeline_audio(pipe, sound)
    assert float((pipe._pack_audio_latents(cond.audio_x0) - packed).abs().max()) <= 1e-5
    want = pipeline_loss(pipe, [CAPTIONS[0], ""], video, packed, noise, sigmas)
    shared = sigmas[:, :1].expand(-1, 2)
    one_sigma = family.objective.loss(parts, None, parts.transformer, x0, cond, noise, shared)
    cross = pipeline_loss(pipe, [CAPTIONS[0], ""], video, packed, noise, sigmas, own_shifts=False)
    print(
        f"video and audio: train.py's loss {ours.item():.6f}, diffusers' {want.item():.6f}; "
        f"with the video's sigma for both {one_sigma.item():.6f}; diffusers' with every audio-video "
        f"modulation told the other's sigma (use_cross_timestep alone) {cross.item():.6f}",
        file=sys.__stderr__,
    )
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()
    assert abs(one_sigma.item() - want.item()) > 1e-3 and abs(cross.item() - ours.item()) > 1e-4


@torch.no_grad()
def test_first_frame_conditioning_is_lightricks(saved):
    """train.first_frame_conditioning_p=0.5, two clips with their sound, the first given its first frame:
    train.py's loss is the pipeline's parts' with that frame clean at timestep 0 and out of the masked loss
    (pipeline_loss's `given`); told that nothing is given, it is not. The chance is drawn after everything
    else, so a recipe without it draws the same noise and sigmas."""
    from diffusers import LTX2Pipeline

    family = family_named("ltx2")
    cfg = training_recipe(saved, "data.audio=true", "train.first_frame_conditioning_p=0.5")
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    video = torch.randint(0, 256, (2, 3, FRAMES, HEIGHT, WIDTH), generator=torch.Generator().manual_seed(0))
    sound = tones(2, round(FRAMES / FPS * 16000))
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    batch = {"caption": CAPTIONS, "video": video.to(torch.uint8), "audio": sound}
    encoded = encode_family_batch(run, batch, [False, False], "cpu")
    x0, cond = family_batch(run, SimpleNamespace(sp_size=1), encoded, "cpu")
    draws = {}
    for chance in (0.0, 0.5):
        parts.first_frame_p = chance
        gens = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        draws[chance] = family.objective.draw(parts, None, x0, cond, gens)
    (plain, plain_sigmas), (noise, sigmas) = draws[0.0], draws[0.5]
    assert plain[2] is None and all(torch.equal(a, b) for a, b in zip(plain[:2], noise[:2], strict=True))
    assert torch.equal(plain_sigmas, sigmas) and noise[2].dtype == torch.bool and noise[2].shape == (2,)
    noise = (*noise[:2], torch.tensor([True, False]))
    ours = family.objective.loss(parts, None, parts.transformer, x0, cond, noise, sigmas)
    pipe = LTX2Pipeline.from_pretrained(saved)
    packed = pipeline_audio(pipe, sound)
    want = pipeline_loss(pipe, CAPTIONS, video, packed, noise, sigmas, given=torch.tensor([True, False]))
    text_only = pipeline_loss(pipe, CAPTIONS, video, packed, noise, sigmas)
    print(
        f"first frame given to clip 0: train.py's loss {ours.item():.6f}, diffusers' parts' "
        f"{want.item():.6f}; "
        f"with no frame given {text_only.item():.6f}",
        file=sys.__stderr__,
    )
    assert want.item() > 0.1 and abs(ours.item() - want.item()) <= 1e-5 * want.item()
    assert abs(text_only.item() - ours.item()) > 1e-4


@torch.no_grad()
def test_the_distillations_teacher_and_student_are_the_samplers_steps(saved):
    """train.objective=dmd with the recipe's guidance terms: the student starts from the clips' video and
    audio noise packed as a sampling's latents; at each sample's own sigma its velocity is the sampler's one-
    pass step (sample.* as distilled_recipe leaves them), the teacher's the sampler's guided step at
    distill.guidance and the recipe's terms (audio CFG 7, modality 3, rescale 0.7), each row as a batch
    sampled at that row's sigma gives it (the sampler's steps: tests/test_ltx2_pipeline.py), both at the
    clips' frame rate (data.fps 25, the previews' 24). The critic's loss on the clean clips packed so is the
    training's loss on them (tests/test_ltx2_training.py's reference) with both streams at one sigma."""
    from dataclasses import replace

    from models.ltx2.keys import LTX2Guidance
    from parallel.drive.distill import distilled_recipe
    from parallel.drive.family_training import empty_batch

    family = family_named("ltx2")
    dmd, rate = ["train.objective=dmd", "lora.rank=4", "distill.guidance=4"], 25
    recipe = training_recipe(saved, "data.audio=true", f"data.fps={rate}", *dmd)
    cfg = distilled_recipe(recipe, family)
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    assert parts.teacher_terms == LTX2Guidance(7.0, 3.0, 0.7, 1.0)  # the recipe's (configs/ltx-2.yaml)
    assert parts.terms == LTX2Guidance(1.0, 1.0, 0.0, 0.0)  # one pass
    video = torch.randint(0, 256, (2, 3, FRAMES, HEIGHT, WIDTH), generator=torch.Generator().manual_seed(0))
    run = FamilyRun(family, parts, cfg.text_encoder.max_length)
    batch = {
        "caption": CAPTIONS,
        "video": video.to(torch.uint8),
        "audio": tones(2, round(FRAMES / rate * 16000)),
    }
    x0, cond = family_batch(
        run, SimpleNamespace(sp_size=1), encode_family_batch(run, batch, [False] * 2, "cpu"), "cpu"
    )
    uncond = empty_batch(run, 2, "cpu")
    gens = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    noise, _ = family.objective.draw(parts, None, x0, cond, gens)
    start = family.objective.student_noise(parts, x0, cond, noise)
    assert all(torch.equal(a, b) for a, b in zip(parts.layout.split(start), noise[:2], strict=True))
    sigmas, packed = torch.tensor([[0.4, 0.4], [0.6, 0.6]]), parts.layout.join(x0, cond.audio_x0)
    critic = family.objective.sample_loss(parts, None, parts.transformer, packed, cond, start, sigmas[:, 0])
    want = family.objective.loss(parts, None, parts.transformer, x0, cond, noise, sigmas)
    assert abs(critic.item() - want.item()) <= 1e-6 * want.item(), (critic, want)
    x, sigma = 0.7 * start, torch.tensor([0.3, 0.8])
    student = family.objective.student_velocity(family, parts, parts.transformer, x, sigma, cond)
    teacher = family.objective.teacher_velocity(family, parts, parts.transformer, x, sigma, cond, uncond, 4.0)
    cond, uncond = (replace(c, fps=float(rate)) for c in (cond, uncond))
    guided_parts = replace(parts, terms=parts.teacher_terms)
    for i, t in enumerate(sigma):
        one = family.steps.velocity(parts, x, t, cond)[i]
        guided = family.steps.guided(family.guidance, guided_parts, x, t, cond, uncond, 4.0)[i]
        gaps = [float((a[i] - b).abs().max()) for a, b in ((student, one), (teacher, guided))]
        print(
            f"sample {i} at sigma {float(t)}: student vs the sampler's step, teacher vs its guided one {gaps}"
        )
        assert gaps[0] <= 1e-5 and gaps[1] <= 1e-5 and float((guided - one).abs().max()) > 1e-2
        at_24 = family.steps.velocity(parts, x, t, replace(cond, fps=24.0))[i]  # the rate tells
        assert float((at_24 - one).abs().max()) > 1e-4


def test_sigmas_follow_the_shifted_logit_normal():
    """20,000 draws for 1,024 and for 8,000 tokens against the distribution worked out by hand: with
    probability 0.9 sigmoid(N(mu, 1)) stretched between the normal's 0.5th and 99.9th percentiles (and
    reflected about 1e-3), else uniform; Kolmogorov-Smirnov distance under 0.015. The shift is capped at
    4,096 tokens; a batch's two streams draw independently."""
    assert shift_for(1024) == pytest.approx(0.95) and shift_for(4096) == pytest.approx(2.05)
    assert shift_for(100_000) == shift_for(4096) and shift_for(126) == pytest.approx(0.6284, abs=1e-4)
    normal = torch.distributions.Normal(0.0, 1.0)
    for tokens in (1024, 8000):
        mu = shift_for(tokens)
        g = torch.Generator().manual_seed(tokens)
        got = torch.tensor(sorted(draw_sigma(tokens, g) for _ in range(20_000)), dtype=torch.float64)
        lo, hi = (torch.sigmoid(torch.tensor(mu + q, dtype=torch.float64)) for q in (-2.5758, 3.0902))

        def stretched_cdf(s, mu=mu, lo=lo, hi=hi):  # before the reflection, which moves mass below 2e-3
            raw = (s * (hi - lo) + lo).clamp(1e-12, 1 - 1e-12)
            return normal.cdf((torch.log(raw / (1 - raw)) - mu).float()).double()

        grid = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
        want = 0.9 * stretched_cdf(grid) + 0.1 * (grid - 1e-3) / (1 - 1e-3)
        empirical = torch.searchsorted(got, grid, right=True).double() / len(got)
        assert float((empirical - want).abs().max()) < 0.015, tokens
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    _, sigmas = draw((4, 32, 8, 8), (2, 126, 8), gens)  # 2,048 video tokens, 126 audio frames
    assert abs(float(torch.corrcoef(sigmas.T)[0, 1])) < 0.05
    assert float(sigmas[:, 0].median()) > float(sigmas[:, 1].median()) + 0.1  # more tokens: noisier


def test_audio_parameters_are_named():
    """What data.audio=false freezes: the audio stream's parameters and both cross-modal attentions'
    (with their modulations); not the video's own."""
    ours = family_named("ltx2")
    model = ours.build(tiny_config(), SimpleNamespace(model=SimpleNamespace(attention_backend="sdpa")))
    names = [n for n, _ in model.named_parameters()]
    audio = {n for n in names if is_audio_parameter(n)}
    for expected in ("audio_proj_in.weight", "blocks.0.audio_to_video_attn.to_q.weight"):
        assert expected in audio
    assert "blocks.0.video_a2v_cross_attn_scale_shift_table" in audio
    assert "av_cross_attn_video_scale_shift.linear.weight" in audio
    for video in ("proj_in.weight", "blocks.0.attn1.to_q.weight", "time_embed.linear.weight"):
        assert video not in audio
    assert 0 < len(audio) < len(names)


def tiny_config() -> dict:
    return dict(
        _class_name="LTX2VideoTransformer3DModel",
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=1,
        caption_channels=32,
        rope_type="split",
    )


def train_args(folder, run, *extra) -> list:
    """Synthetic clips of 9 frames at 32 x 64, 2 per batch, 24 fps."""
    overrides = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    return [
        "--config",
        "configs/ltx-2.yaml",
        *overrides,
        f"run.output_dir={run}",
        f"text_encoder.max_length={MAX_LENGTH}",
        "data.manifest=null",
        "data.resolutions=[]",
        "data.aspect_ratios=[]",
        "data.frame_counts=[]",
        f"data.frames={FRAMES}",
        f"data.height={HEIGHT}",
        f"data.width={WIDTH}",
        f"data.fps={FPS}",
        "data.audio=false",  # the synthetic clips carry no sound (sound_args sets it true on real clips)
        "data.synthetic_samples=8",
        "data.num_workers=0",
        "train.batch_size=2",
        "train.warmup_steps=1",
        "train.lr=1e-2",
        "train.log_every=1",
        "sample.steps=2",
        f"sample.frames={FRAMES}",
        f"sample.height={HEIGHT}",
        f"sample.width={WIDTH}",
        "sample.prompts=[a red door]",
        "logging.wandb=false",
        "parallel.timeout_s=60",
        *extra,
    ]


def exported_transformer(run, folder, *flags) -> dict:
    """The run's transformer as scripts/export.py writes it (diffusers' names), read back."""
    from safetensors.torch import load_file

    assert export.main(["--checkpoint", str(run), "--output", str(folder), *flags]) == 0
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.slow  # a round trip of LTX-2's training: the fast tier keeps its losses, runs and refusals
def test_video_alone_leaves_the_audio_as_loaded(saved, tmp_path):
    """data.audio=false, a full fine-tuning of 10 steps at a large learning rate, with weight decay: every
    audio parameter of the exported run (its raw weights and its EMA) equals the pipeline's bit for bit,
    while each of the video's own moved."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    extra = ("train.max_steps=10", "train.checkpoint_every=10", "train.sample_every=0", "train.ema_decay=0.5")
    assert run_main(train, train_args(saved, run, *extra, "train.weight_decay=0.1")) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 10 and all(math.isfinite(x) and x > 0 for x in losses)
    loaded = load_file(saved / "transformer" / "diffusion_pytorch_model.safetensors")
    for flags in ((), ("--no-ema",)):
        trained = exported_transformer(run, tmp_path / f"export{len(flags)}", *flags)
        assert set(trained) == set(loaded)
        audio = [n for n in loaded if is_audio_parameter(n)]
        assert audio and all(torch.equal(trained[n], loaded[n]) for n in audio), flags
        moved = [n for n in loaded if not is_audio_parameter(n) and not torch.equal(trained[n], loaded[n])]
        video = [n for n in loaded if not is_audio_parameter(n)]
        print(f"{flags}: {len(audio)} audio tensors unchanged; {len(moved)} of {len(video)} video ones moved")
        assert len(moved) >= 0.9 * len(video)


def metrics(run) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def sound_manifest(folder) -> str:
    """Four 2 s clips at 24 fps with a mono tone from 1 s on (tests/test_loader_audio.py), captioned."""
    from data.manifest import write_manifest
    from tests.test_loader_audio import counter_with_tone, entry

    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, caption in enumerate(["a grey square", "a bell rings", "a light dims", "a tone sounds"]):
        clip = counter_with_tone(folder / f"clip{i}.mp4", FPS)
        entries.append({**entry(clip, FPS, 2 * FPS), "caption": caption})
    write_manifest(folder / "manifest.jsonl", entries)
    return str(folder / "manifest.jsonl")


def sound_args(folder, run, manifest, *extra) -> list:
    """train_args on `manifest`'s clips with their sound, 2 steps, checkpointed; half the clips drawn to
    train image-to-video (each step's first clip, at the test's seeds: the runs, their splits, exports and
    precomputed latents cover both kinds of clip)."""
    media = [f"data.manifest={manifest}", "data.audio=true", "data.max_upscale=8", "train.max_steps=2"]
    media.append("train.first_frame_conditioning_p=0.5")
    media.append("train.checkpoint_every=1")  # the 16 x 16 clips scaled up to the 32 x 64 bucket
    return [*train_args(folder, run, *media, "train.ema_decay=0", *extra)]


SOUND_KINDS = {"full": [], "lora": ["lora.rank=4", "train.lr=5e-2"]}


@pytest.fixture(scope="module")
def sound_runs(saved, tmp_path_factory):
    """{"full", "lora"}: 2-step runs on clips with their sound (data.audio=true), and the manifest."""
    root = tmp_path_factory.mktemp("ltx2-sound-runs")
    manifest = sound_manifest(root / "clips")
    for kind, extra in SOUND_KINDS.items():
        assert run_main(train, sound_args(saved, root / kind, manifest, *extra)) == 0
    return {kind: root / kind for kind in SOUND_KINDS} | {"manifest": manifest}


def test_runs_on_clips_with_sound_train_both_streams(sound_runs):
    """Both runs log two finite losses and checkpoint; the LoRA adapted both streams by default (the
    video's and the audio's attentions, feed-forwards and the cross-modal attentions)."""
    for kind in SOUND_KINDS:
        losses = [m["loss"] for m in metrics(sound_runs[kind])]
        assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    state = torch.load(sound_runs["lora"] / "checkpoints" / "step_2" / "trainer_rank0.pt", weights_only=False)
    modules = set(state["lora"]["modules"])
    for name in ("attn1.to_q", "audio_attn1.to_q", "audio_ff.net.2", "video_to_audio_attn.to_v", "ff.net.2"):
        assert f"blocks.0.{name}" in modules, name


def pipeline_outputs(pipe) -> tuple:
    """LTX2Pipeline's video and sound for PROMPTS[0] at seed 3 (tests/test_ltx2_pipeline.py's size)."""
    from tests.test_ltx2_pipeline import PROMPTS, pipeline

    return pipeline(pipe, PROMPTS[0], 3)


def infer_outputs(folder, out, *extra) -> tuple:
    """infer.py's first video and sound (tests/test_ltx2_pipeline.py's prompts, size and seed)."""
    import infer
    from tests.test_ltx2_pipeline import infer_args, written

    argv = [*infer_args(folder, out / "run"), "--output", str(out / "out.npy"), *extra]
    assert run_main(infer, argv) == 0
    videos, sounds, _ = written(out)
    return videos[0], sounds[0]


@pytest.mark.slow  # a round trip of LTX-2's training: the fast tier keeps its losses, runs and refusals
@torch.no_grad()
def test_lora_exports_load_in_diffusers(saved, sound_runs, tmp_path):
    """The LoRA run exported in diffusers' names and in ComfyUI's (the release's names under
    diffusion_model., no alphas) loads with LTX2Pipeline.load_lora_weights and samples the video and the
    sound infer.py --checkpoint samples from the run (and not the base's); infer.py --lora reads each file
    back to the same."""
    import numpy as np
    from diffusers import LTX2Pipeline

    want = infer_outputs(saved, tmp_path / "run", "--checkpoint", str(sound_runs["lora"]))
    base = pipeline_outputs(LTX2Pipeline.from_pretrained(saved))
    for fmt in ("diffusers", "comfyui"):
        lora = tmp_path / f"{fmt}.safetensors"
        argv = ["--checkpoint", str(sound_runs["lora"]), "--lora", "--format", fmt, "--output", str(lora)]
        assert export.main(argv) == 0
        pipe = LTX2Pipeline.from_pretrained(saved)
        pipe.load_lora_weights(str(lora))
        got = pipeline_outputs(pipe)
        diffs = [float(np.abs(g - w).max()) for g, w in zip(got, want)]
        moved = [float(np.abs(b - w).max()) for b, w in zip(base, want)]
        read = infer_outputs(saved, tmp_path / fmt, "--lora", str(lora))  # and read back by tessera
        back = [float(np.abs(r - w).max()) for r, w in zip(read, want)]
        print(
            f"LoRA in {fmt} names: diffusers vs infer.py --checkpoint {diffs}; the base's {moved}; "
            f"infer.py --lora {back}"
        )
        assert diffs[0] <= 1e-4 and diffs[1] <= 1e-5 and moved[0] > 1e-3 and moved[1] > 1e-5
        assert back[0] <= 1e-4 and back[1] <= 1e-5


@pytest.mark.slow  # a round trip of LTX-2's training: the fast tier keeps its losses, runs and refusals
@torch.no_grad()
def test_full_export_samples_in_diffusers(saved, sound_runs, tmp_path):
    """The full run on clips with sound exported with --pipeline: LTX2Pipeline samples from the folder the
    video and the sound infer.py --checkpoint samples from the run (and not the base's)."""
    import numpy as np
    from diffusers import LTX2Pipeline

    exported = tmp_path / "pipeline"
    assert (
        export.main(["--checkpoint", str(sound_runs["full"]), "--pipeline", "--output", str(exported)]) == 0
    )
    got = pipeline_outputs(LTX2Pipeline.from_pretrained(exported))
    want = infer_outputs(saved, tmp_path / "run", "--checkpoint", str(sound_runs["full"]))
    base = pipeline_outputs(LTX2Pipeline.from_pretrained(saved))
    diffs = [float(np.abs(g - w).max()) for g, w in zip(got, want)]
    moved = [float(np.abs(b - w).max()) for b, w in zip(base, want)]
    print(
        f"full fine-tune exported with --pipeline: diffusers vs infer.py --checkpoint {diffs}; base {moved}"
    )
    assert diffs[0] <= 1e-4 and diffs[1] <= 1e-5 and moved[0] > 1e-3 and moved[1] > 1e-5


@pytest.mark.slow  # a round trip of LTX-2's training: the fast tier keeps its losses, runs and refusals
def test_precomputed_latents_with_sound_train_as_the_clips_do(saved, sound_runs, tmp_path):
    """scripts/precompute_latents.py with data.audio stores each clip's video and audio latents; training
    on them takes the full run's steps (losses and gradient norms)."""
    import precompute_latents

    latents = tmp_path / "latents"
    argv = sound_args(saved, tmp_path / "unused", sound_runs["manifest"])
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    stored = tmp_path / "stored"
    assert run_main(train, sound_args(saved, stored, sound_runs["manifest"], f"data.latents={latents}")) == 0
    pairs = [
        (a[k], b[k])
        for a, b in zip(metrics(sound_runs["full"]), metrics(stored), strict=True)
        for k in ("loss", "grad_norm")
    ]
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(f"on latents vs on clips with sound, largest relative difference {worst:.1e}", file=sys.__stderr__)
    assert worst <= 1e-5, pairs


@pytest.mark.slow
@pytest.mark.parametrize("split, degree", [("ulysses", 2), ("ring", 3)])
def test_split_training_with_sound_is_one_process(saved, sound_runs, tmp_path, split, degree):
    """Processes splitting the video's tokens (parallel.ulysses=2, its 2 heads; parallel.ring=3, which
    does not divide the 2,560 tokens: padded), the sound whole on each: every step's loss and gradient norm
    are the one-process run's."""
    from tests.conftest import ranks

    two = tmp_path / "two"
    argv = sound_args(saved, two, sound_runs["manifest"], f"parallel.{split}={degree}")
    done = ranks(degree, "train.py", *argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{split}={degree}" in done.stdout + done.stderr  # the layout line: the split ran
    pairs = [
        (a[k], b[k])
        for a, b in zip(metrics(sound_runs["full"]), metrics(two), strict=True)
        for k in ("loss", "grad_norm")
    ]
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(
        f"{split} {degree} with sound: losses and gradient norms within {worst:.1e} (relative) of one "
        "process's"
    )
    assert worst <= 1e-5, pairs


# a 2-step student and its critic as LoRAs, each step its turn and the critic's; the teacher guided at 3
DMD = ["train.objective=dmd", "distill.steps=2", "distill.critic_updates=1", "distill.guidance=3"]
DMD += ["train.first_frame_conditioning_p=0", "lora.rank=4", "train.lr=5e-2"]


@pytest.fixture(scope="module")
def student(saved, sound_runs, tmp_path_factory):
    """A distillation on the clips with their sound (2 steps, LoRA) on one process."""
    run = tmp_path_factory.mktemp("ltx2-student") / "one"
    assert run_main(train, sound_args(saved, run, sound_runs["manifest"], *DMD)) == 0
    return run


@pytest.mark.slow  # a distillation, an export, a sampling by each: the image rows' is in the fast tier
@torch.no_grad()
def test_a_distilled_student_samples_in_diffusers_what_infer_samples(saved, student, tmp_path, capsys):
    """The student's LoRA in LTX2Pipeline at its 2 steps, one pass a step (guidance 1, audio guidance 1, no
    STG, modality guidance 1, no rescale: the terms infer.py takes from the checkpoint by itself), samples
    the video and the sound infer.py --checkpoint samples; the base at the same steps samples otherwise. A
    command that sets one of those terms otherwise is refused by name."""
    import numpy as np
    from diffusers import LTX2Pipeline

    import infer
    from tests.test_ltx2_pipeline import PROMPTS, SIZE, infer_args, pipeline, written

    losses = metrics(student)
    assert len(losses) == 2 and all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in losses)
    lora = tmp_path / "student.safetensors"
    assert export.main(["--checkpoint", str(student), "--lora", "--output", str(lora)]) == 0
    argv = infer_args(saved, tmp_path / "run")
    argv = argv[: argv.index("--steps")]  # the student's own steps
    argv += ["--checkpoint", str(student), "--output", str(tmp_path / "out.npy")]
    assert run_main(infer, [*argv, "sample.stg=1.0"]) == 2  # a term the student does without: refused
    assert "drop sample.stg" in capsys.readouterr().err
    assert run_main(infer, [*argv, "sample.stg=0.0"]) == 0  # the student's own: taken
    videos, sounds, _ = written(tmp_path)
    terms = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0)
    # the pipeline's audio terms do not follow the video's unless None: each said
    terms |= {f"audio_{k}": v for k, v in terms.items()} | dict(num_inference_steps=2)
    pipe = LTX2Pipeline.from_pretrained(saved)
    base = pipeline(pipe, PROMPTS[0], 3, **terms)
    pipe.load_lora_weights(str(lora))
    got = pipeline(pipe, PROMPTS[0], 3, **terms)
    diffs = [float(np.abs(g - w).max()) for g, w in zip(got, (videos[0], sounds[0]))]
    moved = [float(np.abs(b - w).max()) for b, w in zip(base, (videos[0], sounds[0]))]
    print(f"LTX-2 student {SIZE}: diffusers vs infer.py {diffs}; the base at the same steps {moved}")
    assert diffs[0] <= 1e-4 and diffs[1] <= 1e-5 and moved[0] > 1e-3 and moved[1] > 1e-5


@pytest.mark.slow  # a launch of 2 processes
def test_a_split_distillation_is_one_process(saved, sound_runs, student, tmp_path):
    """The distillation on 2 processes splitting the video's tokens (parallel.ulysses=2), the sound whole on
    each: every step's critic loss, student loss and gradient norm are the one-process run's."""
    from tests.conftest import ranks

    argv = sound_args(saved, tmp_path / "two", sound_runs["manifest"], *DMD, "parallel.ulysses=2")
    done = ranks(2, "train.py", *argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ulysses=2" in done.stdout + done.stderr
    runs = zip(metrics(student), metrics(tmp_path / "two"), strict=True)
    pairs = [(a[k], b[k]) for a, b in runs for k in ("loss", "dmd_loss", "grad_norm")]
    worst = max(abs(b - a) / abs(a) for a, b in pairs)
    print(f"LTX-2 distillation on ulysses=2: within {worst:.1e} (relative) of one process's")
    assert worst <= 1e-5, pairs


def test_unread_flow_keys_and_missing_fps_are_refused(saved):
    """LTX-2 draws its own sigmas: flow.shift set is refused by name (FLOW_DEFAULTS are the schema's);
    data.fps unset too, a first-frame chance outside [0, 1], previews' first frames it would not read
    (sample.images), and model.task=i2v (naming the key that trains its image-to-video); another family's
    recipe refuses the key."""
    from dataclasses import asdict

    from configs.schema import FlowConfig
    from models.ltx2.family import FLOW_DEFAULTS

    assert asdict(FlowConfig()) == FLOW_DEFAULTS
    family = family_named("ltx2")
    family.check_training(training_recipe(saved))
    with pytest.raises(ValueError, match=r"flow.shift=3.0: LTX-2 draws each stream's sigma"):
        family.check_training(training_recipe(saved, "flow.shift=3.0"))
    with pytest.raises(ValueError, match="data.fps is unset"):
        family.check_training(training_recipe(saved, "data.fps=null"))
    with pytest.raises(ValueError, match=r"conditioning_p=1.5: a clip.s chance .* between 0 and 1"):
        family.check_training(training_recipe(saved, "train.first_frame_conditioning_p=1.5"))
    with pytest.raises(ValueError, match=r"sample.images=\['a.png'\]: LTX-2's training previews sample from"):
        family.check_training(training_recipe(saved, "sample.images=[a.png]"))
    from parallel.drive.family_training import check_family_training

    asked = training_recipe(saved, "model.task=i2v")  # its image-to-video training is named instead
    with pytest.raises(ValueError, match=r"model.task=i2v: .* LTX-2 leaves it at t2v \(its image-to-video "):
        check_family_training(asked, family, SimpleNamespace(ulysses=1, ring=1))
    with pytest.raises(ValueError, match=r"training is train.first_frame_conditioning_p: each clip's chance"):
        check_family_training(asked, family, SimpleNamespace(ulysses=1, ring=1))
    from configs import load_config

    other = ["train.first_frame_conditioning_p=0.1"]  # another family's recipe: the key is LTX-2's
    with pytest.raises(ValueError, match=r"conditioning_p=0.1: Qwen-Image takes no such image-to"):
        load_config(ROOT / "configs" / "qwen-image.yaml", other)


def test_distillations_it_cannot_take_are_refused(saved):
    """train.objective=dmd is refused by name, as the recipe runs (distilled_recipe), on clips without their
    sound, with first frames given, and with a teacher whose audio CFG would guide without the video's (set,
    or null: the pipeline's 7); distill.stg set on another family's recipe is refused as its guidance term."""
    from configs import load_config
    from parallel.drive.distill import check_distillation, distilled_recipe

    family = family_named("ltx2")
    dmd = ["train.objective=dmd", "lora.rank=4", "data.audio=true"]
    check_distillation(distilled_recipe(training_recipe(saved, *dmd), family), family)
    refused = {
        "data.audio=false": r"data.audio=false: LTX-2's student samples the sound with the video",
        "train.first_frame_conditioning_p=0.1": r"conditioning_p=0.1: a student conditioned on a given first",
        "distill.guidance=1": r"distill.audio_guidance=7.0 with distill.guidance=1.0: LTX-2's audio CFG",
        "sample.audio_guidance=null distill.guidance=1": r"audio_guidance=7.0 with distill.guidance=1",
    }
    for extra, match in refused.items():
        with pytest.raises(ValueError, match=match):
            recipe = training_recipe(saved, *dmd, *extra.split())
            check_distillation(distilled_recipe(recipe, family), family)
    with pytest.raises(ValueError, match=r"distill.stg=0.5: .*LTX-2"):
        load_config(ROOT / "configs" / "qwen-image.yaml", ["distill.stg=0.5"])


def test_an_audio_vae_that_compresses_otherwise_is_named(saved, tmp_path):
    """An audio VAE whose encoder compresses the sound other than 4x (one level: 1x) would encode clips to
    latents of another length than the loss's (a size mismatch deep in a step): refused by name, before
    anything loads, where training reads sound; data.audio=false does not read it."""
    import json
    import shutil

    other = tmp_path / "pipeline"
    shutil.copytree(saved, other)
    config = other / "audio_vae" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "ch_mult": [1]}))
    family = family_named("ltx2")
    with pytest.raises(ValueError, match=r"compresses the sound 1x in time .* LTX-2's audio latents are 4x"):
        family.check_training(training_recipe(other, "data.audio=true"))
    family.check_training(training_recipe(other, "data.audio=false"))
    family.check_training(training_recipe(saved, "data.audio=true"))  # the release's 4x


def test_a_resume_with_the_audio_switched_is_refused(saved, sound_runs, capsys):
    """The full run trained its sound (data.audio=true): resuming it with data.audio=false would freeze
    weights its optimizer holds state for; refused by name, nothing written."""
    run = sound_runs["full"]
    before = (run / "metrics.jsonl").read_text()
    argv = sound_args(saved, run, sound_runs["manifest"], "data.audio=false", "train.max_steps=3")
    assert run_main(train, argv) != 0
    err = capsys.readouterr().err
    assert "data.audio=True there, False here" in err and err.count("error:") == 1, err
    assert (run / "metrics.jsonl").read_text() == before


def test_lora_targets_on_frozen_audio_get_no_adapters(saved):
    """data.audio=false: a pattern that matches audio layers too adapts the video's alone; one that
    matches audio layers only is refused by name (it would train nothing)."""
    import torch.nn as nn

    from parallel.build.components import meta_model_builder
    from parallel.compute.sequence import SequenceGroups

    def adapted(*targets):
        patterns = ",".join(repr(t) for t in targets)
        cfg = training_recipe(saved, "data.audio=false", "lora.rank=4", f"lora.targets=[{patterns}]")
        one = SequenceGroups(None, 1, 0, None, [0], 0, None, 1, 0)  # one process
        model, names = meta_model_builder(cfg, one, torch.float32)(adapters=True)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return set(names), trainable, model

    names, trainable, model = adapted("*.to_q")
    assert "blocks.0.attn1.to_q" in names and "blocks.0.audio_attn1.to_q" not in names
    assert not any(is_audio_parameter(n) for n in names) and trainable
    assert all(".lora_" in n for n in trainable)
    assert isinstance(model.get_submodule("blocks.0.audio_attn1.to_q"), nn.Linear)
    with pytest.raises(ValueError, match="keeps frozen"):
        adapted("blocks.*.audio_attn1.*")


@pytest.mark.slow  # a round trip of LTX-2's training: the fast tier keeps its losses, runs and refusals
@torch.no_grad()
def test_a_video_lora_on_broad_targets_exports_and_samples(saved, tmp_path):
    """data.audio=false with lora.targets=['*.to_q'] (audio layers matched, left without adapters): the
    2-step run's export loads with LTX2Pipeline.load_lora_weights and samples what infer.py --checkpoint
    samples from the run."""
    import numpy as np
    from diffusers import LTX2Pipeline

    run = tmp_path / "run"
    extra = ("lora.rank=4", "lora.targets=['*.to_q']", "train.lr=5e-2", "train.max_steps=2")
    with torch.enable_grad():
        assert run_main(train, train_args(saved, run, *extra, "train.sample_every=0")) == 0
    lora = tmp_path / "lora.safetensors"
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(lora)]) == 0
    pipe = LTX2Pipeline.from_pretrained(saved)
    pipe.load_lora_weights(str(lora))
    got, want = pipeline_outputs(pipe), infer_outputs(saved, tmp_path / "infer", "--checkpoint", str(run))
    diffs = [float(np.abs(g - w).max()) for g, w in zip(got, want)]
    print(f"video LoRA on *.to_q: diffusers vs infer.py --checkpoint {diffs}")
    assert diffs[0] <= 1e-4 and diffs[1] <= 1e-5
