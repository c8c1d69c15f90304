"""Reading and writing images and videos, and the fixed-size clip transform.

Videos are decoded with PyAV (its wheels bundle FFmpeg with x264), images with Pillow. Pixels
are float32 in [0, 1] as (frames, height, width, 3) at the edges; training clips are tensors
(3, frames, height, width) in [-1, 1].
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_EXTENSIONS = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".gif"}
OUTPUT_EXTENSIONS = (".mp4", ".gif", ".png", ".npy")


def read_image(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return (np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0)[None]  # (1, H, W, 3)


def read_video(path, max_frames: int | None = None, fps: float | None = None) -> np.ndarray:
    """Decode from the start, keeping at most max_frames frames; with fps, keep the frames nearest to
    a 1/fps time grid (drops or repeats frames to resample the rate)."""
    import av

    frames, next_time, start = [], 0.0, None
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        source_dt = 1.0 / float(stream.average_rate or fps or 1)
        for i, frame in enumerate(container.decode(stream)):
            t = float(frame.time) if frame.time is not None else i * source_dt
            start = t if start is None else start
            t -= start  # clips cut from longer videos need not start at 0
            # without fps every frame counts once; with fps, a frame fills every grid time it is nearest to
            repeats = 1
            if fps is not None:
                repeats = 0
                while next_time <= t + source_dt / 2:
                    repeats, next_time = repeats + 1, next_time + 1.0 / fps
            if repeats:
                frames.extend([frame.to_ndarray(format="rgb24")] * repeats)
            if max_frames and len(frames) >= max_frames:
                break
    if not frames:
        raise ValueError(f"{path}: no video frames could be decoded")
    return np.stack(frames[:max_frames] if max_frames else frames).astype(np.float32) / 255.0


def read_media(path, max_frames=None, fps=None) -> np.ndarray:
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        return read_image(path)
    if ext in VIDEO_EXTENSIONS:
        return read_video(path, max_frames, fps)
    raise ValueError(f"{path}: unsupported file type '{ext}' (images: {sorted(IMAGE_EXTENSIONS)}, "
                     f"videos: {sorted(VIDEO_EXTENSIONS)})")


def to_training_clip(pixels: np.ndarray, frames: int, height: int, width: int) -> torch.Tensor:
    """(T, H, W, 3) in [0, 1] -> (3, frames, height, width) in [-1, 1]: the first `frames` frames (the
    last frame repeats if the clip is shorter), resized so that it covers the target, centre-cropped."""
    video = torch.from_numpy(np.ascontiguousarray(pixels[:frames])).permute(0, 3, 1, 2)  # (T, 3, H, W)
    if video.shape[0] < frames:
        video = torch.cat([video, video[-1:].expand(frames - video.shape[0], -1, -1, -1)])
    h, w = video.shape[-2:]
    scale = max(height / h, width / w)
    if (h, w) != (height, width):
        new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
        video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
        top, left = (new_h - height) // 2, (new_w - width) // 2
        video = video[:, :, top:top + height, left:left + width]
    return (video.clamp(0, 1) * 2 - 1).permute(1, 0, 2, 3).contiguous()  # (3, T, H, W)


def write_video(path, video: np.ndarray, fps: int = 8) -> list[Path]:
    """Write (T, H, W, 3) float in [0, 1]; the format follows the extension. Returns the files written.

    .mp4 (H.264 through PyAV), .gif, .png (one image, or one numbered file per frame), .npy (the
    float32 array itself, unquantised, for exact comparisons)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in OUTPUT_EXTENSIONS:
        raise ValueError(f"unsupported output extension '{ext}' for {path}; use one of {', '.join(OUTPUT_EXTENSIONS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    video = np.asarray(video, dtype=np.float32)
    if ext == ".npy":
        np.save(path, video)
        return [path]
    frames8 = (np.clip(video, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if ext == ".png":
        from PIL import Image

        if len(frames8) == 1:
            Image.fromarray(frames8[0]).save(path)
            return [path]
        written = [path.with_name(f"{path.stem}_{i:04d}.png") for i in range(len(frames8))]
        for frame, out in zip(frames8, written):
            Image.fromarray(frame).save(out)
        return written
    if ext == ".gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames8]
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        return [path]
    import av

    # H.264 in yuv420p needs even sizes: pad by repeating the edge (the array itself is never cropped).
    h, w = frames8.shape[1:3]
    frames8 = np.pad(frames8, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames8.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        for frame in frames8:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return [path]
