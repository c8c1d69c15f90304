"""LTX-2 (diffusers' LTX2Pipeline: text to video with sound) as a tessera family (models/family.py): the
folder's Gemma 3 text encoder, text connectors, video and audio VAEs and vocoder through diffusers and
transformers, the transformer tessera's (models/ltx2/transformer.py). The pipeline's schedule (its sigmas
shifted by the video token count, one Euler step for both streams) and its guidance in x0 space: video and
audio CFG, modality isolation and STG as deltas, then the guidance rescale. The generic loop carries one
float32 tensor (B, D): each sample's packed video latents, then its packed audio latents (LTX2Layout).
Text- and image-to-video (--image: LTX2ImageToVideoPipeline's first frame) under dp, cfg, ulysses or ring;
training video with its sound, and image-to-video (train.first_frame_conditioning_p), as Lightricks' trainer
does (models/ltx2/training.py, audio.py); distilling both streams into a one-pass student. Refused by name:
prompt enhancement; PipeFusion and the step caches (for the model's reasons in its capabilities)
"""

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from models.capabilities import Capabilities
from models.family import Components, Family, config_of, part_folder, read_json
from models.guidance import Guidance
from models.loop import UNSUPPORTED, Schedule, euler, sigmas
from models.ltx2.audio import encode_sound
from models.ltx2.keys import LTX2Guidance, guidance_terms
from models.ltx2.layout import LTX2Layout
from models.ltx2.text import encode_prompts, prepare_tokenizer
from models.ltx2.training import LTX2Objective, is_audio_parameter
from models.ltx2.transformer import LTX2Cond
from models.ltx2.weights import TRANSFORMER_CLASS, build_transformer, diffusers_from_release
from models.names import Names
from models.steps import Steps

# the diffusers parts besides Family.check_pretrained's, each with the file that says it is there
PARTS = dict(connectors="config.json", audio_vae="config.json", vocoder="config.json")
# configs/schema.py FlowConfig's defaults: the keys of the flow tessera's DiT draws from, which LTX-2 does not
FLOW_DEFAULTS = dict(logit_mean=0.0, logit_std=1.0, shift=1.0, shift_reference_tokens=256)
STG_BLOCKS = (28,)  # the pipeline's default spatio_temporal_guidance_blocks
# diffusers' module names that the release (and ComfyUI, under diffusion_model.) spells otherwise, as
# diffusers' own LTX-2 LoRA conversion renames them; every other module keeps its name
ORIGINAL_NAMES = (
    ("audio_proj_in", "audio_patchify_proj"),
    ("proj_in", "patchify_proj"),
    ("audio_time_embed.", "audio_adaln_single."),
    ("time_embed.", "adaln_single."),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
)
X264_LARGEST = 16384  # pixels a side that the H.264 re-compression of a first frame takes (measured)


@dataclass
class LTX2Parts(Components):
    """Its parts: Components' (Gemma 3 as text_encoder, the video VAE as vae), the connectors, audio VAE
    and vocoder; the recipe's guidance terms and frame rate; the layout of the sampling under way (noise()
    records it: the generic loop carries one flat tensor, which only this says how to split)."""

    connectors: torch.nn.Module = None
    audio_vae: torch.nn.Module = None
    vocoder: torch.nn.Module = None
    terms: LTX2Guidance = LTX2Guidance()
    fps: float = 24.0  # the pipeline's frame_rate (motion_speed 1: the positions' rate too)
    layout: LTX2Layout | None = None
    first_frames: torch.Tensor | None = None  # with_images' latents (B, C, 1, h, w), for the next noise()
    train_fps: float | None = None  # data.fps: the training clips' frame rate (their positions in time)
    first_frame_p: float = 0.0  # train.first_frame_conditioning_p: a clip's chance to train image-to-video
    teacher_terms: LTX2Guidance = LTX2Guidance()  # a distillation's teacher's (cfg.distill's)


def original_name(name: str) -> str:
    """A module's name in the release's (ComfyUI's) spelling, from diffusers'."""
    for theirs, original in ORIGINAL_NAMES:
        if name.startswith(theirs):
            return original + name[len(theirs) :]
    return name


def _stg_blocks(parts) -> list:
    """The pipeline's STG blocks the transformer has."""
    return [b for b in STG_BLOCKS if b < len(parts.transformer.blocks)]


def rescale(guided, pred, amount: float):
    """diffusers' rescale_noise_cfg on (B, D) rows: the guided x0 scaled to the conditional one's std per
    sample, mixed by `amount`."""
    scaled = guided * (pred.std(dim=1, keepdim=True) / guided.std(dim=1, keepdim=True))
    return amount * scaled + (1 - amount) * guided


# why it takes neither PipeFusion nor either step cache
BOTH_STREAMS = "each block's sound attends every video token, which patches of the video do not hold"
FIRST_BLOCK = (
    "its blocks carry two streams, and the first block's video residual does not tell if the sound's moved"
)
PASSES = "its velocity is up to four passes a step (STG, modality isolation), which the replay does not fit"


def recorded_layout(parts, x) -> LTX2Layout:
    """The layout noise() recorded, checked against the latents' size."""
    if parts.layout is None or x.shape[1] != parts.layout.size:
        raise ValueError(f"LTX-2: latents of {tuple(x.shape)} are not the sampling's ({parts.layout})")
    return parts.layout


class PassGuidance(Guidance):
    """Its CFG guides above 1, as the default; its passes are guided in LTX2Steps (guide_in_x0), never by a
    formula on two velocities: a sampler that calls `guide` (PipeFusion's) fails here rather than guiding
    LTX-2 otherwise than its pipeline. A step is one pass without its audio CFG, STG, modality guidance
    and rescale (a distilled student's, as Lightricks' distilled model samples)."""

    student_terms = (
        ("audio_guidance", 1.0), ("modality_guidance", 1.0), ("guidance_rescale", 0.0), ("stg", 0.0)
    )  # fmt: skip

    def guide(self, v_cond, v_uncond, scale: float, parts=None):
        raise NotImplementedError("LTX-2 guides its passes in x0: LTX2Steps.guided (guide_in_x0)")


def guide_in_x0(parts: LTX2Parts, x, t, v_cond, v_uncond, v_stg, v_modality, scale: float):
    """The pipeline's guidance of its passes (conditional, unconditional, STG, modality-isolated; None
    where a pass does not run), per stream in x0 = x - sigma v: the conditional x0 plus the CFG delta
    (scale - 1)(cond - uncond) (the audio's at audio_guidance), the STG delta stg (cond - perturbed) and
    the modality delta (modality - 1)(cond - isolated), in that order, then rescaled towards the
    conditional x0's std (guidance_rescale > 0); back to a velocity."""
    terms, layout = parts.terms, recorded_layout(parts, x)
    size, t = layout.video_size, t.reshape(-1, 1)  # the step's sigma, or each sample's (a distillation's)
    x0 = lambda v: None if v is None else x - v * t  # noqa: E731
    passes = [x0(v) for v in (v_cond, v_uncond, v_stg, v_modality)]
    # the pipeline's audio_guidance_scale `or` guidance_scale: 0 means the video's
    scales = (scale, terms.audio_guidance or scale)
    out = []
    for rows, cfg_scale in zip((slice(0, size), slice(size, None)), scales):
        pred, uncond, stg, isolated = (p if p is None else p[:, rows] for p in passes)
        guided = pred
        if uncond is not None:
            guided = guided + (cfg_scale - 1) * (pred - uncond)
        if stg is not None:
            guided = guided + terms.stg * (pred - stg)
        if isolated is not None:
            guided = guided + (terms.modality_guidance - 1) * (pred - isolated)
        if terms.guidance_rescale > 0:
            guided = rescale(guided, pred, terms.guidance_rescale)
        out.append((x[:, rows] - guided) / t)
    if layout.given:  # the pipeline steps the frames after the given one only
        out[0][:, : math.prod(layout.grid[1:]) * layout.channels] = 0
    return torch.cat(out, dim=1)


class LTX2Steps(Steps):
    """Both streams' noise, one schedule, its passes (conditional, unconditional, STG, modality-isolated)
    guided per stream in x0 (guide_in_x0), and the video's and sound's decoding."""

    def noise(self, parts: LTX2Parts, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """What the pipeline draws from a generator seeded with seed, one video each: the video latents,
        then the audio latents (float32, both), packed; records the layout on parts."""
        vae, audio_vae = parts.vae, parts.audio_vae
        grid = ((frames - 1) // vae.temporal_compression_ratio + 1,)
        grid += (height // vae.spatial_compression_ratio, width // vae.spatial_compression_ratio)
        per_second = audio_vae.config.sample_rate / audio_vae.config.mel_hop_length
        per_second /= float(audio_vae.temporal_compression_ratio)
        layout = LTX2Layout(
            grid=grid,
            channels=vae.config.latent_channels,
            audio_frames=round(frames / parts.fps * per_second),  # the pipeline's audio_num_frames
            audio_channels=audio_vae.config.latent_channels,
            mel_bins=audio_vae.config.mel_bins // audio_vae.mel_compression_ratio,
        )
        first, parts.first_frames = parts.first_frames, None  # image-to-video's, taken once
        parts.layout = layout = replace(layout, given=first is not None)
        rows = []
        for i, seed in enumerate(seeds):
            generator = torch.Generator().manual_seed(seed)
            video = torch.randn((1, layout.channels, *grid), generator=generator)
            if first is not None:  # the pipeline's init * mask + noise * (1 - mask): the image's frame
                video[:, :, :1] = first[i : i + 1].to(video)
            shape = (1, layout.audio_channels, layout.audio_frames, layout.mel_bins)
            rows.append(layout.join(video, torch.randn(shape, generator=generator)))
        return torch.cat(rows)

    def schedule(self, parts: LTX2Parts, steps: int, latents: torch.Tensor) -> Schedule:
        """The pipeline's sigmas (linspace(1, 1/steps), shifted by mu of the video's token count, stretched
        to shift_terminal), shared by both streams; the transformer is told sigma (it scales it by 1000, as
        the scheduler's timesteps)."""
        # the video's tokens: the sampling's flat latents, or a video's (B, C, T, h, w) (a student's size)
        grid = latents.shape[2:] if latents.dim() == 5 else recorded_layout(parts, latents).grid
        tokens = math.prod(grid)
        levels = sigmas(steps, tokens, parts.scheduler_config).to(latents.device)
        return Schedule(levels, levels[:-1], euler(levels))

    def walk(self, parts: LTX2Parts, schedule: Schedule, noise, velocity, progress=None):
        if parts.cache is not None:  # its velocity is several passes: the step cache's hooks do not fit
            raise ValueError(f"sample.cache={parts.cache.method}: LTX-2 samples without a step cache")
        return super().walk(parts, schedule, noise, velocity, progress)

    def one_pass(self, parts: LTX2Parts, x, t, cond: LTX2Cond, **options):
        """One transformer pass on the flat latents -> the flat velocity in float32 (the pipeline's)."""
        layout = recorded_layout(parts, x)
        t = t.to(x.device).expand(x.shape[0])
        if layout.given:  # the given frame's tokens at sigma 0 (the pipeline's per-token video timestep)
            given = torch.zeros(layout.grid, device=x.device)
            given[0] = 1
            cond = replace(cond, video_t=t.float()[:, None] * (1 - given.flatten())[None])
        video, audio = parts.transformer(*layout.split(x), t, cond, **options)
        return layout.join(video.float(), audio.float())

    def guided(self, guidance, parts: LTX2Parts, x, t, cond, uncond, scale: float):
        """Its passes on the conditioning and the unconditional one, guided in x0 (guide_in_x0)."""
        v_uncond = self.one_pass(parts, x, t, uncond)
        return self._guide(parts, x, t, self._conditional(parts, x, t, cond), v_uncond, scale)

    def _guide(self, parts: LTX2Parts, x, t, conditional: list, v_uncond, scale: float):
        """guide_in_x0 of `_conditional`'s velocities and the unconditional one (None: no CFG)."""
        passes = dict(zip(self._conditional_passes(parts), conditional))
        others = self._stg_and_modality(parts, passes)
        return guide_in_x0(parts, x, t, passes["cond"], v_uncond, *others, scale)

    def _conditional_passes(self, parts: LTX2Parts) -> list:
        """The passes on the conditioning a step runs: the conditional one, the STG one where the
        transformer's perturbed_attn (False in LTX-2.0's release: diffusers then ignores the STG blocks)
        and STG blocks make it differ (else the conditional velocity stands for it, the same result with
        one pass fewer), the modality-isolated one."""
        terms = parts.terms
        stg = terms.stg > 0 and parts.transformer.perturbed_attn and _stg_blocks(parts)
        return ["cond", *(["stg"] if stg else []), *(["modality"] if terms.modality_guidance > 1 else [])]

    def _conditional(self, parts: LTX2Parts, x, t, cond) -> list:
        """The velocities of `_conditional_passes`, in order."""
        stg, modality = dict(stg_blocks=_stg_blocks(parts)), dict(isolate_modalities=True)
        options = dict(cond={}, stg=stg, modality=modality)
        return [self.one_pass(parts, x, t, cond, **options[name]) for name in self._conditional_passes(parts)]

    def _stg_and_modality(self, parts: LTX2Parts, passes: dict) -> tuple:
        """(STG's velocity, the modality-isolated one), each None where the step does not use it."""
        stg = passes.get("stg", passes["cond"]) if parts.terms.stg > 0 else None
        return stg, passes.get("modality")

    def branch_passes(self, parts: LTX2Parts, x, t, cond, conditional: bool) -> torch.Tensor:
        """Under cfg=2: the conditional branch runs its passes on the conditioning (the conditional, STG,
        modality-isolated ones), the negative branch its one pass, padded with zeros to as many."""
        if conditional:
            return torch.stack(self._conditional(parts, x, t, cond))
        v = self.one_pass(parts, x, t, cond)
        return torch.cat([v[None], v.new_zeros(len(self._conditional_passes(parts)) - 1, *v.shape)])

    def guide_passes(self, guidance, parts: LTX2Parts, x, t, conditional, unconditional, scale: float):
        # a step that does not guide: as `velocity` (never, at one scale a walk)
        v_uncond, scale = (unconditional[0], scale) if guidance.guided(scale) else (None, 1.0)
        return self._guide(parts, x, t, list(conditional), v_uncond, scale)

    def velocity(self, parts: LTX2Parts, x, t, cond):
        """Without CFG: STG and modality guidance still apply, as in the pipeline."""
        if parts.terms.audio_guidance > 1:
            raise ValueError(
                f"sample.audio_guidance={parts.terms.audio_guidance} without the video's CFG (guidance at "
                "most 1): set sample.audio_guidance=1"
            )
        return self._guide(parts, x, t, self._conditional(parts, x, t, cond), None, 1.0)

    def decode(self, parts: LTX2Parts, latents) -> torch.Tensor:
        """The video (B, 3, T, H, W): the latents denormalised with the VAE's latents_mean, latents_std and
        scaling_factor, decoded one sample at a time. A timestep-conditioned VAE is told the pipeline's
        default decode_timestep 0, whose noise scale 0 leaves the latents as they are."""
        vae = parts.vae
        video, _ = recorded_layout(parts, latents).split(latents)
        # the pipeline's cast to the text's dtype: the connectors' (precomputed latents free the text encoder)
        z = video.to(parts.connectors.dtype)
        view = (1, -1, 1, 1, 1)
        mean, std = (b.view(view).to(z.device, z.dtype) for b in (vae.latents_mean, vae.latents_std))
        z = (z * std / vae.config.scaling_factor + mean).to(vae.dtype)
        timestep = (
            torch.zeros(1, device=z.device, dtype=z.dtype) if vae.config.timestep_conditioning else None
        )
        return torch.cat([vae.decode(v[None], timestep, return_dict=False)[0] for v in z])

    def decode_audio(self, parts: LTX2Parts, latents) -> tuple:
        """(waveforms (B, channels, samples) float32, the vocoder's output_sampling_rate): the packed audio
        latents denormalised with the audio VAE's latents_mean / latents_std, decoded to a mel spectrogram,
        which the vocoder turns into sound; one sample at a time."""
        layout, audio_vae = recorded_layout(parts, latents), parts.audio_vae
        packed = latents[:, layout.video_size :].unflatten(1, (layout.audio_frames, -1))  # (B, L, C_a M)
        mean, std = (
            b.to(packed.device, packed.dtype) for b in (audio_vae.latents_mean, audio_vae.latents_std)
        )
        audio = (packed * std + mean).unflatten(2, (-1, layout.mel_bins)).transpose(1, 2).to(audio_vae.dtype)
        mels = [audio_vae.decode(a[None], return_dict=False)[0] for a in audio]
        waves = torch.cat([parts.vocoder(mel.to(parts.vocoder.dtype)) for mel in mels])
        return waves.float(), int(parts.vocoder.config.output_sampling_rate)


class LTX2(Family):
    name, title = "ltx2", "LTX-2"
    pipeline_classes = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    transformer_classes = (TRANSFORMER_CLASS,)
    vae_class, max_length = "AutoencoderKLLTX2Video", 1024
    conditioning = LTX2Cond
    # the video split, the audio whole on every rank; cfg=2: the conditional branch's passes (conditional,
    # STG, modality-isolated) on one half, the negative one on the other. data.audio=true trains video and
    # sound; false: the video alone, the audio frozen. --image: LTX2ImageToVideoPipeline's first frame
    capabilities = Capabilities(
        parallel=("cfg", "ulysses", "ring"),
        first_block=False,
        calibrated_cache=False,
        image_to_video=True,
        trains_audio=True,
        samples_audio=True,
        reasons=dict(
            pipefusion=BOTH_STREAMS,
            first_block=FIRST_BLOCK,
            calibrated_cache=PASSES,
            tasks="is train.first_frame_conditioning_p: each clip's chance to be given its first frame",
        ),
    )
    # a LoRA's default layers: both streams' attentions (self, text, audio-to-video, video-to-audio) and
    # feed-forwards; the video's alone with data.audio=false (default_lora_targets)
    lora_targets = tuple(
        f"blocks.*.{m}.*"
        for m in ("attn1", "attn2", "ff", "audio_attn1", "audio_attn2", "audio_ff")
        + ("audio_to_video_attn", "video_to_audio_attn")
    )
    # the release's single file read; LoRAs without alphas, as Lightricks' trainer writes them (diffusers'
    # LTX-2 loader refuses them)
    names = Names(
        from_original=diffusers_from_release,
        renames_only=True,  # its release file (43 GB, VAEs and vocoder too) read by name, each rank its rows
        lora_formats=("diffusers", "comfyui"),
        lora_alphas=False,
    )
    steps = LTX2Steps()  # its passes, guided per stream in x0 (guide_in_x0)
    guidance = PassGuidance()
    objective = LTX2Objective()  # a sigma per stream, the sum of their losses (models/ltx2/training.py)

    def check_pretrained(self, cfg) -> None:
        super().check_pretrained(cfg)
        for part, wanted in PARTS.items():
            folder = part_folder(cfg, part)
            if not any(folder.glob(wanted)):
                raise FileNotFoundError(
                    f"model.pretrained: no {self.title} {part} in {folder} ({wanted} missing; part of the "
                    "pipeline folder; tessera never downloads)"
                )

    def check_guidance(self, cfg, guidance: float) -> None:
        """Audio CFG without the video's (guidance at most 1) is refused: the pipeline would run the
        unconditional pass for the audio alone, which tessera's loop (guided at the video's scale) lacks."""
        terms = guidance_terms(cfg.sample)
        if guidance <= 1.0 and terms.audio_guidance > 1.0:
            raise ValueError(
                f"sample.audio_guidance={terms.audio_guidance} with guidance {guidance} (--guidance, else "
                "sample.guidance): LTX-2's audio CFG runs with the video's here; set sample.audio_guidance=1 "
                "(or the guidance above 1)"
            )

    def check_scheduler(self, config: dict) -> None:
        wrong = [key for key in UNSUPPORTED if config.get(key)]
        if config.get("num_train_timesteps", 1000) != 1000:  # the transformer is told 1000 sigma
            wrong.append(f"num_train_timesteps={config['num_train_timesteps']}")
        if config.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            wrong.append(f"time_shift_type={config['time_shift_type']}")
        self.refuse_scheduler(config, wrong, "'s Euler steps")

    def _strides(self, cfg) -> tuple:
        """(temporal, spatial) pixels per video latent, as AutoencoderKLLTX2Video derives them."""
        c = read_json(part_folder(cfg, "vae") / "config.json")
        scaled = 2 ** sum(c.get("spatio_temporal_scaling", (True,) * 4))
        temporal = c.get("temporal_compression_ratio") or c.get("patch_size_t", 1) * scaled
        return temporal, c.get("spatial_compression_ratio") or c.get("patch_size", 4) * scaled

    def widths(self, cfg) -> list:
        """The video VAE's latents and Gemma's hidden states, as its transformer takes them (the sound's
        latents are checked against the audio VAE where training encodes them: check_audio_vae)."""
        t, vae, text = self.transformer_config(cfg), config_of(cfg, "vae"), config_of(cfg, "text_encoder")
        return [("in_channels", t.get("in_channels"), "the video VAE's latent_channels",
                 vae.get("latent_channels")),
                ("caption_channels", t.get("caption_channels"), "the text encoder's hidden_size",
                 text.get("hidden_size"))]  # fmt: skip

    def latent_space(self, cfg):
        from models.vae import LatentSpace

        space = LatentSpace()
        space.latent_channels = read_json(part_folder(cfg, "vae") / "config.json").get("latent_channels", 128)
        space.temporal_stride, space.spatial_stride = self._strides(cfg)
        space.causal = True
        return space

    def vae_scale(self, cfg) -> int:
        return self._strides(cfg)[1]

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        temporal, _ = self._strides(cfg)
        if height % 32 or width % 32:  # the pipeline's own check_inputs
            raise ValueError(f"--height {height} --width {width}: {self.title} samples multiples of 32")
        if (frames - 1) % temporal:  # the pipeline would decode another count than asked
            raise ValueError(f"--frames {frames}: {self.title} samples 1 + a multiple of {temporal} frames")

    def build(self, config: dict, cfg):
        return build_transformer(config, cfg.model.attention_backend)

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> LTX2Parts:
        import transformers
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
        from diffusers.pipelines.ltx2 import LTX2TextConnectors, vocoder

        # the folder's model_index.json names the text encoder's and the vocoder's classes, as the pipeline
        # loads them (LTX-2.0: Gemma3ForConditionalGeneration, LTX2Vocoder)
        index = read_json(Path(part_folder(cfg, "connectors")).parent / "model_index.json")
        encoder_class = getattr(
            transformers, index.get("text_encoder", [0, "Gemma3ForConditionalGeneration"])[1]
        )
        vocoder_class = getattr(vocoder, index.get("vocoder", [0, "LTX2Vocoder"])[1])
        model = self.load_transformer(cfg, dtype, keep) if transformer else None
        loaded = [
            encoder_class.from_pretrained(part_folder(cfg, "text_encoder"), dtype=dtype) if texts else None,
            AutoencoderKLLTX2Video.from_pretrained(part_folder(cfg, "vae"), dtype=dtype),
            LTX2TextConnectors.from_pretrained(part_folder(cfg, "connectors"), dtype=dtype),
            AutoencoderKLLTX2Audio.from_pretrained(part_folder(cfg, "audio_vae"), dtype=dtype),
            vocoder_class.from_pretrained(part_folder(cfg, "vocoder"), dtype=dtype),
        ]
        encoder, vae, connectors, audio_vae, voc = (
            m and m.eval().to(device).requires_grad_(False) for m in loaded
        )
        model = model and model.to(device)  # load_transformer's: frozen already
        tokenizer = prepare_tokenizer(
            transformers.AutoTokenizer.from_pretrained(part_folder(cfg, "tokenizer"))
        )
        return LTX2Parts(
            model,
            tokenizer,
            encoder,
            vae,
            read_json(part_folder(cfg, "scheduler") / "scheduler_config.json"),
            connectors=connectors,
            audio_vae=audio_vae,
            vocoder=voc,
            terms=guidance_terms(cfg.sample),
            teacher_terms=guidance_terms(cfg.distill),
            fps=float(cfg.sample.fps),
            train_fps=cfg.data.fps,
            first_frame_p=cfg.train.first_frame_conditioning_p,
        )

    def projections(self, model) -> tuple[dict, dict]:
        """Family.projections, with the release's names (ComfyUI's LoRA keys) beside diffusers'."""
        from models.lora_formats import model_projections

        projections, linears = model_projections(model, self.names.diffusers_name)
        originals = {
            module: [replace(p, original=original_name(p.diffusers)) for p in found]
            for module, found in projections.items()
        }
        return originals, linears

    def default_lora_targets(self, cfg) -> tuple:
        if cfg.data.audio:
            return self.lora_targets
        return tuple(t for t in self.lora_targets if not is_audio_parameter(t))

    def check_training(self, cfg) -> None:
        """Its positions in time are in seconds, and a bucket's sound must have one length: data.fps. Its
        sigmas are Lightricks' (models/ltx2/training.py): a flow.* key set otherwise is refused by name; a
        first-frame chance outside [0, 1] and previews' first frames (sample.images) too."""
        changed = [f"flow.{k}={cfg.flow[k]}" for k, v in FLOW_DEFAULTS.items() if cfg.flow[k] != v]
        if changed:
            raise ValueError(
                f"{', '.join(changed)}: {self.title} draws each stream's sigma from the shifted logit-normal "
                "of its own trainer (docs/ltx2_training.md), which no flow.* key changes; unset it"
            )
        if cfg.sample.images:  # read by no preview: refused rather than left unread
            raise ValueError(
                f"sample.images={list(cfg.sample.images)}: {self.title}'s training previews sample from text "
                "alone (first-frame previews are not built); sample from a first frame with infer.py "
                "--checkpoint RUN --image FILE, and unset sample.images"
            )
        chance = cfg.train.first_frame_conditioning_p
        if not 0 <= chance <= 1:
            raise ValueError(
                f"train.first_frame_conditioning_p={chance}: a clip's chance to be given its first frame is "
                "between 0 and 1 (Lightricks' trainer's default 0.1)"
            )
        if not cfg.data.fps:
            raise ValueError(
                f"data.fps is unset: {self.title} trains on clips at a known frame rate (its positions in "
                "time are in seconds, and each bucket's sound one length); set data.fps (24 as released)"
            )
        if cfg.data.audio:
            self.check_audio_vae(cfg)

    def check_audio_vae(self, cfg) -> None:
        """The audio VAE's encoder halves time and mel bins at each level but its last (ch_mult); its
        class, the pipeline and the loss take 4x (diffusers' LATENT_DOWNSAMPLE_FACTOR), so a folder whose
        encoder compresses otherwise would train on latents of another length: refused, naming both."""
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

        config = read_json(part_folder(cfg, "audio_vae") / "config.json")
        levels = len(config.get("ch_mult", (1, 2, 4)))  # diffusers' default
        encoded, assumed = 2 ** (levels - 1), LATENT_DOWNSAMPLE_FACTOR
        if encoded != assumed:
            raise ValueError(
                f"{part_folder(cfg, 'audio_vae')}: its encoder compresses the sound {encoded}x in time (its "
                f"ch_mult has {levels} level{'s' * (levels > 1)}), and {self.title}'s audio latents are "
                f"{assumed}x (the release's): this audio VAE is not LTX-2's; use the release's folder, or "
                "data.audio=false"
            )

    def sound_format(self, cfg) -> tuple:
        c = read_json(part_folder(cfg, "audio_vae") / "config.json")
        return c.get("sample_rate", 16000), c.get("in_channels", 2)

    def training_record(self, cfg) -> dict:
        return {
            "data.audio": bool(cfg.data.audio)
        }  # false: the audio parameters frozen, out of the optimizer

    def trains_parameter(self, cfg, name: str) -> bool:
        return bool(cfg.data.audio) or not is_audio_parameter(name)

    def encode_images(self, parts: LTX2Parts, images: torch.Tensor) -> torch.Tensor:
        """Videos -> the video VAE's posterior mode, normalised as the pipeline's _normalize_latents (its
        scaling_factor too), float32; one video at a time."""
        vae = parts.vae
        with torch.no_grad():
            z = torch.cat([vae.encode(v[None].to(vae.dtype)).latent_dist.mode() for v in images]).float()
        view = (1, -1, 1, 1, 1)
        mean, std = (b.view(view).to(z) for b in (vae.latents_mean, vae.latents_std))
        return (z - mean) * vae.config.scaling_factor / std

    def encode_clips(self, parts: LTX2Parts, videos, sound, cond, given=(None, None)) -> tuple:
        """The video latents; with the clips' sound, its normalised audio latents on cond.audio_x0."""
        if sound is not None:
            cond = replace(cond, audio_x0=encode_sound(parts.audio_vae, sound))
        return self.encode_images(parts, videos), cond

    def store_conditioning(self, cond: LTX2Cond) -> list[dict]:
        """Each sample's texts and mask whole (padded on the left to text_encoder.max_length, which Gemma's
        positions count), and its audio latents with data.audio."""
        kept = ("text", "audio_text", "text_mask", "audio_text_mask", "audio_x0")
        rows = {name: getattr(cond, name) for name in kept if getattr(cond, name) is not None}
        return [{name: value[i] for name, value in rows.items()} for i in range(len(cond.text))]

    def load_conditioning(self, stored: list, max_length: int) -> LTX2Cond:
        tensors = {name: torch.stack([s[name] for s in stored]) for name in stored[0]}
        for name in ("text_mask", "audio_text_mask"):  # stored as float32: the connectors' 0/1 mask
            tensors[name] = tensors[name].long()
        return LTX2Cond(**tensors)

    def encode(self, parts: LTX2Parts, prompts: list, max_length: int, negative: bool = False) -> LTX2Cond:
        return encode_prompts(
            prompts,
            parts.tokenizer,
            parts.text_encoder,
            parts.connectors,
            max_length or self.max_length,
            parts.fps,
        )

    def takes_images(self, cfg) -> bool:
        return True  # one set of weights samples from text, or from a first frame and text

    def needs_images(self, cfg) -> bool:
        return False

    def with_images(self, parts: LTX2Parts, images: list, size: tuple, *conds, last_images=None) -> tuple:
        """LTX2ImageToVideoPipeline's first frames: each image re-compressed as its training's were (H.264 at
        the text encoder generation's CRF), resized to the video, encoded (the posterior's mode) and
        normalised; noise() puts them on the first latent frame. The conditionings are unchanged."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        _, height, width = size
        vae, crf = parts.vae, resolve_default_image_crf(parts.text_encoder)
        processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear")
        first = []
        for image in images:
            if crf != 0:
                if not all(2 <= side <= X264_LARGEST for side in image.size):
                    # what libx264 cannot encode (the pipeline fails on it: IndexError below 2 px, an
                    # encoder error above 16,384): resized to the video first, as the processor would after
                    image = image.convert("RGB").resize((width, height), Image.BILINEAR)
                image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
            pixels = processor.preprocess(image, height=height, width=width)  # (1, 3, H, W) in [-1, 1]
            pixels = pixels.to(vae.device, parts.text_encoder.dtype).to(vae.dtype)  # the pipeline's casts
            with torch.no_grad():
                first.append(vae.encode(pixels.unsqueeze(2)).latent_dist.mode())
        z = torch.cat(first).float()
        view = (1, -1, 1, 1, 1)
        mean, std = (b.view(view).to(z) for b in (vae.latents_mean, vae.latents_std))
        parts.first_frames = (z - mean) / std  # the pipeline normalises at scaling factor 1
        return conds
