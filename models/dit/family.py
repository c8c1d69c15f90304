"""tessera's own DiT as a family (models/family.py): it reads Wan 2.1 / 2.2 folders
(models/dit/transformer.py, models/dit/wan.py) and samples through models/sampler.py as every family does.
What is its own: the text is its T5 encoder's (models/text_encoder.py), the schedule is models/flow.py's with
the step cache behind it, the two guidance branches run as one batch, image-to-video's condition goes into
each call (models/image_condition.py), Wan 2.2 A14B's two experts take turns, and it computes under autocast.
It trains through the family hooks too: its frozen parts (`load`), the image condition carried as
tensor fields of its conditioning, each clip encoded in the tiles a decode uses, its loss, and its stored
conditioning (the fixed-length text of its precomputed latents). Its transformer is filled for sampling by
parallel/drive/family_sampling.py (a Wan folder, a tessera run or train.seed), as every family's.
"""

import contextlib
import warnings
from dataclasses import dataclass, replace

import torch

from models import tiling
from models.capabilities import Capabilities
from models.family import Components, Family, config_of
from models.guidance import Guidance
from models.image_condition import ConditionedModel, ConditionedPieces, ImageCondition
from models.loading import Loading
from models.loop import Schedule
from models.names import Names
from models.objective import Objective
from models.step_cache import FirstBlockFamily
from models.steps import Steps


@dataclass
class DiTText:
    """The DiT's conditioning: the encoded prompts (B, L, D) and their mask (B, L); in training,
    image-to-video's condition of each clip (models/image_condition.py ImageCondition's latent and CLIP
    features), fields so that they travel between ranks with the text."""

    text: torch.Tensor
    text_mask: torch.Tensor
    image: torch.Tensor | None = None  # (B, 4 + C, t, h, w): the mask's channels and the given frames'
    image_features: torch.Tensor | None = None  # (B x images, tokens, width), or None


@dataclass
class Experts:
    """Wan 2.2 A14B's second expert: `low` samples the steps below the boundary at guidance_2, the first
    one the others; only the sampling one is on the device (14B each): they swap at the boundary, and back
    when the next sampling starts (DiTSteps.context)."""

    low: torch.nn.Module
    boundary: float
    guidance_2: float

    def high_noise(self, t) -> bool:  # as diffusers: the high-noise expert while t >= boundary x 1000
        return bool(t * 1000 >= self.boundary * 1000)

    @staticmethod
    def on_device(active, idle, device):
        if next(active.parameters()).device != device:
            idle.to("cpu")
            active.to(device)
        return active


@dataclass
class DiTParts(Components):
    """The DiT's parts for one sampling: `text_encoder` is models/text_encoder.py's, `vae` a
    models/vae.py LatentSpace."""

    flow: object = None  # models/flow.py RectifiedFlow: its schedule and step cache
    condition: object = None  # image-to-video's models/image_condition.py ImageCondition, or None
    autocast: object = None  # the dtype the model computes in under autocast, or None
    experts: Experts | None = None
    device: object = None  # where the sampling runs (under train.cpu_offload the weights stay on the CPU)
    task: str = "t2v"  # model.task
    image: tuple | None = None  # image-to-video's (last frame too?, CLIP encoder or None): image_inputs


def meta_dit(cfg):
    """The recipe's DiT on the meta device, before any component is loaded (the encoder's width from its
    config.json): names and shapes, to check a recipe or a LoRA file before start-up."""
    from models.dit.transformer import build_dit
    from models.text_encoder import text_encoder_dim
    from models.vae import vae_latent_space

    with torch.device("meta"):
        return build_dit(
            cfg.model,
            in_channels=vae_latent_space(cfg.vae).latent_channels,
            text_dim=text_encoder_dim(cfg.text_encoder),
        )


class DiTObjective(Objective):
    """The flow's loss on the DiT's velocity, under image-to-video's condition (TI2V's given frame kept
    out of the loss)."""

    def loss(self, parts, flow, model, x0, cond, noise, t) -> torch.Tensor:
        condition = self.condition(parts, x0, cond)
        if condition is not None:
            model = ConditionedModel(model, condition)
        from_frame = 1 if condition is not None and condition.first_frame else 0  # the given frame: no loss
        return flow.training_loss(model, x0, cond.text, cond.text_mask, noise, t, from_frame=from_frame)

    def condition(self, parts, x0, cond) -> ImageCondition | None:
        """TI2V: each clip's own first latent frame, given at t = 0; I2V / FLF2V: the clips' condition."""
        if parts.task == "ti2v":
            return ImageCondition(x0[:, :, :1], None, first_frame=True)
        return None if cond.image is None else ImageCondition(cond.image, cond.image_features)

    def velocity(self, parts, model, x, sigma, cond):
        return model(x, sigma, cond.text, cond.text_mask)

    def check_distillation(self, cfg) -> None:
        """Text-to-video, one model: a given frame would have to stay given through the student's steps,
        and one expert samples only part of the schedule the student walks."""
        if cfg.model.task != "t2v":
            raise ValueError(
                f"train.objective=dmd distils text-to-video; model.task={cfg.model.task} (a given first "
                "frame) is not built: set model.task=t2v"
            )
        if cfg.model.expert != "none":
            raise ValueError(
                f"train.objective=dmd with model.expert={cfg.model.expert}: one Wan 2.2 expert samples part "
                "of the noise levels, and a few-step student walks all of them: distil a one-model recipe"
            )


class DiTGuidance(Guidance):
    """Diffusers' Wan pipelines guide at any scale but 1; Wan 2.2's low-noise expert at its own scale."""

    def guided(self, scale: float) -> bool:
        return scale != 1.0

    def at(self, parts, t, scale: float) -> float:
        experts = parts.experts
        return scale if experts is None or experts.high_noise(t) else experts.guidance_2


class DiTSteps(Steps):
    """tessera's DiT's: its flow's schedule and walk, Wan 2.2's experts, the image condition on every call,
    both branches as one batch, the decoding in tiles."""

    def noise(self, parts: DiTParts, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        shape = parts.vae.latent_shape(frames, height, width, parts.flow.patch_size)
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])

    def schedule(self, parts: DiTParts, steps: int, latents: torch.Tensor) -> Schedule:
        return parts.flow.schedule(parts.flow.sigmas(latents, steps))

    @contextlib.contextmanager
    def context(self, parts: DiTParts):
        """A sampling's: the step cache on the flow (its walk and PipeFusion's plan read it there), Wan 2.2's
        high-noise expert on the device (the experts swap at the boundary), and the autocast."""
        parts.flow.cache = parts.cache
        if parts.experts is not None:
            Experts.on_device(parts.transformer, parts.experts.low, parts.device)
        if parts.autocast is None:
            yield
            return
        with torch.autocast(parts.device.type, dtype=parts.autocast):
            yield

    def walk(self, parts: DiTParts, schedule: Schedule, noise, velocity, progress=None):
        return parts.flow.walk(schedule, noise, velocity, progress)

    def model_at(self, parts: DiTParts, t):
        """The transformer that samples timestep `t` (one of Wan 2.2's experts, moved to the device)."""
        model, experts = parts.transformer, parts.experts
        if experts is not None:
            pair = (model, experts.low) if experts.high_noise(t) else (experts.low, model)
            model = experts.on_device(*pair, parts.device)
        return model

    def patch_pieces(self, parts: DiTParts, cond=None):
        """Its transformer's, with the image condition when there is one."""
        if parts.condition is None:
            return parts.transformer
        return ConditionedPieces(parts.transformer, parts.condition)

    def first_block(self, parts: DiTParts, t):
        """sample.cache=first_block's caller of the branches at `t` (FirstBlockFamily over the patch pieces
        of the expert at t), or None without that cache."""
        cache = parts.cache
        if cache is None or cache.method != "first_block":
            return None
        return FirstBlockFamily(self.patch_pieces(replace(parts, transformer=self.model_at(parts, t))), cache)

    def conditioned(self, parts: DiTParts, t):
        """The transformer at `t` called as model(x, t, y, y_mask), with the image condition if any."""
        model = self.model_at(parts, t)
        return model if parts.condition is None else ConditionedModel(model, parts.condition)

    def velocity(self, parts: DiTParts, x, t, cond: DiTText):
        cached = self.first_block(parts, t)
        if cached is not None:
            return cached(x, t.expand(x.shape[0]), cond)[0]
        return self.conditioned(parts, t)(x, t.expand(x.shape[0]), cond.text, cond.text_mask)

    def both(self, parts: DiTParts, x, t, cond: DiTText, uncond: DiTText) -> tuple:
        """Both branches as one batch of 2B (the conditional one first); under the first-block cache, each
        branch in turn with one decision over both."""
        cached = self.first_block(parts, t)
        if cached is not None:
            return tuple(cached(x, t.expand(x.shape[0]), cond, uncond))
        text, mask = torch.cat([cond.text, uncond.text]), torch.cat([cond.text_mask, uncond.text_mask])
        v = self.conditioned(parts, t)(torch.cat([x, x]), t.expand(text.shape[0]), text, mask)
        return v.chunk(2)

    def finish(self, parts: DiTParts, latents):
        condition = parts.condition
        if condition is not None and condition.first_frame:  # TI2V: the given frame's latent, as diffusers
            latents = torch.cat([condition.latent.to(latents.dtype), latents[:, :, 1:]], dim=2)
        return latents

    def decode(self, parts: DiTParts, latents) -> torch.Tensor:
        """In the recipe's tiles (vae.tile_latent, vae.tile_overlap), on this device."""
        return tiling.decode(parts.vae, latents.float(), parts.vae.tile_latent, parts.vae.tile_overlap)


class DiTFamily(Family):
    name, title = "dit", "tessera's DiT (Wan 2.1 / 2.2)"
    steps = DiTSteps()
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    transformer_classes = ("WanTransformer3DModel", "WanModel")  # diffusers', Wan-AI's own config.json
    conditioning = DiTText
    objective = DiTObjective()  # under image-to-video's condition
    guidance = DiTGuidance()
    # Wan's names; a DiT without Wan's architecture: tessera's own (projections)
    names = Names(lora_formats=("diffusers", "comfyui"))
    # Wan 2.2 A14B's high- and low-noise experts (model.expert); the tasks of Wan's releases
    # masks_through_kernel: its self-attention takes SDPA with a mask where keys are padded
    capabilities = Capabilities(
        tasks=("t2v", "i2v", "flf2v", "ti2v"), expert_pair=True, masks_through_kernel=False
    )

    def meta_transformer(self, cfg):
        return meta_dit(cfg)

    def projections(self, model) -> tuple[dict, dict]:
        """Wan's names when the DiT has Wan's architecture options, tessera's own otherwise."""
        from models.lora_formats import model_projections

        return model_projections(model)

    def geometry(self, cfg) -> tuple:
        """Its VAE's latent space (recipe's vae.*) and model.patch_size."""
        from models.vae import vae_latent_space

        return vae_latent_space(cfg.vae), tuple(cfg.model.patch_size)

    def encode(self, parts: DiTParts, prompts: list, max_length: int, negative: bool = False) -> DiTText:
        return DiTText(*parts.text_encoder(prompts, parts.device))

    def takes_images(self, cfg) -> bool:
        return cfg.model.task != "t2v"

    def needs_images(self, cfg) -> bool:
        return cfg.model.task in ("i2v", "flf2v")

    def sampling_images(self, cfg, given: tuple, count: int, size: tuple, sized: bool, say=None) -> tuple:
        """model.task's frames, at the size asked (read_images' checks and the CLIP folder's)."""
        names = ("--image", "--last-image", "--height", "--width")
        first, last = self._images(cfg, given, names, count, size, say, clip=bool(given[0]))
        return first, last, size[1], size[2]

    def _images(self, cfg, given, names, count, size, say, clip) -> tuple:
        """models/image_condition.py read_images on the task, the VAE and the video's size; with `clip`, a
        missing CLIP folder is named here, before any process group."""
        from models.image_condition import image_encoder_folder, read_images
        from models.vae import vae_latent_space

        vae = vae_latent_space(cfg.vae)
        multiple = tuple(vae.spatial_stride * p for p in cfg.model.patch_size[1:])
        images = read_images(cfg.model.task, given, names, count, *size, vae.temporal_stride, multiple, say)
        if clip and cfg.model.image_dim:
            image_encoder_folder(cfg)
        return images

    def with_images(self, parts: DiTParts, images: list, size: tuple, *conds, last_images=None) -> tuple:
        """Image-to-video's condition of the batch on `parts` (each call of the model takes it; `finish`
        puts TI2V's given frame back): the frames' latents, mask and CLIP features, as diffusers builds
        them."""
        from models.image_condition import sampling_condition

        encoder = parts.image[1] if parts.image is not None else None
        parts.condition = sampling_condition(
            parts.task, parts.vae, encoder, images, last_images, *size, parts.device
        )
        return conds

    def sampling_experts(self, cfg, guidance: float, random_weights: bool, loras: bool) -> tuple | None:
        """Wan 2.2 A14B's second expert as (folder, boundary, guidance_2), or None for one model; refused by
        name where the recipe cannot pair them."""
        from models.dit.wan import second_expert

        sc = cfg.sample
        folder, boundary = second_expert(cfg.model.pretrained, cfg.model.pretrained_2)
        if random_weights:
            if cfg.model.pretrained_2 or sc.guidance_2 is not None:
                raise ValueError(
                    "--random-weights samples one model: drop model.pretrained_2 and sample.guidance_2"
                )
            folder = None
        if folder is None:
            if sc.guidance_2 is not None or cfg.model.pretrained_2 or sc.boundary is not None:
                raise ValueError(
                    "sample.guidance_2, sample.boundary and model.pretrained_2 are for Wan 2.2's two "
                    "experts: model.pretrained has no transformer_2/ (drop them, or name the low-noise "
                    "expert in model.pretrained_2)"
                )
            return None
        boundary = sc.boundary if sc.boundary is not None else boundary
        if boundary is None or not 0 < boundary < 1:
            raise ValueError(
                f"two experts need the noise level where they switch: set sample.boundary (0.875 for Wan2.2 "
                f"T2V-A14B, 0.9 for I2V-A14B), got {boundary}"
            )
        if loras:
            raise ValueError("pairing LoRAs with Wan 2.2's two experts is not built yet: drop --lora")
        if (
            sc.cache != "none"
        ):  # a calibration or a residual would span the switch from one expert to the other
            raise ValueError(
                f"sample.cache={sc.cache} does not pair with two experts yet: set sample.cache=none"
            )
        guidance_2 = guidance if sc.guidance_2 is None else sc.guidance_2
        if guidance == 1.0:  # as diffusers: guidance_scale alone decides whether either expert is guided
            guidance_2 = 1.0
        return folder, boundary, guidance_2

    def pair_experts(self, parts: DiTParts, low, boundary: float, guidance_2: float) -> None:
        parts.experts = Experts(low, boundary, guidance_2)

    # -- training (train.py through parallel/drive/family_training.py, as every family)
    # --------------------------

    # its text encoder and VAE come from their own keys; float32 weights under autocast; its VAE in tiles
    loading = Loading(from_pretrained=False, float32_weights=True, tiled_vae=True)

    def resolve_size(self, cfg, error=ValueError) -> None:
        """model.size=auto: every architecture key from model.pretrained's Wan folder (models/dit/wan.py)."""
        from models.dit.wan import resolve_auto_size

        if cfg.model.size == "auto":
            resolve_auto_size(cfg, error)

    def check_size_keys(self, mc, error=ValueError) -> None:
        """One of its named sizes (models/dit/transformer.py DiT_models), whose width the heads divide."""
        from models.dit.transformer import DiT_models, size_of

        if mc.size not in DiT_models:
            raise error(f"'model.size' is '{mc.size}'; choose one of {', '.join(DiT_models)}")
        size = size_of(mc)
        if size["hidden_size"] % size["num_heads"]:
            raise error(
                f"model.hidden_size {size['hidden_size']} is not divisible by model.num_heads "
                f"{size['num_heads']} (model.size={mc.size} with model.hidden_size / model.num_heads)"
            )

    def run_transformer(self, cfg, architecture: dict):
        """The DiT of the recipe with the input channels and text width a checkpoint recorded (its encoders'
        folders need not be at hand)."""
        from models.dit.transformer import build_dit

        in_channels = architecture["in_channels"]
        if cfg.model.task not in ("t2v", "ti2v"):  # its input also takes the mask and the given frames
            in_channels = (in_channels - 4) // 2
        with torch.device("meta"):
            return build_dit(cfg.model, in_channels=in_channels, text_dim=architecture["text_dim"])

    def calibration_parts(self, cfg, fingerprint) -> dict:
        """Its text encoder and VAE as the recipe names them, and its flow's shift."""
        te, vae, flow = cfg.text_encoder, cfg.vae, cfg.flow
        return {
            "text_encoder": f"{te.kind} {te.pretrained or f'(tiny, seed {te.seed})'}",
            "vae": f"{vae.kind} {vae.pretrained or f'(tiny, seed {vae.seed})'}",
            "flow": f"shift {flow.shift:g} at {flow.shift_reference_tokens} reference tokens",
        }

    def check_export(self, cfg, model, pipeline: bool) -> None:
        from models.dit.wan_export import check_wan_export

        check_wan_export(cfg, model.architecture(), pipeline)

    def export_transformer(self, cfg, model):
        from models.dit.wan_export import wan_transformer

        return wan_transformer(model)

    def export_pipeline(self, cfg, transformer, second=None):
        from models.dit.wan_export import wan_pipeline

        return wan_pipeline(cfg, transformer, second)

    def heads(self, cfg) -> int:
        from models.dit.transformer import size_of

        return size_of(cfg.model)["num_heads"]

    def describe(self, cfg) -> str:
        return cfg.model.size

    def check_pretrained(self, cfg) -> None:
        """A Wan folder's config.json and every safetensors header (a tessera run is checked by
        parallel/build/components.py, which reads checkpoints); none: weights from train.seed."""
        if cfg.model.pretrained:  # widths reads the folder as check_wan_folder does: once
            self.check_widths(cfg)

    def widths(self, cfg) -> list:
        """A Wan folder's latents and text as its transformer takes them: the VAE's z_dim (its output; its
        input holds an image condition's channels too) and UMT5's d_model, where those keys name them. The
        folder read through WanWeights: its config.json and every safetensors header, or a WanFormatError
        naming the file."""
        from models.dit.wan import WanWeights

        heads = self.heads(cfg) if cfg.model.size != "auto" else cfg.model.num_heads  # a single file's
        t = WanWeights(cfg.model.pretrained, heads).config
        vae = config_of(cfg, "vae") if cfg.vae.pretrained else {}
        text = config_of(cfg, "text_encoder") if cfg.text_encoder.pretrained else {}
        return [("out_channels", t.get("out_channels"), "the VAE's z_dim", vae.get("z_dim")),
                ("text_dim", t.get("text_dim"), "the text encoder's d_model",
                 text.get("d_model"))]  # fmt: skip

    def check_sample_keys(self, cfg) -> None:
        """As every family's, and a warning where its text is padded otherwise than Wan's (train.py and
        infer.py both ask this first)."""
        super().check_sample_keys(cfg)
        if not meta_dit(cfg).text_mask and cfg.text_encoder.max_length != 512:
            warnings.warn(
                f"text_encoder.max_length={cfg.text_encoder.max_length} with unmasked text (model.text_mask "
                "false, as Wan): padding is attended, so the model sees other inputs than Wan's 512-token "
                "padding; set text_encoder.max_length=512 to match Wan",
                stacklevel=2,
            )

    def check_training_images(self, cfg, frame_counts, say=None) -> tuple:
        """Image-to-video: the buckets' clip lengths, the CLIP folder (if the model reads features) and the
        previews' (first, last) frames (PIL) from sample.images / sample.last_images; (None, None) for
        text-to-video."""
        fewest = {"i2v": 2, "flf2v": 5, "ti2v": 2}.get(cfg.model.task, 1)  # the given frames and one more
        if min(frame_counts) < fewest:
            raise ValueError(
                f"data.frame_counts: model.task={cfg.model.task} trains on clips of at least {fewest} "
                f"frames, got {min(frame_counts)}"
            )
        sc, data = cfg.sample, cfg.data
        size = (sc.frames or data.frames, sc.height or data.height, sc.width or data.width)
        given, names = (list(sc.images), list(sc.last_images)), ("sample.images", "sample.last_images")
        names += ("sample.height", "sample.width")
        return self._images(cfg, given, names, len(sc.prompts), size, say, clip=cfg.model.task != "t2v")

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> DiTParts:
        """Its frozen parts for training (transformer=False: train.py builds and shards the DiT): the text
        encoder and the VAE of their recipe keys (in their own dtypes), image-to-video's CLIP encoder, and
        the flow on the trained expert's timesteps."""
        if transformer:  # its weights come from a Wan folder, a tessera run or train.seed: parallel/ fills it
            raise NotImplementedError("tessera's DiT: parallel/drive/family_sampling.py sampling_transformer")
        from models.flow import RectifiedFlow, expert_timesteps
        from models.image_condition import image_inputs

        text_encoder, vae = frozen_parts(cfg, device, texts)
        timesteps = expert_timesteps(cfg.model.expert, cfg.sample.boundary)
        flow = RectifiedFlow(cfg.flow, tuple(cfg.model.patch_size), timesteps=timesteps)
        image = image_inputs(cfg, device)  # on every rank: the previews need the CLIP too (0.6B, float32)
        autocast = torch.bfloat16 if dtype == torch.bfloat16 else None  # float32 weights, bf16 compute
        return DiTParts(
            None,
            None,
            text_encoder,
            vae,
            flow=flow,
            autocast=autocast,
            device=device,
            task=cfg.model.task,
            image=image,
        )

    def open_weights(self, cfg, model, folder=None):
        """model.pretrained's (or `folder`'s: Wan 2.2's second expert) Wan weights, read lazily, once the
        recipe is seen to build the folder's architecture (a disagreement names the keys and the fix)."""
        from models.dit.transformer import (
            ARCHITECTURE_OPTIONS,
            DiT_models,
            architecture_differences,
            recipe_key,
        )
        from models.dit.wan import WanWeights

        pretrained = folder or cfg.model.pretrained
        ours = model.architecture()
        weights = WanWeights(pretrained, ours["num_heads"])  # a single file's heads: the recipe's
        theirs = weights.dit_kwargs
        differs = architecture_differences(ours, theirs)
        if not differs:
            return weights
        wrong = [f"{recipe_key(k)}: {k}={ours[k]!r}, the folder has {theirs[k]!r}" for k in differs]
        dims = ("depth", "hidden_size", "num_heads")
        value = lambda v: str(v).lower() if isinstance(v, bool) else list(v) if isinstance(v, tuple) else v  # noqa: E731
        options = ("patch_size", "qk_norm", "rope_theta", *ARCHITECTURE_OPTIONS)
        fixes = [f"model.{k}={value(theirs[k])}".replace(" ", "") for k in differs if k in options]
        if any(k in differs for k in dims):
            same = [
                n
                for n, size in DiT_models.items()
                if all(size.get(k) == theirs[k] for k in (*dims, "ffn_dim"))
            ]
            fixes = ([f"model.size={same[0]}"] if same else ["model.size=auto"]) + [
                f for f in fixes if not f.startswith("model.ffn_dim")
            ]
        hint = "; set " + " ".join(fixes) if fixes else ""
        raise ValueError(
            f"model.pretrained={pretrained} disagrees with the recipe: " + "; ".join(wrong) + hint
        )

    def with_preview_images(self, cfg, parts: DiTParts, images: tuple) -> DiTParts:
        """The parts that sample training's previews from check_training_images' (first, last) frames."""
        sc, data = cfg.sample, cfg.data
        size = (sc.frames or data.frames, sc.height or data.height, sc.width or data.width)
        # no autocast: the training model computes in FSDP2's mixed precision already
        parts = replace(parts, autocast=None)
        self.with_images(parts, images[0], size, last_images=images[1])
        return parts

    def given_frames(self, cfg) -> tuple:
        """I2V's first frame, FLF2V's first and last (TI2V's given frame is its clip's own first latent)."""
        return {"i2v": ("image",), "flf2v": ("image", "last_image")}.get(cfg.model.task, ())

    def encode_clips(self, parts: DiTParts, videos, sound, cond: DiTText, given=(None, None)) -> tuple:
        """The clips in the tiles precompute_latents.py uses (media and precomputed latents are the same
        latents), and image-to-video's condition of each clip from its first (and last) frame, or the
        frames its manifest line names (`given`); a dropped caption keeps its image."""
        from models.image_condition import condition_of_clips

        x0 = tiling.encode(parts.vae, videos, parts.vae.tile_latent, parts.vae.tile_overlap)
        if parts.image is not None:
            condition = condition_of_clips(parts.vae, parts.image[1], videos, parts.image[0], *given)
            cond = replace(cond, image=condition.latent, image_features=condition.features)
        return x0, cond

    def empty_conditioning(self, parts: DiTParts, max_length: int) -> dict:
        """The empty prompt whole, as its text encoder gives it (padding included: an unmasked DiT attends
        it), for a latents folder, which stores its captions' real tokens only."""
        cond = self.encode(parts, [""], max_length)
        return {"text": cond.text[0].cpu(), "text_mask": cond.text_mask[0].cpu()}

    def store_conditioning(self, cond: DiTText) -> list[dict]:
        """Each sample's real tokens (as every family keeps them), and image-to-video's condition
        ("condition": (4 + C, t, h, w)) and CLIP features ("image_features": (images, tokens, width))."""
        stored = super().store_conditioning(DiTText(cond.text, cond.text_mask))
        features = cond.image_features
        if features is not None:  # (B x images, ...) -> per sample
            features = features.view(len(stored), -1, *features.shape[1:])
        for i, sample in enumerate(stored):
            if cond.image is not None:
                sample["condition"] = cond.image[i]
            if features is not None:
                sample["image_features"] = features[i]
        return stored

    def load_conditioning(self, stored: list, max_length: int) -> DiTText:
        """Each sample's real tokens zero-padded to text_encoder.max_length (the empty prompt: whole), with
        image-to-video's stored condition and CLIP features."""
        text = torch.zeros(len(stored), max_length, stored[0]["text"].shape[-1])
        mask = torch.zeros(len(stored), max_length, dtype=torch.bool)
        for i, s in enumerate(stored):
            tokens = s["text"][:max_length]
            text[i, : len(tokens)] = tokens
            mask[i, : len(tokens)] = s["text_mask"][:max_length] if "text_mask" in s else True
        image = torch.stack([s["condition"] for s in stored]) if "condition" in stored[0] else None
        features = None
        if "image_features" in stored[0]:  # (images, tokens, width) each
            features = torch.stack([s["image_features"] for s in stored]).flatten(0, 1)
        return DiTText(text, mask, image, features)


def frozen_parts(cfg, device, texts: bool = True) -> tuple:
    """The text encoder (texts=False: None) and the VAE of the recipe (frozen, on `device`); the VAE carries
    its decode tiles."""
    from models.text_encoder import build_text_encoder
    from models.util import reading_weights
    from models.vae import build_vae

    with reading_weights(f"vae.pretrained={cfg.vae.pretrained}"):
        vae = build_vae(cfg.vae).to(device)
    vae.tile_latent, vae.tile_overlap = cfg.vae.tile_latent, cfg.vae.tile_overlap
    if not texts:
        return None, vae
    with reading_weights(f"text_encoder.pretrained={cfg.text_encoder.pretrained}"):
        return build_text_encoder(cfg.text_encoder).to(device), vae


@torch.no_grad()
def sample_dit(
    flow, model, noise, y, y_mask, neg_y=None, neg_mask=None, steps=30, guidance=1.0, velocity=None
):
    """Euler integration from noise (t=1) to data (t=0) of the DiT `model` along `flow`'s schedule (with
    guidance != 1, the conditional and the negative branches run as one batch of 2B): a convenience for
    tests and benchmarks (sampling goes through models/sampler.py). `velocity(x, sigma)`, if given,
    replaces the guided model call."""
    from models.sampler import guided_velocity

    if velocity is None:
        parts = DiTParts(model, None, None, None, flow=flow, device=noise.device)
        uncond = None if neg_y is None else DiTText(neg_y, neg_mask)
        velocity = guided_velocity(DiTFamily(), parts, DiTText(y, y_mask), uncond, guidance)
    return flow.walk(flow.schedule(flow.sigmas(noise, steps)), noise, velocity)
