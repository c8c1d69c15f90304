"""Z-Image as a tessera family (models/family.py): a diffusers ZImagePipeline folder's transformer, Qwen3 text
encoder and FLUX's 16-channel VAE; the scheduler's shift over the pipeline's linspace(1, 1/N, N); the model
told 1 - sigma; guidance pos + g (pos - neg) (0: off), truncated to the steps where 1 - sigma is at most
sample.cfg_truncation and its norm capped at sample.cfg_normalization times the prompt's. Base and Turbo
(few steps, guidance 0) alike. Text-to-image under dp, cfg, ulysses or ring (not PipeFusion nor the
first-block cache: its noise refiner runs before the first block over every image token).
"""

from dataclasses import dataclass

import numpy as np
import torch

from models.capabilities import Capabilities
from models.family import Components, Family, config_of, part_folder, read_json
from models.guidance import Guidance
from models.loop import Schedule, euler, sigmas
from models.names import Names, renamed
from models.objective import Objective
from models.steps import Steps, seeded_noise
from models.z_image.keys import KEYS
from models.z_image.text import MAX_SEQUENCE_LENGTH, encode_prompt
from models.z_image.transformer import ZImageCond
from models.z_image.weights import (
    PIPELINE_CLASS,
    TRANSFORMER_CLASS,
    build_transformer,
    config_of_shapes,
    diffusers_from_original,
    original_from_diffusers,
)


def vae_stride(vae_config) -> int:
    """Pixels per latent along a side (the pipeline's rule, from the VAE's config)."""
    return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1)


@dataclass
class ZImageParts(Components):
    cfg_truncation: float = 1.0  # sample.cfg_truncation (the pipeline's default: never)
    cfg_normalization: float = 0.0  # sample.cfg_normalization (0: off)


# why it takes neither PipeFusion nor the first-block cache
REFINED = (
    "its noise refiner attends over every image token before the first block, which patches cannot split"
)
REFINED_FIRST = (
    "its refiners run over every image token before the first block, outside the pieces the cache calls"
)


class ZImageObjective(Objective):
    def velocity(self, parts, model, x, sigma, cond):
        """The model told 1 - sigma, as it samples."""
        return model(x, 1 - sigma, cond)


class ZImageGuidance(Guidance):
    unguided = 0.0  # its pipeline guides at any scale above 0 (pos + g (pos - neg))

    def at(self, parts, t, scale: float) -> float:
        """0 (the prompt alone) at a step whose 1 - sigma (the model's t) exceeds sample.cfg_truncation."""
        return 0.0 if float(t) > parts.cfg_truncation else scale

    def guided(self, scale: float) -> bool:
        return scale > 0.0

    def guide(self, v_cond, v_uncond, scale: float, parts=None):
        """Per sample, as the pipeline: pos + g (pos - neg), its norm capped at cfg_normalization times
        pos's (0: not capped); the prompt alone where the step does not guide."""
        if not self.guided(scale):
            return v_cond
        factor = parts.cfg_normalization if parts is not None else 0.0
        out = []
        for pos, neg in zip(v_cond.float(), v_uncond.float()):
            pred = pos + scale * (pos - neg)
            if factor > 0.0:
                cap = torch.linalg.vector_norm(pos) * factor
                norm = torch.linalg.vector_norm(pred)
                pred = pred * (cap / norm) if norm > cap else pred
            out.append(pred)
        return torch.stack(out)


class ZImageSteps(Steps):
    """Its pipeline's noise, shifted schedule and decoding."""

    def noise(self, parts: Components, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """What the pipeline draws from a generator seeded with seed, one image each, in float32 (its
        latents stay float32 between steps)."""
        scale = vae_stride(parts.vae.config)
        shape = (parts.transformer.in_channels, 1, height // scale, width // scale)
        return seeded_noise(seeds, shape)

    def schedule(self, parts: Components, steps: int, latents: torch.Tensor) -> Schedule:
        """The pipeline's torch.linspace(1, 1/N, N) through the scheduler's shift (mu from the image's 2 x 2
        tokens); the model told (1000 - 1000 sigma) / 1000, computed as the pipeline does."""
        start = torch.linspace(1.0, 1 / steps, steps).numpy().astype(np.float32)
        tokens = (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
        levels = sigmas(steps, tokens, parts.scheduler_config, start).to(latents.device)
        return Schedule(levels, (1000 - levels[:-1] * 1000) / 1000, euler(levels))

    def decode(self, parts: Components, latents) -> torch.Tensor:
        config = parts.vae.config
        z = latents[:, :, 0].to(parts.vae.dtype) / config.scaling_factor + config.shift_factor
        return parts.vae.decode(z, return_dict=False)[0].unsqueeze(2)  # (B, 3, 1, H, W)


class ZImage(Family):
    name, title = "z_image", "Z-Image"
    steps = ZImageSteps()
    pipeline_classes, transformer_classes = (PIPELINE_CLASS,), (TRANSFORMER_CLASS,)
    # one of ulysses and ring (joint attention)
    capabilities = Capabilities(
        parallel=("cfg", "ulysses", "ring"),
        first_block=False,
        reasons=dict(pipefusion=REFINED, first_block=REFINED_FIRST),
    )
    vae_class, max_length = "AutoencoderKL", MAX_SEQUENCE_LENGTH
    conditioning = ZImageCond
    objective = ZImageObjective()  # its transformer's t is 1 - sigma
    # every attention's projections and every feed-forward (the refiners' too), as ai-toolkit's
    lora_targets = ("*.attention.to_*", "*.feed_forward.w*")
    # diffusers' `layers.` are tessera's `blocks.`; Tongyi-MAI's names, ComfyUI's prefix dropped; ComfyUI's
    # LoRA keys: diffusers' under diffusion_model.
    names = Names(
        renamed("layers.", "blocks."),
        renamed("blocks.", "layers."),
        diffusers_from_original,
        original_from_diffusers,
        lora_formats=("diffusers", "comfyui"),
    )
    guidance = ZImageGuidance()  # above 0, normalised, truncated

    def heads(self, cfg) -> int | None:
        return self.transformer_config(cfg).get("n_heads", 30)

    def patch(self, cfg) -> int:
        return int(self.transformer_config(cfg).get("all_patch_size", [2])[0])

    def widths(self, cfg) -> list:
        t, vae, text = self.transformer_config(cfg), config_of(cfg, "vae"), config_of(cfg, "text_encoder")
        latent, hidden = vae.get("latent_channels"), text.get("hidden_size")
        return [
            ("in_channels", t.get("in_channels"), "the VAE's latent_channels", latent),
            ("cap_feat_dim", t.get("cap_feat_dim"), "the text encoder's hidden_size", hidden),
        ]

    def vae_scale(self, cfg) -> int:
        return vae_stride(read_json(part_folder(cfg, "vae") / "config.json"))

    def check_scheduler(self, config: dict) -> None:
        steps = config.get("num_train_timesteps", 1000)  # the pipeline tells the model (1000 - t) / 1000
        self.refuse_scheduler(config, [f"num_train_timesteps={steps}"] * (steps != 1000))
        sigmas(2, 16, config)  # a setting the schedule does not reproduce is refused by name

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        self.check_image_size(frames, height, width, 2 * self.vae_scale(cfg))  # the VAE's stride, then 2 x 2

    def check_guidance(self, cfg, guidance: float) -> None:
        if guidance < 0:
            raise ValueError(
                f"guidance {guidance}: {self.title}'s guidance is pos + g (pos - neg), 0 off; give 0 or more"
            )

    def build(self, config: dict, cfg):
        return build_transformer(config, cfg.model.attention_backend)

    def config_of_file(self, shapes: dict) -> dict:
        """The release's layout read from a single file's shapes: heads of 128 split 32 / 48 / 48."""
        shapes = self.names.from_original(shapes)
        needed = ("layers.0.attention.norm_q.weight", "all_x_embedder.2-1.weight", "cap_embedder.1.weight")
        missing = [key for key in needed if key not in shapes]
        if missing:
            raise ValueError(
                f"model.pretrained is not a {self.title} transformer file: it has no {missing[0]}"
            )
        return config_of_shapes(shapes) or super().config_of_file(shapes)

    def load(
        self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True
    ) -> ZImageParts:
        import transformers
        from diffusers import AutoencoderKL

        model = self.load_transformer(cfg, dtype, keep) if transformer else None
        encoder_class = self.text_encoder_class(cfg, "Qwen3Model")  # the release's
        encoder = (
            encoder_class.from_pretrained(part_folder(cfg, "text_encoder"), dtype=dtype) if texts else None
        )
        vae = AutoencoderKL.from_pretrained(part_folder(cfg, "vae"), torch_dtype=dtype)
        encoder, vae = (m and m.eval().to(device).requires_grad_(False) for m in (encoder, vae))
        model = model and model.to(device)  # load_transformer's: frozen already
        given = {k.name: cfg.sample[k.name] for k in KEYS if cfg.sample[k.name] is not None}
        return ZImageParts(
            model,
            transformers.AutoTokenizer.from_pretrained(part_folder(cfg, "tokenizer")),
            encoder,
            vae,
            read_json(part_folder(cfg, "scheduler") / "scheduler_config.json"),
            **{k: float(v) for k, v in given.items()},
        )

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """(z - shift_factor) * scaling_factor of the posterior's mode: the pipeline's decode inverted."""
        config = parts.vae.config
        z = parts.vae.encode(images[:, :, 0].to(parts.vae.dtype)).latent_dist.mode()
        return ((z.float() - config.shift_factor) * config.scaling_factor).unsqueeze(2)

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        return ZImageCond(*encode_prompt(prompts, parts.tokenizer, parts.text_encoder, max_length))
