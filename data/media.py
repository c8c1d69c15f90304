"""Reading and writing images and videos, and the fixed-size clip transform.

Videos are decoded with PyAV (its wheels bundle FFmpeg with x264), images with Pillow. Whole
files read for inspection are float32 in [0, 1] as (frames, height, width, 3); training clips are
uint8 (frames, height, width, 3), a quarter of the bytes between loader workers and the trainer,
and become [-1, 1] floats on the device (`to_model_range`).
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


def cover_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """The smallest size with the source's aspect ratio that covers the target (resize, then centre-crop)."""
    scale = max(target_h / height, target_w / width)
    return max(target_h, round(height * scale)), max(target_w, round(width * scale))


def centre_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(..., H, W, 3) -> (..., height, width, 3), keeping the centre."""
    top, left = (pixels.shape[-3] - height) // 2, (pixels.shape[-2] - width) // 2
    return pixels[..., top:top + height, left:left + width, :]


def fit_to_bucket(pixels: np.ndarray, frames: int, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) float in [0, 1] or uint8 -> (frames, height, width, 3) uint8: the first `frames`
    frames (a clip that is too short is an error), resized to cover the size, centre-cropped."""
    if pixels.shape[0] < frames:
        raise ValueError(f"too short: {pixels.shape[0]} frames, the bucket needs {frames}")
    video = torch.from_numpy(np.ascontiguousarray(pixels[:frames]))
    video = video.float() / 255.0 if video.dtype == torch.uint8 else video.float()
    h, w = video.shape[1:3]
    if (h, w) != (height, width):
        new_h, new_w = cover_size(h, w, height, width)
        video = F.interpolate(video.permute(0, 3, 1, 2), size=(new_h, new_w), mode="bilinear", antialias=True,
                              align_corners=False).permute(0, 2, 3, 1)
        video = centre_crop(video, height, width)
    return (video.clamp(0, 1) * 255.0 + 0.5).to(torch.uint8).numpy()


def to_model_range(video: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (any layout) -> float32 in [-1, 1], the range the VAEs and the pixel-space DiT use."""
    return video.float() / 127.5 - 1.0


def probe_media(path) -> dict:
    """width, height, num_frames and fps (None for images) from the file's headers, without decoding
    (a video whose container does not store its frame count is counted by demuxing, still not decoding)."""
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        from PIL import Image

        with Image.open(path) as im:
            return {"width": im.width, "height": im.height, "num_frames": 1, "fps": None}
    if ext not in VIDEO_EXTENSIONS:
        raise ValueError(f"unsupported file type '{ext}'")
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        frames = stream.frames
        if not frames:
            frames = sum(1 for packet in container.demux(stream) if packet.size)
        return {"width": stream.codec_context.width, "height": stream.codec_context.height, "num_frames": int(frames),
                "fps": rate or None}


def read_clip(path, frames: int, height: int, width: int, fps: float | None = None,
              rng: np.random.Generator | None = None) -> np.ndarray:
    """One training clip as (frames, height, width, 3) uint8, resized to cover the size and centre-cropped.

    Videos: the clip starts at a time drawn from `rng` (at 0 without one), the decoder seeks to the
    key frame before it and decodes only until the clip is complete; with `fps` each time on the
    1/fps grid takes the frame nearest to it (frames are dropped or repeated), without it frames
    are consecutive. Each frame is scaled by FFmpeg straight to the cover size, so memory holds
    `frames` small frames, never the source resolution. A clip that is too short raises ValueError.
    """
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        if frames != 1:
            raise ValueError(f"an image cannot fill a {frames}-frame bucket")
        return fit_to_bucket(read_image(path), 1, height, width)
    if ext not in VIDEO_EXTENSIONS:
        raise ValueError(f"unsupported file type '{ext}'")
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate or stream.guessed_rate or 0) or fps or 24.0
        frame_dt, grid_dt = 1.0 / rate, 1.0 / (fps or rate)
        base = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        length = stream.frames or (round(float(stream.duration * stream.time_base) * rate) if stream.duration else 0)
        span = (frames - 1) * grid_dt
        last = (length - 1) * frame_dt if length else None
        if last is not None and span > last + frame_dt / 2 + 1e-6:
            raise ValueError(f"too short: {length} frames at {rate:g} fps, the bucket needs {frames} at {fps or rate:g} fps")
        start = 0.0
        if rng is not None and last is not None and last > span:
            start = float(rng.uniform(0.0, last - span))
            if fps is None:
                start = round(start * rate) * frame_dt  # on a frame: consecutive frames, none repeated
        if start > 0:
            container.seek(int((start + base) / stream.time_base), stream=stream, backward=True, any_frame=False)
        cover = cover_size(stream.codec_context.height, stream.codec_context.width, height, width)
        interpolation = "AREA" if cover[0] < stream.codec_context.height else "BICUBIC"
        grid = start + grid_dt * np.arange(frames)
        out, pending = [], 0
        for i, frame in enumerate(container.decode(stream)):
            t = float(frame.time) - base if frame.time is not None else i * frame_dt
            picked = None
            # a frame is the nearest one to every grid time in (t - dt/2, t + dt/2]
            while pending < frames and grid[pending] <= t + frame_dt / 2 + 1e-9:
                if picked is None:
                    picked = centre_crop(frame.to_ndarray(format="rgb24", width=cover[1], height=cover[0],
                                                          interpolation=interpolation), height, width)
                out.append(picked)
                pending += 1
            if pending == frames:
                break
    if len(out) < frames:
        raise ValueError(f"too short: {len(out)} of {frames} frames decoded from {start:.2f} s")
    return np.stack(out)


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
