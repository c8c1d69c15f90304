"""tessera's own DiT as a family (models/family.py): it reads Wan 2.1 / 2.2 folders (models/dit.py,
models/wan.py) and samples through models/sampler.py as every family does. What is its own: the text
is its T5 encoder's (models/text_encoder.py), the schedule is models/flow.py's with the step cache
behind it, the two guidance branches run as one batch, image-to-video's condition goes into each call
(models/image_condition.py), Wan 2.2 A14B's two experts take turns, and it computes under autocast.
Its weights, LoRA and training stay in tessera's DiT code (`native`).
"""

import contextlib
from dataclasses import dataclass

import torch

from models import tiling
from models.family import Components, Family
from models.image_condition import ConditionedModel
from models.loop import Schedule
from models.step_cache import FirstBlockModel


@dataclass
class DiTText:
    """The DiT's conditioning: the encoded prompts (B, L, D) and their mask (B, L)."""

    text: torch.Tensor
    text_mask: torch.Tensor


@dataclass
class Experts:
    """Wan 2.2 A14B's second expert: `low` samples the steps below the boundary at guidance_2, the first
    one the others; only the sampling one is on the device (14B each): they swap at the boundary, and back
    when the next sampling starts (parallel/sampling.py)."""

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


def meta_dit(cfg):
    """The recipe's DiT on the meta device, before any component is loaded (the encoder's width from its
    config.json): names and shapes, to check a recipe or a LoRA file before start-up."""
    from models.dit import build_dit
    from models.text_encoder import text_encoder_dim
    from models.vae import vae_latent_space

    with torch.device("meta"):
        return build_dit(
            cfg.model,
            in_channels=vae_latent_space(cfg.vae).latent_channels,
            text_dim=text_encoder_dim(cfg.text_encoder),
        )


class DiTFamily(Family):
    name, title, native = "dit", "tessera's DiT (Wan 2.1 / 2.2)", True
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    transformer_classes = ("WanTransformer3DModel", "WanModel")  # diffusers', Wan-AI's own config.json
    parallel_degrees = ("cfg", "ulysses", "ring", "pipefusion")
    conditioning = DiTText

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

    def noise(self, parts: DiTParts, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        shape = parts.vae.latent_shape(frames, height, width, parts.flow.patch_size)
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])

    def schedule(self, parts: DiTParts, steps: int, latents: torch.Tensor) -> Schedule:
        return parts.flow.schedule(parts.flow.sigmas(latents, steps))

    def context(self, parts: DiTParts):
        if parts.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(parts.device.type, dtype=parts.autocast)

    def walk(self, parts: DiTParts, schedule: Schedule, noise, velocity, progress=None):
        return parts.flow.walk(schedule, noise, velocity, progress)

    def guided(self, scale: float) -> bool:
        return scale != 1.0

    def guidance_at(self, parts: DiTParts, t, scale: float) -> float:
        experts = parts.experts
        return scale if experts is None or experts.high_noise(t) else experts.guidance_2

    def model_at(self, parts: DiTParts, t):
        """The model that samples timestep `t` (one of Wan 2.2's experts, moved to the device), behind the
        first-block step cache when it is on, with the image condition when there is one."""
        model, experts, cache = parts.transformer, parts.experts, parts.flow.cache
        if experts is not None:
            pair = (model, experts.low) if experts.high_noise(t) else (experts.low, model)
            model = experts.on_device(*pair, parts.device)
        if cache is not None and cache.method == "first_block":  # its blocks run around the cache's choice
            model = FirstBlockModel(model, cache)
        return model if parts.condition is None else ConditionedModel(model, parts.condition)

    def velocity(self, parts: DiTParts, x, t, cond: DiTText):
        return self.model_at(parts, t)(x, t.expand(x.shape[0]), cond.text, cond.text_mask)

    def both(self, parts: DiTParts, x, t, cond: DiTText, uncond: DiTText) -> tuple:
        """Both branches as one batch of 2B (the conditional one first)."""
        text, mask = torch.cat([cond.text, uncond.text]), torch.cat([cond.text_mask, uncond.text_mask])
        v = self.model_at(parts, t)(torch.cat([x, x]), t.expand(text.shape[0]), text, mask)
        return v.chunk(2)

    def finish(self, parts: DiTParts, latents):
        condition = parts.condition
        if condition is not None and condition.first_frame:  # TI2V: the given frame's latent, as diffusers
            latents = torch.cat([condition.latent.to(latents.dtype), latents[:, :, 1:]], dim=2)
        return latents

    def decode(self, parts: DiTParts, latents) -> torch.Tensor:
        """In the recipe's tiles (vae.tile_latent, vae.tile_overlap), on this device."""
        return tiling.decode(parts.vae, latents.float(), parts.vae.tile_latent, parts.vae.tile_overlap)
