"""FLUX.2 klein as a tessera family (models/family.py): a diffusers Flux2KleinPipeline folder's transformer,
Qwen3 text encoder (three layers' hidden states side by side) and AutoencoderKLFlux2, whose latents are packed
2 x 2 into 128 channels and normalised by its batch norm's running statistics; the scheduler's shift at the
pipeline's empirical mu; CFG against the negative prompt (the pipeline's: the empty one) above 1, none for a
step-distilled folder (model_index.json's is_distilled: a guidance scale other than 1 is refused there).
Text-to-image (and with --image references) under dp, cfg, ulysses, ring or PipeFusion. FLUX.2 dev
(Flux2Dev): the guidance scale embedded, Mistral.
"""

import importlib.util
import math
import re
from dataclasses import dataclass, fields, replace

import torch

from models.capabilities import Capabilities
from models.family import Components, Family, config_of, part_folder, read_json
from models.flux2.text import LAYERS, MAX_SEQUENCE_LENGTH, encode_prompt, encode_prompt_dev
from models.flux2.transformer import Flux2Cond
from models.flux2.weights import (
    DEV_PIPELINE_CLASSES,
    PIPELINE_CLASSES,
    TRANSFORMER_CLASS,
    build_transformer,
    diffusers_from_original,
    original_from_diffusers,
    to_diffusers,
    to_tessera,
)
from models.guidance import Unguided
from models.loading import Loading
from models.loop import Schedule, euler, sigmas
from models.names import Names
from models.objective import Objective
from models.steps import Steps, seeded_noise


def empirical_mu(tokens: int, steps: int) -> float:
    """The shift diffusers' Flux2 pipelines compute from the image's token count and the step count."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if tokens > 4300:
        return float(a2 * tokens + b2)
    m_200, m_10 = a2 * tokens + b2, a1 * tokens + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def blocks_before(state: dict, pattern: str) -> int:
    """1 + the largest block index of the keys matching `pattern` (0 when none does)."""
    found = [int(m.group(1)) for m in map(lambda k: re.match(pattern, k), state) if m]
    return 1 + max(found) if found else 0


def pixels_per_token(vae_config) -> int:
    """Pixels per packed latent along a side: the VAE's stride (the pipeline's rule), then the 2 x 2 patch."""
    return 2 * 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1)


def reference_size(image, multiple: int) -> tuple:
    """(height, width) the pipeline gives a reference: scaled to 1024 x 1024 pixels' area when larger
    (diffusers' Flux2ImageProcessor._resize_to_target_area), floored to multiples of the stride."""
    width, height = image.size
    if width * height > 1024 * 1024:
        scale = math.sqrt(1024 * 1024 / (width * height))
        width, height = int(width * scale), int(height * scale)
    return height // multiple * multiple, width // multiple * multiple


def batch_norm_stats(vae, like) -> tuple:
    """(mean, std) (1, C, 1, 1) of the VAE's batch norm, the latents' normalisation."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        like.device, like.dtype
    )
    return mean, std


def flux2_to_tessera(state: dict) -> dict:
    """diffusers' names -> one list of blocks, the double ones first (their count from the state)."""
    return to_tessera(state, blocks_before(state, r"^transformer_blocks\.(\d+)\."))


def flux2_to_diffusers(state: dict) -> dict:
    """A whole state dict's names back (the double blocks: those with a text feed-forward)."""
    return to_diffusers(state, blocks_before(state, r"^blocks\.(\d+)\.ff_context\."))


class Flux2Steps(Steps):
    """Its pipeline's packed noise, schedule and decoding (dev and klein alike)."""

    def noise(self, parts: Components, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """What the pipeline draws from a generator seeded with seed, in the model's dtype: (128, 1, h, w)."""
        scale = pixels_per_token(parts.vae.config)
        shape = (parts.transformer.in_channels, 1, height // scale, width // scale)
        return seeded_noise(seeds, shape, parts.transformer.x_embedder.weight.dtype)

    def schedule(self, parts: Components, steps: int, latents: torch.Tensor) -> Schedule:
        tokens = latents.shape[-2] * latents.shape[-1]
        levels = sigmas(steps, tokens, parts.scheduler_config, mu=empirical_mu(tokens, steps)).to(
            latents.device
        )
        return Schedule(levels, levels[:-1], euler(levels))

    def decode(self, parts: Components, latents) -> torch.Tensor:
        z = latents[:, :, 0].to(parts.vae.dtype)
        mean, std = batch_norm_stats(parts.vae, z)
        z = z * std + mean
        B, C, h, w = z.shape
        z = z.reshape(B, C // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C // 4, h * 2, w * 2)
        return parts.vae.decode(z, return_dict=False)[0].unsqueeze(2)


class Flux2(Family):
    name, title = "flux2", "FLUX.2"
    steps = Flux2Steps()
    pipeline_classes, transformer_classes = PIPELINE_CLASSES, (TRANSFORMER_CLASS,)
    # one of ulysses and ring (joint attention); PipeFusion and the first-block cache through the
    # transformer's patch pieces, the reference images' tokens beside each patch (as the text)
    vae_class, max_length = "AutoencoderKLFlux2", MAX_SEQUENCE_LENGTH
    conditioning = Flux2Cond
    capabilities = Capabilities(references=True)  # --image: reference images beside the noisy tokens
    # both kinds of block: the double blocks' attention and feed-forwards, the single blocks' projections
    lora_targets = ("blocks.*.attn.*", "blocks.*.ff.*", "blocks.*.ff_context.*")
    # ComfyUI's: BFL's names under diffusion_model., the scale in B (ai-toolkit's layout, which diffusers'
    # Flux2 loader reads; it refuses alpha keys there)
    names = Names(
        flux2_to_tessera,
        flux2_to_diffusers,
        diffusers_from_original,  # BFL's names, ComfyUI's prefix dropped
        original_from_diffusers,
        lora_formats=("diffusers", "comfyui"),
        lora_alphas=False,
        lora_release_names=True,
    )
    text_encoder_default = "Qwen3ForCausalLM"  # a folder whose model_index.json does not name it

    def takes_images(self, cfg) -> bool:
        return True  # reference images, optional: --image

    def needs_images(self, cfg) -> bool:
        return False

    def sampling_images(self, cfg, given: tuple, count: int, size: tuple, sized: bool, say=None) -> tuple:
        """Every prompt's reference images (--image, in order), each checked as the pipeline checks it;
        the size, unless given, the first one's as the pipeline prepares it."""
        from models.image_condition import load_image

        paths, last = given
        if last:
            raise ValueError(f"--last-image: {self.title} takes its reference images from --image alone")
        _, height, width = size
        if not paths:
            return None, None, height, width
        try:
            images = [load_image(path) for path in paths]
        except FileNotFoundError as e:
            raise ValueError(f"--image: {e}") from None
        for path, image in zip(paths, images):
            w, h = image.size
            if min(w, h) < 64 or max(w, h) > 8 * min(w, h):
                raise ValueError(
                    f"--image {path}: {w} x {h}; {self.title}'s pipeline takes references of at least 64 "
                    "pixels a side and an aspect ratio of at most 8"
                )
        if not sized:
            height, width = reference_size(images[0], self.vae_scale(cfg))
            if say is not None:
                say(f"--image: sampling {width}x{height}, the first reference's size (as the pipeline picks)")
        return [images] * count, None, height, width

    def with_images(self, parts: Components, images: list, size: tuple, *conds, last_images=None) -> tuple:
        """The references' latents (the posterior's mode, packed and normalised as the pipeline does it,
        each at its own size) after every sample's noisy tokens, in both branches."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        scale = pixels_per_token(parts.vae.config)
        processor, tokens, grids = Flux2ImageProcessor(vae_scale_factor=scale), [], []
        device = next(parts.vae.parameters()).device
        for image in images[0]:  # the same references for every prompt
            height, width = reference_size(image, scale)
            if image.width * image.height > 1024 * 1024:
                image = processor._resize_to_target_area(image, 1024 * 1024)
            pixels = processor.preprocess(image, height=height, width=width, resize_mode="crop")
            with torch.no_grad():
                z = self.encode_images(parts, pixels.to(device).unsqueeze(2))  # (1, C, 1, h, w)
            tokens.append(z.flatten(2).transpose(1, 2))
            grids.append(tuple(z.shape[2:]))
        count = len(images)
        references = dict(
            references=torch.cat(tokens, dim=1).expand(count, -1, -1),
            reference_grids=torch.tensor([grids] * count, device=device),
        )
        return tuple(None if c is None else replace(c, **references) for c in conds)

    def distilled(self, cfg) -> bool:
        return bool(
            # the pipeline folder's (a single transformer file's: the folder its other parts come from)
            read_json(part_folder(cfg, "scheduler").parent / "model_index.json").get("is_distilled", False)
        )

    def check_guidance(self, cfg, guidance: float) -> None:
        if self.distilled(cfg) and guidance != 1.0:
            raise ValueError(
                f"guidance {guidance}: model.pretrained={cfg.model.pretrained} is a step-distilled FLUX.2 "
                "klein (is_distilled), which samples without guidance; give --guidance 1"
            )

    def heads(self, cfg) -> int | None:
        return self.transformer_config(cfg).get("num_attention_heads", 48)

    def widths(self, cfg) -> list:
        """Its latents packed 2 x 2; its text, three layers' hidden states side by side (text.py)."""
        t, vae, text = self.transformer_config(cfg), config_of(cfg, "vae"), config_of(cfg, "text_encoder")
        latent = vae.get("latent_channels") and vae["latent_channels"] * 4
        hidden = text.get("hidden_size") and text["hidden_size"] * len(LAYERS)
        return [("in_channels", t.get("in_channels"), "the VAE's latent_channels x 4 (packed 2 x 2)", latent),
                ("joint_attention_dim", t.get("joint_attention_dim"), "3 x the text encoder's hidden_size",
                 hidden)]  # fmt: skip

    def vae_scale(self, cfg) -> int:
        config = read_json(part_folder(cfg, "vae") / "config.json")
        return pixels_per_token(config)

    def patch(self, cfg) -> int:
        return 1  # its tokens are the packed latents' own cells

    def check_scheduler(self, config: dict) -> None:
        self.refuse_scheduler(config, ["use_flow_sigmas"] * bool(config.get("use_flow_sigmas")))
        sigmas(2, 16, config)  # a setting the schedule does not reproduce is refused by name

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        self.check_image_size(frames, height, width, self.vae_scale(cfg))  # the VAE's stride and its 2 x 2

    def build(self, config: dict, cfg):
        return build_transformer(config, cfg.model.attention_backend)

    def check_pretrained(self, cfg) -> None:
        """Family.check_pretrained, and a transformer of this FLUX.2 (dev embeds the guidance scale, klein
        does not: the other's weights would sample without error, and wrongly)."""
        super().check_pretrained(cfg)
        embeds = bool(self.transformer_config(cfg).get("guidance_embeds", True))  # diffusers' default
        if embeds != self.guidance_embedded:
            family, recipe = ("flux2_dev", "flux2-dev") if embeds else ("flux2", "flux2-klein")
            raise ValueError(
                f"model.pretrained={cfg.model.pretrained}: its transformer has guidance_embeds={embeds}, "
                f"not {self.title}'s: it is model.family={family}'s (configs/{recipe}.yaml)"
            )

    def lora_names(self, model):
        """Each module's diffusers name from the model's own count of double blocks."""
        return lambda name: next(iter(to_diffusers({name: None}, model.depth)))

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> Components:
        import transformers
        from diffusers import AutoencoderKLFlux2

        model = self.load_transformer(cfg, dtype, keep) if transformer else None
        encoder_class = self.text_encoder_class(cfg, self.text_encoder_default)
        encoder = (
            encoder_class.from_pretrained(part_folder(cfg, "text_encoder"), dtype=dtype) if texts else None
        )
        vae = AutoencoderKLFlux2.from_pretrained(part_folder(cfg, "vae"), torch_dtype=dtype)
        encoder, vae = (m and m.eval().to(device).requires_grad_(False) for m in (encoder, vae))
        model = model and model.to(device)  # load_transformer's: frozen already
        tokenizer = self.load_tokenizer(transformers, part_folder(cfg, "tokenizer"))
        scheduler = read_json(part_folder(cfg, "scheduler") / "scheduler_config.json")
        return Components(model, tokenizer, encoder, vae, scheduler)

    def load_tokenizer(self, transformers, folder):
        return transformers.AutoTokenizer.from_pretrained(folder)

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        return Flux2Cond(encode_prompt(prompts, parts.tokenizer, parts.text_encoder, max_length))

    def store_conditioning(self, cond: Flux2Cond) -> list[dict]:
        return [{"text": text} for text in cond.text]  # every position: the transformer sees them all

    def load_conditioning(self, stored: list, max_length: int) -> Flux2Cond:
        lengths = {len(s["text"]) for s in stored}
        if lengths != {max_length}:  # every position is the transformer's input: the length is the model's
            raise ValueError(
                f"data.latents: the stored texts have {sorted(lengths)} positions and "
                f"text_encoder.max_length is {max_length}: precompute the latents again at this length"
            )
        return Flux2Cond(torch.stack([s["text"] for s in stored]))

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """The posterior's mode packed 2 x 2 and normalised by the batch norm's statistics, as the pipeline
        encodes its reference images."""
        z = parts.vae.encode(images[:, :, 0].to(parts.vae.dtype)).latent_dist.mode()
        B, C, H, W = z.shape
        z = z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(B, C * 4, H // 2, W // 2)
        mean, std = batch_norm_stats(parts.vae, z)
        return ((z - mean) / std).float().unsqueeze(2)


@dataclass
class Flux2DevParts(Components):
    guidance: float | None = None  # the scale its training gives the transformer (train.guidance; load's)


class Flux2DevObjective(Objective):
    def velocity(self, parts, model, x, sigma, cond):
        """Objective.velocity with the training's guidance scale (float32, as the pipeline's) the
        transformer's input."""
        scale = torch.full((x.shape[0],), parts.guidance, device=x.device)
        return model(x, sigma, replace(cond, guidance=scale))

    def check_distillation(self, cfg) -> None:
        raise ValueError(
            "train.objective=dmd: FLUX.2 dev's teacher would be guided through its transformer's input, "
            "which the distillation does not give yet; train it with train.objective=flow"
        )


class Flux2Dev(Flux2):
    """FLUX.2 dev (Flux2Pipeline folders): klein's transformer with the guidance scale as its input (1000
    times it through the guidance embedder; no CFG batch, so no cfg degree and no negative prompt), a
    Mistral 3 text encoder read through its processor with BFL's system message (text.py encode_prompt_dev).
    Its training gives the transformer one fixed scale, train.guidance, as diffusers'
    train_dreambooth_lora_flux2.py gives its --guidance_scale (default 3.5)."""

    name, title = "flux2_dev", "FLUX.2 dev"
    pipeline_classes = DEV_PIPELINE_CLASSES
    capabilities = replace(
        Flux2.capabilities,
        parallel=("ulysses", "ring", "pipefusion"),  # one of ulysses and ring (joint attention)
        reasons=dict(cfg="it is guidance-distilled: the scale is its transformer's input, with no negative "
                 "branch to split"),
    )  # fmt: skip
    text_encoder_default = "Mistral3ForConditionalGeneration"
    loading = Loading(texts_first=True)  # its 24B Mistral freed before its 32B transformer loads
    guidance_embedded, training_guidance = True, 3.5
    objective = Flux2DevObjective()  # the training's guidance scale its transformer's input
    guidance = Unguided()  # the scale is the transformer's input: never a second branch

    def check_pretrained(self, cfg) -> None:
        """Flux2.check_pretrained, and transformers able to build the folder's processor (the release's
        PixtralProcessor needs torchvision), named before anything loads."""
        super().check_pretrained(cfg)
        processor = read_json(part_folder(cfg, "tokenizer") / "processor_config.json").get("processor_class")
        if processor and importlib.util.find_spec("torchvision") is None:
            raise ValueError(
                f"text_encoder.pretrained: {self.title}'s tokenizer is a {processor}, which transformers "
                "builds only with torchvision: pip install torchvision, the build that matches your torch"
            )

    def load(
        self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True
    ) -> Flux2DevParts:
        parts = super().load(cfg, device, dtype, transformer, keep, texts)
        guidance = self.training_guidance if cfg.train.guidance is None else float(cfg.train.guidance)
        return Flux2DevParts(**{f.name: getattr(parts, f.name) for f in fields(parts)}, guidance=guidance)

    def load_tokenizer(self, transformers, folder):
        return transformers.AutoProcessor.from_pretrained(folder)  # its chat template is the processor's

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        return Flux2Cond(encode_prompt_dev(prompts, parts.tokenizer, parts.text_encoder, max_length))

    def check_guidance(self, cfg, guidance: float) -> None:
        if guidance < 0:
            raise ValueError(f"guidance {guidance}: {self.title} embeds a guidance scale of 0 or more")

    def conditionings(self, parts: Components, sampling) -> tuple:
        """Family.conditionings, the sampling's guidance scale in every prompt's conditioning, as the
        pipeline hands it to the transformer (float32)."""
        cond, uncond = super().conditionings(parts, sampling)
        scale = torch.full((cond.text.shape[0],), float(sampling.guidance), device=cond.text.device)
        return replace(cond, guidance=scale), uncond
