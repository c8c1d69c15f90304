"""Image-to-video conditioning (model.task=i2v / flf2v), built as diffusers' WanImageToVideoPipeline builds
it; single-device code. The first frame (and the last, for FLF2V) is resized to the video, encoded by the
VAE inside an otherwise black video, and given to the DiT as 4 mask channels (1 where a frame is given)
plus those latents, concatenated to the noisy latent's channels at every call. A model with
model.image_dim also reads the frames' CLIP features (hidden_states[-2] of a CLIPVisionModel).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn


def image_encoder_dirs(folder) -> tuple[Path, Path]:
    """(the CLIPVisionModel's folder, its CLIPImageProcessor's) in `folder`, a CLIP folder or a
    WanImageToVideoPipeline folder (image_encoder/, image_processor/); a FileNotFoundError naming what is
    missing, read from two small files."""
    import json

    root = Path(folder)
    model_dir, processor_dir = root / "image_encoder", root / "image_processor"
    if not (model_dir / "config.json").is_file():
        model_dir = processor_dir = root
    try:
        kind = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        kind = None
    if (
        kind not in ("clip_vision_model", "clip")
        or not (processor_dir / "preprocessor_config.json").is_file()
    ):
        raise FileNotFoundError(
            f"image_encoder.pretrained={folder}: no CLIPVisionModel there (config.json of a CLIP vision "
            "model and its preprocessor_config.json), nor the image_encoder/ and image_processor/ folders "
            "of a WanImageToVideoPipeline"
        )
    return model_dir, processor_dir


class ImageEncoder(nn.Module):
    """transformers' CLIPVisionModel and its CLIPImageProcessor from a local folder, frozen."""

    def __init__(self, folder):
        super().__init__()
        from transformers import CLIPImageProcessor, CLIPVisionModel

        model_dir, processor_dir = image_encoder_dirs(folder)
        # float32 whatever the folder stores, as Wan runs its CLIP (transformers 5 loads the stored dtype)
        self.model = (
            CLIPVisionModel.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
        )
        self.processor = CLIPImageProcessor.from_pretrained(processor_dir)

    @torch.no_grad()
    def forward(self, images: list, device) -> torch.Tensor:
        """(len(images), tokens, width) float32: the features Wan's image embedder reads."""
        pixels = self.processor(images=images, return_tensors="pt").pixel_values
        out = self.model(pixel_values=pixels.to(device, self.model.dtype), output_hidden_states=True)
        return out.hidden_states[-2].float()


def load_image(path):
    """An RGB PIL image, or a FileNotFoundError naming the file."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:  # a phone's JPEG turned upright by its EXIF orientation, as diffusers' load_image does
        return ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise FileNotFoundError(f"{path} cannot be read as an image ({e})") from None


@dataclass
class ImageCondition:
    latent: torch.Tensor  # (B, 4 + C, t, h, w): the mask's 4 channels, then the given frames' latents
    features: torch.Tensor | None  # (B, tokens, width) CLIP features; FLF2V (2B, ...): first, last; or None


def encode_condition(
    vae, image_encoder, images, last_images, frames, height, width, device
) -> ImageCondition:
    """The condition of B videos of `frames` x `height` x `width` from their first frames `images` (PIL)
    and, for FLF2V, their last frames `last_images` (else None)."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=vae.spatial_stride)
    first = processor.preprocess(images, height=height, width=width).to(device, torch.float32)  # [-1, 1]
    video = first.new_zeros(first.shape[0], first.shape[1], frames, height, width)
    video[:, :, 0] = first
    if last_images is not None:
        video[:, :, -1] = processor.preprocess(last_images, height=height, width=width).to(device)
    # (B, C, t, h, w), normalised as the DiT's latents are; one video at a time (activation memory)
    latent = torch.cat([vae.encode(one) for one in video.split(1)])
    B, _, _, h, w = latent.shape
    stride = vae.temporal_stride
    given = torch.zeros(B, 1, frames, h, w, device=device)
    given[:, :, 0] = 1
    if last_images is not None:
        given[:, :, -1] = 1
    # the first frame stands for a whole latent frame: its flag repeats `stride` times, then 4 per latent
    mask = torch.cat([given[:, :, :1].repeat_interleave(stride, dim=2), given[:, :, 1:]], dim=2)
    mask = mask.view(B, -1, stride, h, w).transpose(1, 2)  # (B, stride, t, h, w)
    features = None
    if image_encoder is not None:
        pairs = images if last_images is None else [im for pair in zip(images, last_images) for im in pair]
        features = image_encoder(pairs, device)
    return ImageCondition(torch.cat([mask, latent], dim=1), features)


class ConditionedModel:
    """model(x, t, y, y_mask) with the image condition: its latent concatenated to x's channels and its
    features given to the DiT, both repeated to x's batch (guidance runs both branches as one batch)."""

    def __init__(self, model, condition: ImageCondition):
        self.model, self.condition = model, condition

    def __call__(self, x, t, y, y_mask):
        repeats = x.shape[0] // self.condition.latent.shape[0]
        latent = self.condition.latent.to(x.dtype).repeat(repeats, 1, 1, 1, 1)
        features = self.condition.features
        if features is not None:
            features = features.repeat(repeats, 1, 1)
        return self.model(torch.cat([x, latent], dim=1), t, y, y_mask, features)
