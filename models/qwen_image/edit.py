"""Qwen-Image-Edit-2509 and 2511 as a tessera family (diffusers' QwenImageEditPlusPipeline): Qwen-Image's
transformer, text encoder, VAE, schedule and true CFG, conditioned on one to three reference images
(infer.py --image a.png [b.png c.png], in order: Picture 1, 2, 3). Each reference is used twice, as the
pipeline uses it: sized to about 384 x 384 for Qwen2.5-VL, which reads it with the instruction, and to
about 1024 x 1024 for the VAE, whose latents join the image tokens after the noisy ones (clean, never
noised; their RoPE frame is their index; 2511's are modulated at t = 0). The output's size, unless given,
is the pipeline's: about 1024 x 1024 at the last reference's aspect ratio.
"""

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from models.family import REFERENCES, Components, part_folder
from models.qwen_image.family import QwenImage
from models.qwen_image.text import encode_edit_prompt
from models.qwen_image.transformer import QwenImageCond, pack_latents

# the pipeline's: Qwen2.5-VL's reading of a reference, the VAE's (model.reference_area), the output's default
CONDITION_AREA, VAE_AREA, OUTPUT_AREA = 384 * 384, 1024 * 1024, 1024 * 1024
MAX_REFERENCES = 3  # the release's: "Picture 1" to "Picture 3"


def pipeline_size(area: int, image) -> tuple:
    """(height, width) of about `area` pixels at the image's aspect ratio, sides rounded to multiples of 32
    (the pipeline's calculate_dimensions)."""
    ratio = image.width / image.height
    width = math.sqrt(area * ratio)
    return round(width / ratio / 32) * 32, round(width / 32) * 32


def reference_area(cfg) -> int:
    """The pixels a reference reaches the VAE at: model.reference_area, else the pipeline's."""
    return cfg.model.reference_area or VAE_AREA


def reference_latents(z, config) -> torch.Tensor:
    """(z - mean) / std, as the pipeline normalises its references (its text-to-image sibling multiplies by
    1 / std: a rounding apart)."""
    stats = lambda v: torch.tensor(v).view(1, -1, 1, 1, 1).to(z.device, z.dtype)  # noqa: E731
    return (z - stats(config.latents_mean)) / stats(config.latents_std)


@dataclass
class QwenImageEditParts(Components):
    image_processor: object = None  # Qwen2.5-VL's (the pipeline's processor/), and its tokenizer
    vision_tokenizer: object = None
    reference_area: int = VAE_AREA  # the pixels a reference is sized to for the VAE


class QwenImageEdit(QwenImage):
    name, title = "qwen_image_edit", "Qwen-Image-Edit"
    # its transformer's class is Qwen-Image's: a pipeline folder is told apart by its pipeline's class
    # (Family.recognises); a bare transformer folder is Qwen-Image's (the first of the two registered)
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    # Qwen-Image's layouts: under ulysses or ring the references' tokens split with the noisy ones; through
    # PipeFusion's and the first-block cache's patch pieces they pass beside each patch, as the text
    capabilities = replace(QwenImage.capabilities, references=True, max_references=MAX_REFERENCES)

    def check_pretrained(self, cfg) -> None:
        super().check_pretrained(cfg)
        folder = part_folder(cfg, "processor")
        if not any(folder.glob("*.json")):
            raise FileNotFoundError(
                f"model.pretrained: no {self.title} processor in {folder} (Qwen2.5-VL's image processor, "
                "part of the pipeline folder; tessera never downloads)"
            )

    def takes_images(self, cfg) -> bool:
        return True

    def given_frames(self, cfg) -> tuple:
        """Its training reads each manifest line's references (models/family.py REFERENCES)."""
        return (REFERENCES,)

    def check_training(self, cfg) -> None:
        """Edit pairs from a manifest or a folder (or their precomputed latents), one a rank a step (each
        line's references have their own sizes), its previews editing sample.images."""
        if not (cfg.data.manifest or cfg.data.latents):
            raise ValueError(
                f"{self.title} trains on edit pairs: set data.manifest (each line's path the target, caption "
                "the instruction, references its input images), or data.latents precomputed from one"
            )
        if cfg.train.batch_size != 1:
            raise ValueError(
                f"train.batch_size={cfg.train.batch_size}: {self.title} trains one edit pair a rank a step "
                "(each line's references have their own sizes); set it to 1 and use more ranks"
            )
        if not cfg.sample.images:
            raise ValueError(
                f"sample.images is empty: {self.title}'s previews edit images; name 1 to {MAX_REFERENCES}"
            )

    def encode_batch(self, parts: QwenImageEditParts, prompts: list, max_length: int, batch: dict):
        """The pair's instruction read with its references, and their latents, as the pipeline gives them."""
        from PIL import Image

        if not batch.get(REFERENCES) or not batch[REFERENCES][0]:
            raise ValueError(f"{self.title} trains on edit pairs: the manifest line names no references")
        images = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in batch[REFERENCES][0]]
        sampling = SimpleNamespace(prompts=prompts, images=[images], guidance=1.0, negative_prompt="")
        return self.conditionings(parts, sampling)[0]

    def store_conditioning(self, cond) -> list[dict]:
        """Each pair's instruction as read with its images (its real tokens), its references' packed
        latents and their token grids."""
        stored = super().store_conditioning(QwenImageCond(cond.text, cond.text_mask))
        for i, sample in enumerate(stored):
            if cond.references is not None:  # (the empty prompt's, for a latents folder, has none)
                sample.update(references=cond.references[i], reference_grids=cond.reference_grids[i])
        return stored

    def load_conditioning(self, stored: list, max_length: int):
        """A batch's (one pair's) stored conditioning, as encode_batch gives it."""
        cond = super().load_conditioning(stored, max_length)
        grids = torch.stack([s["reference_grids"] for s in stored]).round().long()  # stored as float32
        return replace(cond, references=torch.stack([s["references"] for s in stored]), reference_grids=grids)

    def dropped_conditioning(self, parts: Components, max_length: int, batch: dict) -> dict:
        """A dropped instruction is the empty one read with the pair's images, not the empty prompt."""
        return {"text": self.store_conditioning(self.encode_batch(parts, [""], max_length, batch))[0]["text"]}

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """The target's latents as the pipeline's own pieces make its references': (z - mean) / std."""
        z = parts.vae.encode(images.to(parts.vae.dtype)).latent_dist.mode()
        return reference_latents(z, parts.vae.config).float()

    def sampling_images(self, cfg, given: tuple, count: int, size: tuple, sized: bool, say=None) -> tuple:
        """Every prompt's references (--image, in order; read as training data is), and the size: the
        flags' (--height, --width), else the pipeline's for the last reference (the recipe's sample.height
        and width are not read with --image, as for every family that sizes from its images)."""
        from models.image_condition import load_image

        paths, last = given
        if last:
            raise ValueError(f"--last-image: {self.title} takes its references from --image alone")
        if not paths:
            raise ValueError(
                f"{self.title} edits images: give 1 to {MAX_REFERENCES} with --image (PNG or JPEG files)"
            )
        if len(paths) > MAX_REFERENCES:
            raise ValueError(
                f"--image: {len(paths)} images; {self.title} takes 1 to {MAX_REFERENCES} (Picture 1 to "
                f"{MAX_REFERENCES} of its template)"
            )
        try:
            images = [load_image(path) for path in paths]
        except FileNotFoundError as e:
            raise ValueError(f"--image: {e}") from None
        _, height, width = size
        if not sized:
            multiple = 2 * self.vae_scale(cfg)
            height, width = (side // multiple * multiple for side in pipeline_size(OUTPUT_AREA, images[-1]))
            if say is not None:
                say(f"--image: sampling {width}x{height}, the size {self.title}'s pipeline picks for the "
                    "last image (give --height and --width for another)")  # fmt: skip
        return [images] * count, None, height, width

    def load(
        self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True
    ) -> QwenImageEditParts:
        from transformers import AutoImageProcessor, AutoTokenizer

        parts, folder = (
            super().load(cfg, device, dtype, transformer, keep, texts),
            part_folder(cfg, "processor"),
        )
        return QwenImageEditParts(
            **vars(parts),
            image_processor=AutoImageProcessor.from_pretrained(folder),
            vision_tokenizer=AutoTokenizer.from_pretrained(folder),
            reference_area=reference_area(cfg),
        )

    def latent_record(self, cfg) -> dict:
        """The references' size, where not the pipeline's: their stored latents are that size."""
        area = reference_area(cfg)
        return {} if area == VAE_AREA else {"reference_area": area}

    def conditionings(self, parts: QwenImageEditParts, sampling) -> tuple:
        """Both branches encoded with the references, as the pipeline encodes them (the negative prompt
        too), and the references' latents (the mode, normalised) packed after the noisy tokens."""
        from diffusers.image_processor import VaeImageProcessor

        images = sampling.images[0]  # the same references for every prompt
        scale = 2 ** len(parts.vae.temperal_downsample)
        processor = VaeImageProcessor(vae_scale_factor=scale * 2)
        small = [processor.resize(image, *pipeline_size(CONDITION_AREA, image)) for image in images]
        vision = (parts.image_processor, parts.vision_tokenizer, parts.text_encoder)
        count, encode = len(sampling.prompts), lambda p: encode_edit_prompt(p, small, *vision)  # noqa: E731
        cond, uncond = encode(sampling.prompts), None
        if self.guidance.guided(sampling.guidance):
            uncond = encode([sampling.negative_prompt] * count)
        tokens, grids = [], []
        device = next(parts.vae.parameters()).device
        for image in images:
            pixels = processor.preprocess(image, *pipeline_size(parts.reference_area, image)).unsqueeze(2)
            with torch.no_grad():
                z = parts.vae.encode(pixels.to(device, parts.vae.dtype)).latent_dist.mode()
            z = reference_latents(z, parts.vae.config)
            tokens.append(pack_latents(z))
            grids.append((1, z.shape[-2] // 2, z.shape[-1] // 2))
        references = dict(
            references=torch.cat(tokens, dim=1).expand(count, -1, -1),
            reference_grids=torch.tensor([grids] * count, device=device),
        )
        given = lambda c: None if c is None else replace(self.conditioning(*c), **references)  # noqa: E731
        return given(cond), given(uncond)
