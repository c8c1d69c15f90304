"""HunyuanVideo 1.5 as a tessera family (models/family.py): a diffusers HunyuanVideo15Pipeline folder's
transformer, Qwen2.5-VL and ByT5 text encoders and causal video VAE (an image-to-video folder's SigLIP
image encoder too); the schedule of its FlowMatchEulerDiscreteScheduler (a static shift, Euler steps);
classifier-free guidance as its guider's. Text- and image-to-video under dp, cfg, ulysses, ring or
PipeFusion, with the first-block step cache; text- and image-to-video training (full or LoRA). The
transformer may also be one file in the original release's names (weights.py diffusers_from_original).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from models.capabilities import Capabilities
from models.family import Components, Family, config_of, padded, part_folder, read_json
from models.guidance import Guidance
from models.hunyuan_video15.text import MAX_LENGTH, encode_glyphs, encode_text
from models.hunyuan_video15.transformer import HunyuanVideo15Cond
from models.hunyuan_video15.weights import (
    PIPELINE_CLASSES,
    TRANSFORMER_CLASS,
    build_transformer,
    diffusers_from_original,
    shapes_config,
)
from models.layers import PiecesOf
from models.loop import Schedule, euler
from models.names import Names
from models.steps import Steps, seeded_noise

_UNSUPPORTED = ("use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                "invert_sigmas", "stochastic_sampling", "shift_terminal")  # fmt: skip


@dataclass
class HunyuanVideo15Parts(Components):
    """Its parts: Components' (Qwen2.5-VL as text_encoder) and ByT5, the glyph encoder."""

    glyph_encoder: torch.nn.Module = None
    glyph_tokenizer: object = None
    image_encoder: torch.nn.Module = None  # SigLIP, in an image-to-video folder only
    feature_extractor: object = None
    transformer_dtype: torch.dtype = torch.float32  # what the pipeline casts the image's condition to


def _processor(vae_scale: int):
    """The pipeline's image processor: its size buckets, crop and [-1, 1] pixels."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return HunyuanVideo15ImageProcessor(vae_scale_factor=vae_scale, do_resize=False, do_convert_rgb=True)


def sigmas(steps: int, scheduler_config: dict) -> torch.Tensor:
    """(steps + 1,) float32: the pipeline's linspace(1, 0, steps + 1) without its 0, shifted as the scheduler
    shifts them (shift s / (1 + (shift - 1) s), in float32 numpy), then 0."""
    s = np.linspace(1.0, 0.0, steps + 1)[:-1].astype(np.float32)
    shift = scheduler_config.get("shift", 1.0)
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])


class GivenFramePieces(PiecesOf):
    """The transformer's patch pieces with image-to-video's given frame: `embed(x)` is the transformer's
    `embed(x, given)`; the rest is the transformer's own."""

    def __init__(self, model, given: torch.Tensor):
        super().__init__(model)
        self.given = given

    def embed(self, x):
        return self.model.embed(x, self.given)


class HunyuanVideo15Guidance(Guidance):
    def guided(self, scale: float) -> bool:
        return abs(scale - 1.0) > 1e-9  # its guider guides at any scale but 1 (math.isclose)


class HunyuanVideo15Steps(Steps):
    """Its pipeline's noise, schedule, decoding, and the patch pieces with the given frame."""

    def patch_pieces(self, parts: HunyuanVideo15Parts, cond=None):
        """Its transformer's; image-to-video: the embedding reads the given frame's latents and mask beside
        the noisy latents, as its forward does."""
        if cond is None or cond.image_latents is None:
            return parts.transformer
        return GivenFramePieces(parts.transformer, cond.image_latents)

    def noise(self, parts: HunyuanVideo15Parts, seeds: list, frames: int, height: int, width: int):
        """What the pipeline draws from a generator seeded with seed, one video each, in the model's dtype."""
        config = parts.vae.config
        scale, stride = config.spatial_compression_ratio, config.temporal_compression_ratio
        shape = (config.latent_channels, (frames - 1) // stride + 1, height // scale, width // scale)
        return seeded_noise(seeds, shape, next(parts.transformer.parameters()).dtype)

    def schedule(self, parts: HunyuanVideo15Parts, steps: int, latents: torch.Tensor) -> Schedule:
        levels = sigmas(steps, parts.scheduler_config).to(latents.device)
        return Schedule(levels, levels[:-1], euler(levels))

    def decode(self, parts: HunyuanVideo15Parts, latents) -> torch.Tensor:
        z = latents.to(parts.vae.dtype) / parts.vae.config.scaling_factor
        return torch.cat([parts.vae.decode(v[None], return_dict=False)[0] for v in z])  # (B, 3, T, H, W)


class HunyuanVideo15(Family):
    name, title = "hunyuan_video15", "HunyuanVideo 1.5"
    steps = HunyuanVideo15Steps()
    pipeline_classes, transformer_classes = PIPELINE_CLASSES, (TRANSFORMER_CLASS,)
    # one of ulysses and ring (joint attention)
    vae_class, max_length = "AutoencoderKLHunyuanVideo15", MAX_LENGTH
    conditioning = HunyuanVideo15Cond
    guidance = HunyuanVideo15Guidance()
    # its image-to-video folder trains from each clip's first frame
    capabilities = Capabilities(image_to_video=True, trains_images=True)
    # the original release's names (its token refiner's fused qkv split, its final modulation's rows
    # swapped) or diffusers' already, ComfyUI's prefix dropped
    names = Names(from_original=diffusers_from_original)
    # the joint attention's projections and both streams' feed-forwards, as Qwen-Image's
    lora_targets = ("blocks.*.attn.*", "blocks.*.ff.*", "blocks.*.ff_context.*")

    def check_pretrained(self, cfg) -> None:
        super().check_pretrained(cfg)
        guider = read_json(part_folder(cfg, "guider") / "guider_config.json")
        plain = dict(enabled=True, guidance_rescale=0.0, start=0.0, stop=1.0, use_original_formulation=False)
        wrong = [f"{key}={guider[key]!r}" for key, value in plain.items() if guider.get(key, value) != value]
        if guider.get("_class_name", "ClassifierFreeGuidance") != "ClassifierFreeGuidance" or wrong:
            raise ValueError(
                f"model.pretrained: the folder's guider ({guider.get('_class_name')}"
                f"{': ' + ', '.join(wrong) if wrong else ''}) is not the plain classifier-free guidance "
                f"{self.title} samples with (its scale is --guidance)"
            )
        parts = [("text_encoder_2", "config.json", "ByT5, the glyph text's encoder, ")]
        parts += [("tokenizer_2", "*.json", "")]
        if self.takes_images(cfg):
            parts += [("image_encoder", "config.json", "SigLIP, the image's encoder, ")]
            parts += [("feature_extractor", "preprocessor_config.json", "")]
        for part, wanted, what in parts:
            folder = part_folder(cfg, part)
            if not any(folder.glob(wanted)):
                raise FileNotFoundError(
                    f"model.pretrained: no {self.title} {part} in {folder} ({what}part "
                    "of the pipeline folder; tessera never downloads)"
                )

    def takes_images(self, cfg) -> bool:
        """An image-to-video folder: model_index.json's pipeline, or a SigLIP image encoder in it (its own
        image_encoder/: a VAE-only folder beside a single file is not one)."""
        index = read_json(Path(cfg.model.pretrained or "") / "model_index.json").get("_class_name")
        encoder = part_folder(cfg, "image_encoder")
        return index == PIPELINE_CLASSES[1] or (encoder.name == "image_encoder" and encoder.is_dir())

    def image_size(self, cfg, image) -> tuple:
        target = self.transformer_config(cfg).get("target_size", 640)  # the pipeline's base size in pixels
        if target is None:  # a single file's shapes: the 480p and 720p releases differ in this alone
            raise ValueError(
                f"--image: model.pretrained={cfg.model.pretrained} comes with no transformer/config.json to "
                "say the video size its pipeline picks for an image (target_size): give --height and --width"
            )
        processor = _processor(self.vae_scale(cfg))
        return processor.calculate_default_height_width(image.height, image.width, target)

    def with_images(
        self, parts: HunyuanVideo15Parts, images: list, size: tuple, *conds, last_images=None
    ) -> tuple:
        """Each image cropped to the video's (height, width), its SigLIP tokens in the context stream and its
        VAE latents (the posterior's mode, scaled) as the first latent frame beside the noise, masked 1
        there and 0 on the frames to come (the pipeline's prepare_cond_latents_and_mask)."""
        frames, height, width = size
        processor, dtype = _processor(parts.vae.config.spatial_compression_ratio), parts.transformer_dtype
        device = next(parts.vae.parameters()).device
        images = [processor.resize(image, height=height, width=width, resize_mode="crop") for image in images]
        pixels = torch.cat([processor.preprocess(image, height=height, width=width) for image in images])
        with torch.no_grad():
            first = self.encode_images(parts, pixels.to(device).unsqueeze(2))  # (B, C, 1, h, w), scaled
            features = parts.feature_extractor.preprocess(
                images=images, do_resize=True, return_tensors="pt", do_convert_rgb=True
            )
            encoder = parts.image_encoder
            tokens = encoder(**features.to(device, next(encoder.parameters()).dtype)).last_hidden_state
        latent_frames = (frames - 1) // parts.vae.config.temporal_compression_ratio + 1
        batch, channels, _, h, w = first.shape
        given = torch.zeros(batch, channels + 1, latent_frames, h, w, device=device)
        given[:, :-1, :1], given[:, -1, 0] = first, 1.0  # the mask: 1 on the given frame
        image = dict(image=tokens.to(dtype), image_latents=given.to(dtype))
        return tuple(None if cond is None else replace(cond, **image) for cond in conds)

    def check_scheduler(self, config: dict) -> None:
        wrong = [key for key in _UNSUPPORTED if config.get(key)]
        if config.get("num_train_timesteps", 1000) != 1000:  # the transformer is told 1000 sigma
            wrong.append(f"num_train_timesteps={config['num_train_timesteps']}")
        self.refuse_scheduler(config, wrong, " and a static shift")

    def _space(self, cfg):
        from models.vae import LatentSpace

        config = read_json(part_folder(cfg, "vae") / "config.json")
        space = LatentSpace()
        space.latent_channels = config.get("latent_channels", 32)
        space.temporal_stride = config.get("temporal_compression_ratio", 4)
        space.spatial_stride, space.causal = config.get("spatial_compression_ratio", 16), True
        return space

    def latent_space(self, cfg):
        return self._space(cfg)

    def vae_scale(self, cfg) -> int:
        return self._space(cfg).spatial_stride

    def widths(self, cfg) -> list:
        """Its input: the noisy latents, the condition's latents and their mask, side by side; its two
        texts: the Qwen2.5-VL text model's and ByT5's (the glyphs')."""
        t, vae = self.transformer_config(cfg), config_of(cfg, "vae")
        text, glyphs = config_of(cfg, "text_encoder"), config_of(cfg, "text_encoder_2")
        latent = vae.get("latent_channels") and 2 * vae["latent_channels"] + 1
        return [("in_channels", t.get("in_channels"), "2 x the VAE's latent_channels + 1 (with a mask)",
                 latent),
                ("text_embed_dim", t.get("text_embed_dim"), "the text encoder's hidden_size",
                 text.get("hidden_size")),
                ("text_embed_2_dim", t.get("text_embed_2_dim"), "text_encoder_2's (ByT5's) d_model",
                 glyphs.get("d_model"))]  # fmt: skip

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        patch = self.patch(cfg)
        self._space(cfg).latent_shape(frames, height, width, (1, patch, patch))  # names the flag to change

    def build(self, config: dict, cfg):
        return build_transformer(config, cfg.model.attention_backend)

    def config_of_file(self, shapes: dict) -> dict:
        """The release's layout read from the shapes: heads of 128 split 16 / 56 / 56 for the 3-axis rope."""
        config = shapes_config(shapes)
        if config["rope_axes_dim"] is None:
            return super().config_of_file(shapes)  # the rope's split of another head size is not in the file
        return config

    def load(
        self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True
    ) -> HunyuanVideo15Parts:
        from diffusers import AutoencoderKLHunyuanVideo15
        from transformers import AutoTokenizer, ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        model = self.load_transformer(cfg, dtype, keep) if transformer else None
        encoder = glyph_encoder = None
        if texts:  # the prompt's and its quoted glyphs'
            encoder = Qwen2_5_VLTextModel.from_pretrained(part_folder(cfg, "text_encoder"), torch_dtype=dtype)
            glyph_encoder = T5EncoderModel.from_pretrained(
                part_folder(cfg, "text_encoder_2"), torch_dtype=dtype
            )
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(part_folder(cfg, "vae"), torch_dtype=dtype)
        image_encoder = feature_extractor = None
        if self.takes_images(cfg):
            from transformers import SiglipImageProcessor, SiglipVisionModel

            image_encoder = SiglipVisionModel.from_pretrained(part_folder(cfg, "image_encoder"), dtype=dtype)
            feature_extractor = SiglipImageProcessor.from_pretrained(part_folder(cfg, "feature_extractor"))
        frozen = [
            m if m is None else m.eval().to(device).requires_grad_(False)
            for m in (encoder, glyph_encoder, vae, image_encoder)
        ]
        model = model and model.to(device)  # load_transformer's: frozen already
        return HunyuanVideo15Parts(
            model,
            AutoTokenizer.from_pretrained(part_folder(cfg, "tokenizer")),
            frozen[0],
            frozen[2],
            read_json(part_folder(cfg, "scheduler") / "scheduler_config.json"),
            glyph_encoder=frozen[1],
            glyph_tokenizer=ByT5Tokenizer.from_pretrained(part_folder(cfg, "tokenizer_2")),
            image_encoder=frozen[3],
            feature_extractor=feature_extractor,
            transformer_dtype=dtype,
        )

    def encode(self, parts: HunyuanVideo15Parts, prompts: list, max_length: int, negative: bool = False):
        text, mask = encode_text(prompts, parts.tokenizer, parts.text_encoder, max_length)
        glyph, glyph_mask = encode_glyphs(prompts, parts.glyph_tokenizer, parts.glyph_encoder, text.dtype)
        return HunyuanVideo15Cond(text, mask, glyph, glyph_mask)

    def encode_images(self, parts: HunyuanVideo15Parts, images: torch.Tensor) -> torch.Tensor:
        """Videos (B, 3, T, H, W) in [-1, 1] -> latents: the posterior's mode scaled, as the image-to-video
        pipeline encodes its first frame. One video at a time: diffusers' VAE (0.42) builds its attention
        mask for a batch in a shape SDPA cannot broadcast beyond one sample (decode alike)."""
        z = torch.cat([parts.vae.encode(v[None].to(parts.vae.dtype)).latent_dist.mode() for v in images])
        return z.float() * parts.vae.config.scaling_factor

    def given_frames(self, cfg) -> tuple:
        """An image-to-video folder's first frame."""
        return ("image",) if self.needs_images(cfg) else ()

    def encode_clips(self, parts: HunyuanVideo15Parts, videos, sound, cond, given=(None, None)) -> tuple:
        """The videos' latents; from an image-to-video folder, each clip's first frame (or the frame its
        manifest line names: `given`) given as the pipeline gives an image (with_images: its latents and mask
        beside the noise, its SigLIP tokens), the loss on every frame as the release's trainer has it."""
        if parts.image_encoder is not None:
            from PIL import Image

            frames = videos[:, :, 0] if given[0] is None else given[0]
            first = ((frames + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 1).cpu()
            images = [Image.fromarray(frame.numpy()) for frame in first]
            (cond,) = self.with_images(parts, images, tuple(videos.shape[2:]), cond)
        return self.encode_images(parts, videos), cond

    def store_conditioning(self, cond: HunyuanVideo15Cond) -> list[dict]:
        """Each sample's real tokens of both texts (they lead; a prompt without quoted text has no glyph);
        image-to-video's first frame too (its SigLIP tokens, its latents and mask)."""
        real = lambda mask, i, n: n if mask is None else int(mask[i].sum())  # noqa: E731
        given = {k: getattr(cond, k) for k in ("image", "image_latents") if getattr(cond, k) is not None}
        return [
            {
                "text": cond.text[i, : real(cond.text_mask, i, cond.text.shape[1])],
                "glyph": cond.glyph[i, : real(cond.glyph_mask, i, cond.glyph.shape[1])],
                **{k: v[i] for k, v in given.items()},
            }
            for i in range(len(cond.text))
        ]

    def load_conditioning(self, stored: list, max_length: int) -> HunyuanVideo15Cond:
        """A batch's conditioning as `encode` gives it: each text zero-padded to the batch's longest, masked
        (None when nothing is padded)."""
        text, text_mask = padded([s["text"] for s in stored])
        glyph, glyph_mask = padded([s["glyph"] for s in stored])
        given = {k: torch.stack([s[k] for s in stored]) for k in ("image", "image_latents") if k in stored[0]}
        return HunyuanVideo15Cond(text, text_mask, glyph, glyph_mask, **given)
