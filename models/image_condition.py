"""Image-to-video conditioning (model.task=i2v / flf2v), built as diffusers' WanImageToVideoPipeline builds
it; single-device code. The first frame (and the last, for FLF2V) is resized to the video, encoded by the
VAE inside an otherwise black video, and given to the DiT as 4 mask channels (1 where a frame is given)
plus those latents, concatenated to the noisy latent's channels at every call. A model with
model.image_dim also reads the frames' CLIP features (hidden_states[-2] of a CLIPVisionModel).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn

from models.layers import PiecesOf


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
            f"the CLIP image encoder's folder {folder} (image_encoder.pretrained, else model.pretrained): no "
            "CLIPVisionModel there (config.json of a CLIP vision "
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


def image_encoder_folder(cfg) -> str:
    """image_encoder.pretrained, else model.pretrained if it is a WanImageToVideoPipeline folder; checked."""
    folder = cfg.image_encoder.pretrained or cfg.model.pretrained
    if folder is None:
        raise ValueError(
            "model.image_dim is set: name a CLIPVisionModel folder in image_encoder.pretrained (or a "
            "WanImageToVideoPipeline folder in model.pretrained)"
        )
    model_dir, _ = image_encoder_dirs(folder)
    width = clip_vision_config(model_dir)["hidden_size"]
    if width != cfg.model.image_dim:
        raise ValueError(
            f"model.image_dim={cfg.model.image_dim}, but the CLIP image encoder in {model_dir} gives "
            f"features {width} wide: set model.image_dim={width}, or name the model's own encoder"
        )
    return folder


def clip_vision_config(model_dir) -> dict:
    """The vision config.json of a CLIPVisionModel (or CLIPModel) folder, as a dict."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("vision_config", config)


# The frames each task is given: (first, last); None: optional (TI2V samples text-to-video without one).
TASK_FRAMES = {"t2v": (False, False), "i2v": (True, False), "flf2v": (True, True), "ti2v": (None, False)}


def read_images(
    task,
    given,
    names,
    count: int,
    frames: int,
    height: int,
    width: int,
    temporal_stride: int,
    multiple: tuple = (16, 16),
    say=None,
):
    """(first frames, last frames) as PIL images for `count` prompts, or (None, None) for text-to-video:
    `given` (first, last) paths (None: not given), read and checked against the task, the VAE and the
    video's aspect ratio (diffusers stretches an image to it; tessera asks for a fitting one). `names`:
    how the user sets (first, last, height, width), e.g. ("--image", "--last-image", "--height",
    "--width"), so that each error names the flag or the recipe key to change. `multiple`: what a video's
    (height, width) must divide by (VAE stride x patch), for the size a refusal suggests. `say(line)`
    gets the warning about an image much smaller than the video (default: warnings.warn)."""
    for name, paths, needed in zip(names, given, TASK_FRAMES[task]):
        if needed and not paths:
            raise ValueError(f"model.task={task} needs {name} (a PNG or JPEG file)")
        if paths and needed is False:
            fix = "model.task=flf2v" if name == names[1] and task == "i2v" else "model.task=i2v or flf2v"
            raise ValueError(
                f"{name} was given, but model.task={task} takes no such frame: drop it, or use {fix}"
            )
    if task == "t2v" or not given[0]:
        return None, None
    if temporal_stride != 4:
        raise ValueError(
            f"model.task={task} is built for Wan's VAE (4 frames a latent frame: the mask's 4 channels): "
            "set vae.kind=wan"
        )
    if task == "flf2v" and frames < 5:
        raise ValueError(
            f"model.task=flf2v needs videos of at least 5 frames (first and last apart): {frames}; set "
            f"{names[2].replace('height', 'frames')}"
        )
    read = []
    for name, paths in zip(names, given):
        if not paths:
            read.append(None)
            continue
        if len(paths) not in (1, count):
            raise ValueError(f"{name}: give one image for every prompt or one for each of the {count}")
        images = [load_image(path) for path in paths] * (count if len(paths) == 1 else 1)
        for path, image in zip(paths, images):
            w, h = image.size
            if abs(w / h - width / height) > 0.1 * width / height:  # resized to the video: stretched a little
                raise ValueError(
                    f"{name} {path} is {w}x{h} and the video {width}x{height}: their shapes differ; "
                    + fitting_size(w, h, width, height, names[2:], multiple)
                )
        warn_if_small(name, paths, images, width, height, say)
        read.append(images)
    return read[0], read[1]


MAX_ASPECT = 4.0  # an image wider (or taller) than this is cropped, not matched by a video of its shape
SMALL_IMAGE = 4  # an image smaller than the video by more than this factor in a side is warned about


def fitting_size(w: int, h: int, width: int, height: int, flags, multiple) -> str:
    """What to do about a w x h image for a width x height video: the size of the image's shape at about
    the video's area (each side a multiple of `multiple`, (height, width)), or cropping where no such
    video exists (an extreme aspect ratio, or one the multiples cannot come near)."""
    crop = f"crop the image to the video's shape ({width}x{height}) first"
    if max(w / h, h / w) > MAX_ASPECT:
        return f"an aspect ratio beyond {MAX_ASPECT:g}:1 is no video's: {crop}"
    area, (mh, mw) = width * height, multiple
    fit_h = max(mh, round((area * h / w) ** 0.5 / mh) * mh)
    fit_w = max(mw, round((area * w / h) ** 0.5 / mw) * mw)
    if abs(fit_w / fit_h - w / h) > 0.1 * w / h:
        return crop
    sep = " " if flags[0].startswith("--") else "="
    size = f"{flags[0]}{sep}{fit_h} {flags[1]}{sep}{fit_w}"
    return f"{crop}, or give {size} (the image's shape at about the video's area)"


def warn_if_small(name: str, paths, images, width: int, height: int, say=None) -> None:
    """One warning per file much smaller than the video: it is enlarged, and the frame will be blurred."""
    import warnings

    say = say or (lambda line: warnings.warn(line, stacklevel=3))
    for path, image in dict(zip(paths, images)).items():
        w, h = image.size
        if w * SMALL_IMAGE < width or h * SMALL_IMAGE < height:
            say(
                f"{name} {path} is {w}x{h}, enlarged over {SMALL_IMAGE} times to the video's "
                f"{width}x{height}: its frame will be blurred (give a larger image)"
            )


def image_inputs(cfg, device):
    """Image-to-video's (last frame too?, the frozen CLIP encoder or None) for training and
    precompute_latents (model.task=i2v / flf2v); None otherwise (TI2V's condition is the clip's own first
    latent frame)."""
    if cfg.model.task not in ("i2v", "flf2v"):
        return None
    from models.util import reading_weights

    encoder = None
    if cfg.model.image_dim:
        folder = image_encoder_folder(cfg)
        with reading_weights(f"the image encoder ({folder})"):
            encoder = ImageEncoder(folder).to(device)
    return (cfg.model.task == "flf2v", encoder)


def sampling_condition(task, vae, image_encoder, images, last_images, frames, height, width, device):
    """The condition infer.py and training previews sample with, from first (last) frames as PIL images:
    TI2V's first-frame latent, or I2V / FLF2V's mask, latents and CLIP features; None without images."""
    if images is None:
        return None
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=vae.spatial_stride)
    pixels = lambda given: processor.preprocess(given, height=height, width=width).to(device, torch.float32)  # noqa: E731
    first = pixels(images)  # [-1, 1]
    if task == "ti2v":  # each first frame VAE-encoded alone, as diffusers does with expand_timesteps
        latent = torch.cat([vae.encode(one[:, :, None]) for one in first.split(1)])
        return ImageCondition(latent.float(), None, first_frame=True)
    last = None if last_images is None else pixels(last_images)
    return _condition(vae, image_encoder, first, last, frames, images, last_images)


# Pillow's modes of 16-bit (and 32-bit integer) grayscale: a 16-bit PNG opens as I;16 (older Pillows: I)
WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def open_image(path):
    """An 8-bit RGB Pillow image, turned upright by its EXIF orientation (phones store portrait shots
    sideways): the one reader of image files for training data (data/media.py) and for --image /
    sample.images."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        return rgb_image(ImageOps.exif_transpose(im))


def rgb_image(image):
    """`image` as 8-bit RGB. 16-bit grayscale is scaled to 8 bits (value / 257, rounded: the inverse of
    8 -> 16-bit's value x 257): Pillow's convert("RGB") clips every value above 255, a white frame. A float
    image (mode F: a float TIFF) whose values lie in [0, 1] is read on that scale (Pillow's conversion
    takes 0..255 and gives a black frame), one with larger values on 0..255; NaN or inf pixels are a
    ValueError (Pillow would turn them into 0 and 255 without a word)."""
    import numpy as np
    from PIL import Image

    if image.mode in WIDE_GRAY_MODES:
        wide = np.asarray(image).astype(np.float64)
        image = Image.fromarray(np.clip(np.round(wide / 257.0), 0, 255).astype(np.uint8))
    elif image.mode == "F":
        values = np.asarray(image, dtype=np.float64)
        bad = int((~np.isfinite(values)).sum())
        if bad:
            raise ValueError(f"{bad} of its {values.size} pixels are NaN or inf (a float image)")
        scale = 255.0 if values.max(initial=0.0) <= 1.0 else 1.0
        image = Image.fromarray(np.clip(np.round(values * scale), 0, 255).astype(np.uint8))
    return image.convert("RGB")


def load_image(path):
    """An 8-bit RGB PIL image (read as training data reads one: upright, 16-bit grayscale scaled), or a
    FileNotFoundError naming the file."""
    from PIL import UnidentifiedImageError

    try:  # a phone's JPEG turned upright by its EXIF orientation, as diffusers' load_image does
        return open_image(path)
    except (OSError, UnidentifiedImageError) as e:
        raise FileNotFoundError(f"{path} cannot be read as an image ({e})") from None
    except ValueError as e:  # NaN or inf pixels
        raise ValueError(f"{path} cannot be used as an image: {e}") from None


@dataclass
class ImageCondition:
    latent: torch.Tensor  # (B, 4 + C, t, h, w): the mask's 4 channels, then the given frames' latents
    features: torch.Tensor | None  # (B, tokens, width) CLIP features; FLF2V (2B, ...): first, last; or None
    # Wan2.2 TI2V (expand_timesteps): `latent` is the first frame's alone, (B, C, 1, h, w); it replaces the
    # first latent frame of every model input and of the result, and that frame's tokens get t = 0
    first_frame: bool = False


def condition_of_clips(vae, image_encoder, video, last_frame: bool, first=None, last=None) -> ImageCondition:
    """Training's condition of clips `video` (B, 3, T, H, W) in [-1, 1]: their first frames (and with
    `last_frame`, FLF2V, their last), or the frames `first` / `last` (B, 3, H, W) a manifest names, built
    as sampling builds it from an image file (encoded whole, not in the clips' tiles, as infer.py and
    diffusers encode it)."""
    first = video[:, :, 0] if first is None else first
    last = (video[:, :, -1] if last is None else last) if last_frame else None
    pictures = lambda frames: None if frames is None else [_picture(f) for f in frames]  # noqa: E731
    return _condition(vae, image_encoder, first, last, video.shape[2], pictures(first), pictures(last))


def _picture(frame: torch.Tensor):
    """A (3, H, W) frame in [-1, 1] as the 8-bit RGB image the CLIP processor reads from a file."""
    from PIL import Image

    pixels = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())


def _condition(vae, image_encoder, first, last, frames, images, last_images) -> ImageCondition:
    """The mask and the latents of a black video with the given frames, and the frames' CLIP features."""
    B, C, H, W = first.shape
    video = first.new_zeros(B, C, frames, H, W)
    video[:, :, 0] = first
    if last is not None:
        video[:, :, -1] = last
    # (B, C, t, h, w), normalised as the DiT's latents are; one video at a time (activation memory)
    latent = torch.cat([vae.encode(one) for one in video.split(1)])
    B, _, _, h, w = latent.shape
    stride = vae.temporal_stride
    given = torch.zeros(B, 1, frames, h, w, device=latent.device)
    given[:, :, 0] = 1
    if last is not None:
        given[:, :, -1] = 1
    # the first frame stands for a whole latent frame: its flag repeats `stride` times, then 4 per latent
    mask = torch.cat([given[:, :, :1].repeat_interleave(stride, dim=2), given[:, :, 1:]], dim=2)
    mask = mask.view(B, -1, stride, h, w).transpose(1, 2)  # (B, stride, t, h, w)
    features = None
    if image_encoder is not None:
        pairs = images if last_images is None else [im for pair in zip(images, last_images) for im in pair]
        features = image_encoder(pairs, latent.device)
    return ImageCondition(torch.cat([mask, latent.float()], dim=1), features)


class ConditionedModel:
    """model(x, t, y, y_mask) with the image condition: its latent concatenated to x's channels and its
    features given to the DiT, both repeated to x's batch (guidance runs both branches as one batch)."""

    def __init__(self, model, condition: ImageCondition):
        self.model, self.condition = model, condition

    def __call__(self, x, t, y, y_mask):
        repeats = x.shape[0] // self.condition.latent.shape[0]
        latent = self.condition.latent.to(x.dtype).repeat(repeats, 1, 1, 1, 1)
        if self.condition.first_frame:  # TI2V: the given frame's latent in place, its tokens at t = 0
            x = torch.cat([latent, x[:, :, 1:]], dim=2)
            pt, ph, pw = self.model.patch_size
            T, H, W = x.shape[2:]
            t = t.view(-1, 1).expand(-1, (T // pt) * (H // ph) * (W // pw)).clone()
            t[:, : (H // ph) * (W // pw)] = 0  # the first latent frame's tokens (patch_size[0] = 1)
            return self.model(x, t, y, y_mask)
        features = self.condition.features
        if features is not None:
            features = features.repeat(repeats, 1, 1)
        return self.model(torch.cat([x, latent], dim=1), t, y, y_mask, features)


class ConditionedPieces(PiecesOf):
    """The DiT's patch pieces (PipeFusion's) with the image condition, as ConditionedModel gives it to a
    whole call: embed reads the latent with the condition's channels (TI2V: the given frame in place),
    patch_context the CLIP features (TI2V: t = 0 on the given frame's tokens); the rest is the model's."""

    def __init__(self, model, condition: ImageCondition):
        super().__init__(model)
        self.condition = condition

    def embed(self, x):
        latent = self.condition.latent.to(x.dtype)
        if self.condition.first_frame:
            return self.model.embed(torch.cat([latent, x[:, :, 1:]], dim=2))
        return self.model.embed(torch.cat([x, latent], dim=1))

    def patch_context(self, t, cond, grid):
        if self.condition.first_frame:  # the first token frame's tokens (patch_size[0] = 1) at t = 0
            t = t.view(-1, 1).expand(-1, grid[0] * grid[1] * grid[2]).clone()
            t[:, : grid[1] * grid[2]] = 0
        else:
            cond = replace(cond, image_features=self.condition.features)
        return self.model.patch_context(t, cond, grid)


def first_frames(paths: list, count: int, name: str) -> list:
    """Each of `count` prompts' first frame (PIL, read as training data is: load_image) from `paths`, one
    for every prompt or one each; another count or an unreadable file is a ValueError naming `name`
    (--image, sample.images)."""
    if len(paths) not in (1, count):
        raise ValueError(f"{name}: give one image for every prompt or one for each of the {count}")
    try:
        images = [load_image(path) for path in paths]
    except FileNotFoundError as e:
        raise ValueError(f"{name}: {e}") from None
    return images * (count if len(paths) == 1 else 1)
