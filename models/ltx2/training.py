"""LTX-2's training as Lightricks' own trainer does it (docs/ltx2_training.md; read in Lightricks/LTX-2,
packages/ltx-trainer): a sigma per stream, each from the shifted logit-normal of that stream's own token
count (a shared sigma is what had voices come out as noise elsewhere), velocity targets, and the plain sum
of the video's and the audio's mean squared errors; the audio-video gates read the other stream's sigma,
their scale and shift each stream's own, as in Lightricks' model (LTX2Cond.cross_gate_only). Without sound
(data.audio=false) the video trains alone: the modality-isolated pass, no audio loss, and every audio
parameter frozen (is_audio_parameter). Image-to-video trains as the trainer's first-frame conditioning does
(train.first_frame_conditioning_p): a clip drawn to be given its first latent frame keeps it clean, at sigma
0 on its tokens, and out of the video's loss.
"""

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from models.ltx2.keys import guidance_terms
from models.ltx2.layout import LTX2Layout
from models.objective import Objective

# what names an audio parameter: the audio stream's own, and both cross-modal attentions' with their
# modulations (a2v, v2a, av_cross_attn_*): trained only with the sound
AUDIO_PARTS = ("audio", "a2v", "v2a", "av_cross")
# the logit-normal's shift: 0.95 at 1,024 tokens, 2.05 at 4,096 and above (the trainer caps it there, as
# the percentiles would meet), its standard deviation 1, its stretch between the normal's 0.5th and 99.9th
# percentiles, a uniform draw instead 10% of the time, and the reflection of draws below EPS
SHIFT = (1024, 0.95, 4096, 2.05)
LOW, HIGH, UNIFORM, EPS = -2.5758, 3.0902, 0.1, 1e-3


def is_audio_parameter(name: str) -> bool:
    return any(part in name for part in AUDIO_PARTS)


def shift_for(tokens: int) -> float:
    """mu of the logit-normal for a stream of `tokens` tokens (linear, capped at the top)."""
    lo, lo_shift, hi, hi_shift = SHIFT
    return lo_shift + (min(tokens, hi) - lo) * (hi_shift - lo_shift) / (hi - lo)


def draw_sigma(tokens: int, generator: torch.Generator) -> float:
    """One sigma in (0, 1] for a stream of `tokens` tokens, from `generator` alone: sigmoid(N(mu, 1))
    stretched so that its 0.5th and 99.9th percentiles become 0 and 1, small values reflected about EPS,
    clamped to [0, 1]; 10% of the time a uniform draw in [EPS, 1)."""
    mu = shift_for(tokens)
    normal, uniform, choice = torch.randn(1, generator=generator), *torch.rand(2, generator=generator)
    lo, hi = torch.sigmoid(torch.tensor(mu + LOW)), torch.sigmoid(torch.tensor(mu + HIGH))
    stretched = (torch.sigmoid(normal + mu) - lo) / (hi - lo)
    stretched = torch.where(stretched >= EPS, stretched, 2 * EPS - stretched).clamp(0, 1)
    return float(stretched) if float(choice) > UNIFORM else float((1 - EPS) * uniform + EPS)


def draw(video_shape: tuple, audio_shape: tuple | None, generators: list, first_frame: float = 0.0) -> tuple:
    """((video noise (B, *video_shape), audio noise (B, *audio_shape) or None, given (B,) bool or None),
    sigmas (B, 2): the video's, the audio's), sample i's from generators[i] alone: its video noise, its
    audio noise, a sigma for each stream by its own token count (latents per token: 1, LTX-2's patch size;
    an audio token is a latent frame), then, at the chance `first_frame`, whether its first latent frame
    is given (never to a clip of one latent frame: nothing would be left to train). Without sound the
    audio's sigma is the video's (it trains nothing)."""
    video_tokens = math.prod(video_shape[1:])
    gives = first_frame > 0 and video_shape[1] > 1
    noises, audio_noises, sigmas, given = [], [], [], []
    for g in generators:
        noises.append(torch.randn(video_shape, generator=g))
        if audio_shape is not None:
            audio_noises.append(torch.randn(audio_shape, generator=g))
        video_sigma = draw_sigma(video_tokens, g)
        audio_sigma = draw_sigma(audio_shape[1], g) if audio_shape is not None else video_sigma
        sigmas.append((video_sigma, audio_sigma))
        if gives:  # drawn last: a recipe without it draws what it drew before
            given.append(float(torch.rand(1, generator=g)) < first_frame)
    audio = torch.stack(audio_noises) if audio_shape is not None else None
    return (torch.stack(noises), audio, torch.tensor(given) if gives else None), torch.tensor(sigmas)


def loss(model, x0, audio_x0, cond, noise: tuple, sigmas) -> torch.Tensor:
    """The video's mean squared velocity error plus the audio's (without `audio_x0`: the video's alone, on
    the modality-isolated pass with a silent one-frame audio stream, which the video then never sees), each
    stream noised at its own sigma: x_t = (1 - sigma) x0 + sigma noise, the target noise - x0. A clip
    `given` its first frame (draw) keeps that frame's latents clean at sigma 0, its tokens out of the
    video's mean (given_frames)."""
    video_noise, audio_noise = (n.to(x0.device, x0.dtype) if n is not None else None for n in noise[:2])
    sigmas = sigmas.to(x0.device)
    video_t, audio_t = sigmas[:, 0], sigmas[:, 1]
    x_t = mix(x0, video_noise, video_t)
    x_t, cond, weight = given_frames(x0, x_t, cond, video_t, noise[2])
    video_error = lambda video: masked_mse(video.float(), (video_noise - x0).float(), weight)  # noqa: E731
    if audio_x0 is None:
        # (B, C_a M, 1, 1): one latent audio frame of C_a x M values, as the transformer's embed reads it
        silent = x0.new_zeros(x0.shape[0], model.audio_proj_in.in_features, 1, 1)
        video, _ = model(x_t, silent, video_t, replace(cond, audio_t=None), isolate_modalities=True)
        return video_error(video)
    audio_x0 = audio_x0.to(x0.device, x0.dtype)
    audio_t_x = mix(audio_x0, audio_noise, audio_t)
    video, audio = model(x_t, audio_t_x, video_t, replace(cond, audio_t=audio_t, cross_gate_only=True))
    return video_error(video) + F.mse_loss(audio.float(), (audio_noise - audio_x0).float())


def given_frames(x0, x_t, cond, video_t, given) -> tuple:
    """(x_t, cond, the loss's weight (B, 1, T, 1, 1): 0 on a given frame, or None) for the clips `given`
    their first latent frame: its latents x0's, its tokens' sigma 0 (cond.video_t per token, the image-to-
    video pipeline's), the other streams' modulations still reading the clip's sigma. Unchanged when none
    is given."""
    if given is None or not bool(given.any()):
        return x_t, cond, None
    B, _, T, H, W = x0.shape
    first = torch.zeros(B, 1, T, 1, 1, dtype=torch.bool, device=x0.device)
    first[given.to(x0.device), :, 0] = True
    weight = (~first).float()
    per_token = weight.expand(B, 1, T, H, W).flatten(1) * video_t.float()[:, None]
    return torch.where(first, x0, x_t), replace(cond, video_t=per_token), weight


def masked_mse(prediction, target, weight) -> torch.Tensor:
    """Each clip's mean squared error over the elements `weight` keeps, then the mean over clips (the plain
    mean without a weight). Per clip, so that a clip's loss does not depend on which clips share its batch
    or its rank; Lightricks' trainer divides by the batch's kept share, the same where a batch's clips are
    all given their frame or none is (its draw was once per batch)."""
    if weight is None:
        return F.mse_loss(prediction, target)
    weight = weight.expand_as(prediction)
    squares = (prediction - target).square().mul(weight).flatten(1).sum(1)
    return (squares / weight.flatten(1).sum(1)).mean()


def mix(x0, noise, sigma):
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


class LTX2Objective(Objective):
    """Its two streams' sigmas (draw) and the sum of their losses, at the training's frame rate; the clips
    given their first frame (train.first_frame_conditioning_p) train image-to-video."""

    def draw(self, parts, flow, x0, cond, generators: list) -> tuple:
        audio = None if cond.audio_x0 is None else tuple(cond.audio_x0.shape[1:])
        return draw(tuple(x0.shape[1:]), audio, generators, parts.first_frame_p)

    def loss(self, parts, flow, model, x0, cond, noise, t) -> torch.Tensor:
        return loss(model, x0, cond.audio_x0, replace(cond, fps=float(parts.train_fps)), noise, t)

    # a distillation walks both streams as sampling does: one flat tensor (models/ltx2/layout.py), one
    # schedule, the teacher's passes guided in x0 at the distill section's terms, the student one pass
    def student_noise(self, parts, x0, cond, noise):
        """The video's and the audio's noise packed as a sampling's latents; records their layout."""
        (_, channels, *grid), (_, audio_channels, frames, mel_bins) = x0.shape, cond.audio_x0.shape
        parts.layout = LTX2Layout(tuple(grid), channels, frames, audio_channels, mel_bins)
        return parts.layout.join(noise[0], noise[1]).to(x0.device, x0.dtype)

    def student_velocity(self, family, parts, model, x, sigma, cond):
        """One pass of `model` on both streams at the training's frame rate, as the student samples."""
        cond = replace(cond, fps=float(parts.train_fps))
        return family.steps.one_pass(replace(parts, transformer=model), x, sigma, cond).to(x.dtype)

    def teacher_velocity(self, family, parts, model, x, sigma, cond, uncond, scale: float):
        """Its sampling's passes on `model`, guided at `scale` and the teacher's terms (cfg.distill's)."""
        teacher = replace(parts, transformer=model, terms=parts.teacher_terms)
        cond, uncond = (replace(c, fps=float(parts.train_fps)) for c in (cond, uncond))
        if family.guidance.guided(scale):
            return family.steps.guided(family.guidance, teacher, x, sigma, cond, uncond, scale).to(x.dtype)
        return family.steps.velocity(teacher, x, sigma, cond).to(x.dtype)

    def sample_loss(self, parts, flow, model, sample, cond, noise, sigma) -> torch.Tensor:
        """Its loss on the student's sample, both streams at sigma (the sum of their mean squared errors)."""
        (video, audio), (video_noise, audio_noise) = parts.layout.split(sample), parts.layout.split(noise)
        noise, sigmas = (video_noise, audio_noise, None), torch.stack([sigma, sigma], dim=1)
        return self.loss(parts, flow, model, video, replace(cond, audio_x0=audio), noise, sigmas)

    def check_distillation(self, cfg) -> None:
        """Its student samples the sound with the video from text: it distils clips with their sound
        (data.audio=true) and no given first frame; its teacher's audio CFG guides with the video's."""
        if not cfg.data.audio:
            raise ValueError(
                "train.objective=dmd with data.audio=false: LTX-2's student samples the sound with the "
                "video, and clips without their sound would leave the sound undistilled; set data.audio=true "
                "(clips with sound, data.fps set)"
            )
        if cfg.train.first_frame_conditioning_p:
            raise ValueError(
                f"train.objective=dmd with train.first_frame_conditioning_p="
                f"{cfg.train.first_frame_conditioning_p}: a student conditioned on a given first frame is "
                "not built; distil text-to-video (set it to 0)"
            )
        audio = guidance_terms(cfg.distill).audio_guidance  # None: the pipeline's 7
        if cfg.distill.guidance <= 1 and audio > 1:
            raise ValueError(
                f"distill.audio_guidance={audio} with distill.guidance={cfg.distill.guidance}: LTX-2's "
                "audio CFG runs with the video's here; set the teacher's distill.guidance above 1, or "
                "distill.audio_guidance=1"
            )
