"""Reading and writing images and videos, and the fixed-size clip transform.

Videos are decoded with PyAV (its wheels bundle FFmpeg with x264), images with Pillow. Whole
files read for inspection are float32 in [0, 1] as (frames, height, width, 3); training clips are
uint8 (frames, height, width, 3), a quarter of the bytes between loader workers and the trainer,
and become [-1, 1] floats on the device (`to_model_range`).
"""

import collections
import contextlib
import itertools
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.image_condition import open_image

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}
VIDEO_EXTENSIONS = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".gif"}
OUTPUT_EXTENSIONS = (".mp4", ".gif", ".png", ".npy")


def read_image(path) -> np.ndarray:
    return (np.asarray(open_image(path), dtype=np.float32) / 255.0)[None]  # (1, H, W, 3)


def _decoder_threads() -> int:
    """One thread inside a DataLoader worker (the workers are the parallelism); FFmpeg's choice elsewhere."""
    from torch.utils.data import get_worker_info

    return 1 if get_worker_info() is not None else 0


def _open_video(path):
    import av

    container = av.open(str(path))
    if not container.streams.video:
        container.close()
        raise ValueError("no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    stream.codec_context.thread_count = _decoder_threads()
    return container, stream


def _native_rate(stream) -> float | None:
    return float(stream.average_rate or stream.guessed_rate or 0) or None


def _frame_rate(stream, fallback: float | None = None) -> float:
    return _native_rate(stream) or fallback or 24.0


def _stream_start(stream) -> float:
    """When the stream's first frame is shown: clips cut from longer videos need not start at 0."""
    return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


def _seek(container, stream, seconds: float) -> None:
    """To the key frame at or before `seconds` after the stream's start."""
    container.seek(
        int((seconds + _stream_start(stream)) / stream.time_base),
        stream=stream,
        backward=True,
        any_frame=False,
    )


def _sideways(rotation: int) -> bool:
    """A display rotation of 90 or 270 degrees swaps width and height."""
    return round(rotation / 90) % 2 == 1


def frames_at_rate(num_frames, source_fps, target_fps: float | None):
    """Frames a clip of `num_frames` at `source_fps` yields on a 1/target_fps grid within its span:
    numbers or numpy arrays (a missing source rate, None or NaN, or no target: the clip as it is).
    The one rule for bucket assignment, stand-ins and the loader's too-short check."""
    num_frames = np.asarray(num_frames, dtype=np.int64)
    if not target_fps:
        return num_frames
    source = np.asarray(np.nan if source_fps is None else source_fps, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        resampled = 1 + np.floor((num_frames - 1) * target_fps / source + 1e-6)
    return np.where((num_frames > 1) & (source > 0), resampled, num_frames).astype(np.int64)


def _header_frame_count(stream, rate: float) -> int:
    """Frames shown, from the headers (0 if they do not say). An mp4 cut with stream copy counts the
    pre-roll packets its edit list hides, so the stream's duration caps the count."""
    counted = stream.frames or 0
    shown = round(float(stream.duration * stream.time_base) * rate) if stream.duration else 0
    return min(counted, shown) if counted and shown else counted or shown


def _nearest_frames(decoded, grid: np.ndarray, frame_dt: float, take):
    """For each time of the ascending `grid`, the decoded frame nearest to it, as `take(frame)`; a frame
    nearest to several grid times is repeated. Frames come as (time, frame); the midpoint between
    neighbours decides, so variable frame rates are resampled correctly. Stops once the grid is full."""
    out, previous = [], None
    for t, frame in decoded:
        if previous is not None:
            boundary, picked = (previous[0] + t) / 2, None
            while len(out) < len(grid) and grid[len(out)] <= boundary + 1e-9:
                picked = take(previous[1]) if picked is None else picked
                out.append(picked)
            if len(out) == len(grid):
                return out
        previous = (t, frame)
    if previous is not None:  # the last frame covers half a frame after it
        picked = None
        while len(out) < len(grid) and grid[len(out)] <= previous[0] + frame_dt / 2 + 1e-9:
            picked = take(previous[1]) if picked is None else picked
            out.append(picked)
    return out


def _timed_frames(container, stream, frame_dt: float):
    """(seconds since the stream's start, frame) of every decoded frame from the current position."""
    base = _stream_start(stream)
    for i, frame in enumerate(container.decode(stream)):
        yield (float(frame.time) - base if frame.time is not None else i * frame_dt), frame


def _upright(pixels: np.ndarray, rotation: int) -> np.ndarray:
    """Apply a stream's display rotation (degrees counter-clockwise, as phones record portrait video)."""
    turns = round(rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(pixels, turns)) if turns else pixels


def read_video(path, max_frames: int | None = None, fps: float | None = None) -> np.ndarray:
    """The whole video (at most max_frames frames) at its native size, float32 in [0, 1]; with fps,
    the frames nearest to a 1/fps time grid (frames are dropped or repeated to resample the rate)."""
    container, stream = _open_video(path)
    with container:
        rate = _frame_rate(stream, fps)
        decoded = _timed_frames(container, stream, 1.0 / rate)
        if fps is None:
            frames = [f for _, (_, f) in zip(range(max_frames or 2**62), decoded)]
        else:
            count = max_frames or int(frames_at_rate(_header_frame_count(stream, rate) or 2**20, rate, fps))
            frames = _nearest_frames(decoded, np.arange(count) / fps, 1.0 / rate, lambda f: f)
        arrays = [_upright(f.to_ndarray(format="rgb24"), f.rotation) for f in frames]
    if not arrays:
        raise ValueError(f"{path}: no video frames could be decoded")
    return np.stack(arrays).astype(np.float32) / 255.0


def cover_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """The smallest size with the source's aspect ratio that covers the target (resize, then centre-crop)."""
    scale = max(target_h / height, target_w / width)
    return max(target_h, round(height * scale)), max(target_w, round(width * scale))


def centre_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(..., H, W, 3) -> (..., height, width, 3), keeping the centre."""
    top, left = (pixels.shape[-3] - height) // 2, (pixels.shape[-2] - width) // 2
    return pixels[..., top : top + height, left : left + width, :]


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
        video = F.interpolate(
            video.permute(0, 3, 1, 2),
            size=(new_h, new_w),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        ).permute(0, 2, 3, 1)
        video = centre_crop(video, height, width)
    return (video.clamp(0, 1) * 255.0 + 0.5).to(torch.uint8).numpy()


def to_model_range(video: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (any layout) -> float32 in [-1, 1], the range the VAEs and the pixel-space DiT use."""
    return video.float() / 127.5 - 1.0


def probe_media(path) -> dict:
    """width and height as displayed (after EXIF orientation or a video's display rotation), num_frames
    and fps (None for images), and the sound track's presence, sample rate and channels (the audio,
    audio_rate and audio_channels keys; images have none). Videos: the headers, capped by the stream's
    duration; a container that stores no count (mkv, webm) is counted by demuxing; only the first frame
    is decoded (its rotation)."""
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        from PIL import Image

        with Image.open(path) as im:
            sideways = im.getexif().get(0x0112) in (5, 6, 7, 8)  # EXIF orientations that swap the axes
            width, height = (im.height, im.width) if sideways else (im.width, im.height)
        return {"width": width, "height": height, "num_frames": 1, "fps": None, **_sound_of(None)}
    if ext not in VIDEO_EXTENSIONS:
        raise ValueError(f"unsupported file type '{ext}'")
    container, stream = _open_video(path)
    with container:
        rate = _frame_rate(stream)
        frames = _header_frame_count(stream, rate)
        if not frames:
            frames = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
        first = next(container.decode(stream), None)
        if first is None:
            raise ValueError("no video frame could be decoded")
        width, height = stream.codec_context.width, stream.codec_context.height
        if _sideways(first.rotation):
            width, height = height, width
        return {
            "width": width,
            "height": height,
            "num_frames": int(frames),
            "fps": _native_rate(stream),
            **_sound_of(container.streams.audio[0] if container.streams.audio else None),
        }


def _sound_of(stream) -> dict:
    """The manifest's sound keys, from an audio stream's header (None: no sound track)."""
    if stream is None:
        return {"audio": False, "audio_rate": None, "audio_channels": None}
    rate, channels = stream.sample_rate or None, stream.channels or None  # 0: the header does not say
    return {"audio": True, "audio_rate": rate, "audio_channels": channels}


def read_clip(path, *args, **kwargs) -> np.ndarray:
    """One training clip as (frames, height, width, 3) uint8: read_timed_clip's, without its time."""
    return read_timed_clip(path, *args, **kwargs)[0]


def read_timed_clip(
    path,
    frames: int,
    height: int,
    width: int,
    fps: float | None = None,
    rng: np.random.Generator | None = None,
    num_frames: int | None = None,
) -> tuple[np.ndarray, float]:
    """(one training clip as (frames, height, width, 3) uint8, resized to cover the size and centre-cropped,
    the time of its first frame in seconds on read_audio's clock: 0.0 for an image).

    Videos: the clip starts at a point drawn from `rng` (at 0 without one) within the video's
    `num_frames` (the manifest's count; the headers' without it), converted to a time at the average
    rate (so in a variable-rate video starts are uniform in time, not in frames); the decoder seeks
    to the key frame before it and decodes only until the clip is complete; a start that runs past
    the real end gives the clip that ends at the last frame. Without `fps` the frames are consecutive;
    with it each time on the 1/fps grid takes the frame nearest to it (frames are dropped or
    repeated). Each frame is scaled by FFmpeg straight to the cover size, so memory holds `frames`
    small frames, never the source resolution. A clip that is too short raises ValueError.
    """
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        if frames != 1:
            raise ValueError(f"an image cannot fill a {frames}-frame bucket")
        return fit_to_bucket(read_image(path), 1, height, width), 0.0
    if ext not in VIDEO_EXTENSIONS:
        raise ValueError(f"unsupported file type '{ext}'")
    container, stream = _open_video(path)
    with container:
        rate = _frame_rate(stream, fps)
        frame_dt = 1.0 / rate
        length = num_frames or _header_frame_count(stream, rate)
        start = _clip_start(rng, length, frames, rate, fps)
        if start > 0:
            _seek(container, stream, start)
        take = _frame_taker(stream, height, width)
        decoded = _timed_frames(container, stream, frame_dt)
        if fps is None:
            first = (dated for dated in decoded if dated[0] >= start - frame_dt / 2)
            out = [take(dated) for _, dated in zip(range(frames), first)]
        else:
            out = _nearest_frames(_dated(decoded), start + np.arange(frames) / fps, frame_dt, take)
        if len(out) < frames and start > 0:
            # The count or the average rate overstated where a variable-rate video ends: take the clip
            # that ends at its last frame (not the file's start, which would bias the starts).
            out = _clip_at_end(container, stream, frames, fps, frame_dt, start, take)
    if len(out) < frames:
        raise ValueError(f"too short: {len(out)} of {frames} frames decoded")
    return np.stack([pixels for _, pixels in out]), out[0][0]


def _dated(decoded):
    """_timed_frames' (time, frame) as (time, (time, frame)): _nearest_frames hands the pair to `take`."""
    return ((t, (t, frame)) for t, frame in decoded)


def _frame_taker(stream, height: int, width: int):
    """take((time, frame)) -> (time, its pixels upright, scaled by FFmpeg to cover height x width and
    centre-cropped)."""
    source_h, source_w = stream.codec_context.height, stream.codec_context.width
    scaled = []

    def take(dated):
        t, frame = dated
        if not scaled:  # the display rotation swaps the axes FFmpeg scales
            sideways = _sideways(frame.rotation)
            cover = cover_size(*((source_w, source_h) if sideways else (source_h, source_w)), height, width)
            scaled.extend(cover[::-1] if sideways else cover)
        pixels = frame.to_ndarray(
            format="rgb24",
            width=scaled[1],
            height=scaled[0],
            interpolation="AREA" if scaled[0] < source_h else "BICUBIC",
        )
        return t, centre_crop(_upright(pixels, frame.rotation), height, width)

    return take


def read_audio(path, start: float, duration: float, rate: int) -> np.ndarray:
    """The sound from `start` seconds for `duration` seconds, resampled to `rate`: (channels, samples)
    float32, round(duration * rate) samples. `start` is on read_clip's clock (seconds after the video
    stream's start), so a clip's picture and sound line up even where the tracks start apart; what
    the track does not cover (before it starts, after it ends) is silence. No sound track: ValueError."""
    import av

    count = round(duration * rate)
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path} has no sound track (no audio stream), so it cannot give sound")
        stream = container.streams.audio[0]
        clock = container.streams.video[0] if container.streams.video else stream
        base = _stream_start(clock)
        if start > 0.1:  # a decoder starting cold garbles its first frame: start it 0.1 s early
            container.seek(int((start - 0.1 + base) / stream.time_base), stream=stream, backward=True)
        out = np.zeros((stream.channels, count), dtype=np.float32)
        resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
        position = None  # the next resampled sample's index in `out` (negative: before `start`)
        for frame in itertools.chain(container.decode(stream), [None]):  # None: flush the resampler
            for chunk in resampler.resample(frame):
                if chunk.pts is not None:  # dated: the resampler keeps the input's timestamps
                    position = round((float(chunk.pts * chunk.time_base) - base - start) * rate)
                position = 0 if position is None else position
                samples = chunk.to_ndarray()
                lo, hi = max(position, 0), min(position + samples.shape[1], count)
                if lo < hi:
                    out[:, lo:hi] = samples[:, lo - position : hi - position]
                position += samples.shape[1]
            if position is not None and position >= count:
                break
    return out


# Lightricks' LTX-2 trainer's downmix of 5.1 and 7.1 to stereo (scripts/process_videos.py): the centre
# and each side's surrounds at 0.707 of the front, each output's weights summing to 1, the LFE left out.
_STEREO_DOWNMIX = {
    6: np.array([[1, 0, 0.707, 0, 0.707, 0], [0, 1, 0.707, 0, 0, 0.707]], np.float32) / 2.414,
    8: np.array([[1, 0, 0.707, 0, 0.707, 0, 0.707, 0], [0, 1, 0.707, 0, 0, 0.707, 0, 0.707]], np.float32)
    / 3.121,
}


def mix_channels(waveform: np.ndarray, channels: int) -> np.ndarray:
    """(c, samples) float32 -> (channels, samples): as it is with as many; 5.1 or 7.1 to stereo by
    _STEREO_DOWNMIX (FFmpeg's channel order, L R C LFE then the surrounds); any other count becomes the
    mean of its channels, repeated (mono becomes `channels` equal channels), as Lightricks' trainer does."""
    if len(waveform) == channels:
        return waveform
    if channels == 2 and len(waveform) in _STEREO_DOWNMIX:
        return _STEREO_DOWNMIX[len(waveform)] @ waveform
    return np.repeat(waveform.mean(axis=0, keepdims=True, dtype=np.float32), channels, axis=0)


def _clip_start(rng, length: int | None, frames: int, rate: float, fps: float | None) -> float:
    """The clip's start time, drawn from `rng` (0 without one) so that `frames` frames fit in `length`
    (None: unknown) at `rate`; at `fps` when given, else consecutive frames. Too short: ValueError."""
    frame_dt = 1.0 / rate
    if fps is None:  # consecutive frames: the start is a frame index
        if length and length < frames:
            raise ValueError(f"too short: {length} frames, the bucket needs {frames}")
        return frame_dt * (int(rng.integers(0, length - frames + 1)) if rng is not None and length else 0)
    if length and frames > frames_at_rate(length, rate, fps):
        raise ValueError(
            f"too short: {length} frames at {rate:g} fps, the bucket needs {frames} at {fps:g} fps"
        )
    span, last = (frames - 1) / fps, (length - 1) * frame_dt if length else None
    return (
        float(rng.uniform(0.0, last - span)) if rng is not None and last is not None and last > span else 0.0
    )


def _clip_at_end(
    container, stream, frames: int, fps: float | None, frame_dt: float, start: float, take
) -> list:
    """The clip that ends at the video's last frame: the last `frames` frames, or the fps grid whose
    last time is the last frame's. Decodes to the end from before `start` (from the file's start if
    that is not early enough), keeping at most `frames` frames."""
    for earlier in (max(0.0, start - 2 * frames * frame_dt), 0.0):
        _seek(container, stream, earlier)
        tail = collections.deque(_timed_frames(container, stream, frame_dt), maxlen=frames)
        if fps is not None and tail:  # the last frame's time is known now: the grid that ends there
            begin = max(0.0, tail[-1][0] - (frames - 1) / fps)
            _seek(container, stream, begin)
            grid = begin + np.arange(frames) / fps
            return _nearest_frames(_dated(_timed_frames(container, stream, frame_dt)), grid, frame_dt, take)
        if len(tail) == frames or earlier == 0.0:
            return [take(dated) for dated in tail]
    return []


def write_video(path, video: np.ndarray, fps: int = 8, scale: int = 1, audio=None) -> list[Path]:
    """Write (T, H, W, 3) float in [0, 1]; the format follows the extension. Returns the files written.
    scale > 1 enlarges each frame that many times (nearest neighbour) so that tiny videos can be watched;
    a .npy keeps the array as sampled.

    .mp4 (H.264 through PyAV), .gif, .png (one image, or one numbered file per frame), .npy (the
    float32 array itself, unquantised, for exact comparisons). `audio`: (waveform (channels, samples)
    float in [-1, 1], sample rate) of a video with sound: the .mp4's AAC track, else <stem>.wav beside
    the file (float32 samples, exact).

    Every file is written under a hidden temporary name and renamed into place when whole: a write that
    fails (a full disk) leaves no file of this video behind that looks like a result, and raises an
    OSError that names the file it was writing."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in OUTPUT_EXTENSIONS:
        raise ValueError(
            f"unsupported output extension '{ext}' for {path}; use one of {', '.join(OUTPUT_EXTENSIONS)}"
        )
    if audio is not None and ext == ".mp4" and len(audio[0]) not in (1, 2):  # before any file is opened
        raise ValueError(f"an .mp4's sound track is mono or stereo; this one has {len(audio[0])} channels")
    path.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        _write_files(path, ext, np.asarray(video, dtype=np.float32), fps, scale, audio, written)
    except BaseException as e:
        for done in written:  # this video's files already in place: a part of it is no result either
            done.unlink(missing_ok=True)
        raise _named(e, path) from e
    return written


def _write_files(path: Path, ext: str, video, fps, scale: int, audio, written: list) -> None:
    """write_video's files, each through _whole, appended to `written` as each is in place."""
    if audio is not None and ext != ".mp4":
        _write_files(path, ext, video, fps, scale, None, written)
        with _whole(path.with_suffix(".wav"), written) as tmp:
            write_wav(tmp, *audio)
        return
    if ext == ".npy":
        with _whole(path, written) as tmp, open(tmp, "wb") as f:
            np.save(f, video)
        return
    if scale > 1:
        video = video.repeat(scale, axis=1).repeat(scale, axis=2)
    frames8 = (np.clip(video, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if ext == ".png":
        from PIL import Image

        names = (
            [path]
            if len(frames8) == 1
            else [path.with_name(f"{path.stem}_{i:04d}.png") for i in range(len(frames8))]
        )
        for frame, out in zip(frames8, names):
            with _whole(out, written) as tmp:
                Image.fromarray(frame).save(tmp, format="PNG")
        return
    if ext == ".gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames8]
        with _whole(path, written) as tmp:
            images[0].save(
                tmp, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0
            )
        return
    with _whole(path, written) as tmp:
        _write_mp4(tmp, frames8, fps, audio)


@contextlib.contextmanager
def _whole(path: Path, written: list):
    """A hidden temporary name beside `path` to write to; renamed to `path` (and added to `written`) once
    the block is done, removed if it fails."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    written.append(path)


def _named(error: BaseException, path: Path) -> BaseException:
    """`error`, or for a full, over-quota or read-only file system that did not say which file (PyAV's and
    numpy's writes: numpy's says only "N requested and M written") an OSError naming `path`: the report
    then names the right file system."""
    from parallel.lifecycle.storage import storage_problem

    if isinstance(error, OSError) and error.filename and not str(error.filename).endswith(".partial"):
        return error
    problem = storage_problem(error, path.parent)
    if problem is None:
        return error
    return OSError(problem[0], os.strerror(problem[0]), str(path))


def _write_mp4(path: Path, frames8: np.ndarray, fps, audio) -> None:
    import av

    # H.264 in yuv420p needs even sizes: pad by repeating the edge (the array itself is never cropped).
    h, w = frames8.shape[1:3]
    frames8 = np.pad(frames8, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames8.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        sound = audio_track(container, *audio) if audio is not None else None  # before the first packet
        for frame in frames8:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            for packet in [*sound[0].encode(sound[1]), *sound[0].encode()]:
                container.mux(packet)


def audio_track(container, waveform: np.ndarray, rate: int) -> tuple:
    """(the container's new AAC stream, the waveform (channels, samples) as its one frame): mono or
    stereo."""
    import av

    waveform = np.ascontiguousarray(np.clip(waveform, -1.0, 1.0), dtype=np.float32)
    layout = {1: "mono", 2: "stereo"}[len(waveform)]  # write_video refused any other count
    stream = container.add_stream("aac", rate=int(rate), layout=layout)
    frame = av.AudioFrame.from_ndarray(waveform, format="fltp", layout=layout)
    frame.sample_rate = int(rate)
    # A timestamp lets the encoder date its priming packet before 0 and the muxer hide it (an edit
    # list); without one the sound starts 1024 samples late, out of step with the picture.
    frame.pts, frame.time_base = 0, Fraction(1, int(rate))
    return stream, frame


def write_wav(path, waveform: np.ndarray, rate: int) -> Path:
    """(channels, samples) float as a 32-bit float WAV (IEEE float, format 3): the samples unquantised."""
    import struct

    samples = np.asarray(waveform, dtype="<f4").T  # interleaved: (samples, channels)
    channels, data = samples.shape[1], samples.tobytes()
    fmt = struct.pack("<HHIIHH", 3, channels, int(rate), int(rate) * 4 * channels, 4 * channels, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    Path(path).write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    return Path(path)


def read_wav(path) -> tuple:
    """(waveform (channels, samples) float32, sample rate) of write_wav's file."""
    import struct

    raw = Path(path).read_bytes()
    _, channels, rate = struct.unpack("<HHI", raw[20:28])
    data = raw.index(b"data") + 8
    return np.frombuffer(raw[data:], dtype="<f4").reshape(-1, channels).T.copy(), rate
