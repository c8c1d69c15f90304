"""Clips with sound (LTX-2's audio training), data side: the manifest records each clip's sound track from
its headers, the start-up summary counts the clips that carry sound, data.audio=true refuses clips
without it (or a manifest indexed before sound was) at start-up, and read_audio gives back a known tone
at its time, frequency and level, resampled to the rate asked."""

import json

import numpy as np
import pytest
from PIL import Image

from configs import load_config
from data.dataset import MediaDataset
from data.loader import build_buckets, build_dataset
from data.manifest import read_manifest, write_manifest
from data.media import read_audio, write_video
from tests.conftest import TINY

RATE = 44100
TONES = ((440.0, 0.5), (660.0, 0.25))  # (frequency, amplitude) of the left and right channels


def tone(seconds: float = 1.0, rate: int = RATE, start: float = 0.0) -> np.ndarray:
    t = start + np.arange(round(seconds * rate)) / rate
    return np.stack([a * np.sin(2 * np.pi * f * t) for f, a in TONES]).astype(np.float32)


def clip(path, sound: bool = True):
    """A 1-second, 8-frame clip; with sound: TONES at 44.1 kHz, stereo."""
    video = np.random.default_rng(0).random((8, 16, 16, 3), dtype=np.float32)
    write_video(path, video, fps=8, audio=(tone(), RATE) if sound else None)
    return path


def peak_hz(channel: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(channel * np.hanning(len(channel))))
    return float(np.fft.rfftfreq(len(channel), 1 / rate)[spectrum.argmax()])


def fit(channel: np.ndarray, hz: float, start: float, rate: int) -> tuple[float, float]:
    """(amplitude, delay in samples) of the sine at `hz` that best fits the samples taken at
    start + n / rate, against the tone written (delay 0: in step with it)."""
    t = start + np.arange(len(channel)) / rate
    (a, b), *_ = np.linalg.lstsq(
        np.stack([np.sin(2 * np.pi * hz * t), np.cos(2 * np.pi * hz * t)], 1), channel
    )
    return float(np.hypot(a, b)), float(-np.arctan2(b, a) / (2 * np.pi * hz) * rate)


def test_read_audio_gives_back_the_tone_at_its_time_frequency_and_level(tmp_path):
    """AAC is lossy: the frequency to the FFT's resolution (2 Hz for half a second), the level within 2%,
    the timing within half a sample of the asked rate (the resampler dates its output to the sample; a
    track 1024 samples late, AAC's priming, would be 9 samples at 44.1 kHz out at 440 Hz, a start a
    frame late half a period at 660 Hz); the length is exact at every rate."""
    path = clip(tmp_path / "tone.mp4")
    for start, rate in ((0.0, RATE), (0.25, RATE), (0.25, 16000), (0.3, 48000)):
        sound = read_audio(path, start, 0.5, rate)
        assert sound.shape == (2, rate // 2) and sound.dtype == np.float32
        for channel, (hz, amplitude) in zip(sound, TONES):
            assert abs(peak_hz(channel, rate) - hz) <= 2.0, (start, rate, peak_hz(channel, rate))
            level, delay = fit(channel, hz, start, rate)
            assert level == pytest.approx(amplitude, rel=0.02) and abs(delay) < 0.5, (
                start,
                rate,
                level,
                delay,
            )


def test_read_audio_pads_with_silence_past_the_track_and_refuses_a_file_without_sound(tmp_path):
    path = clip(tmp_path / "tone.mp4")
    sound = read_audio(path, 0.75, 0.5, 16000)  # the track ends at 1 s: its last quarter second is silence
    assert sound.shape == (2, 8000)
    level, delay = fit(sound[0, :3800], 440.0, 0.75, 16000)
    assert level == pytest.approx(0.5, rel=0.02) and abs(delay) < 0.5
    assert np.abs(sound[:, 4200:]).max() < 1e-3
    silent = clip(tmp_path / "silent.mp4", sound=False)
    with pytest.raises(ValueError, match=f"{silent} has no sound track"):
        read_audio(silent, 0.0, 0.5, 16000)


def media_folder(folder):
    """Two clips with sound, one without, an image: each with its caption."""
    folder.mkdir()
    for name, sound in (("a", True), ("b", True), ("c", False)):
        clip(folder / f"{name}.mp4", sound)
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "d.png")
    for name in "abcd":
        (folder / f"{name}.txt").write_text(f"caption {name}")
    return folder


def test_index_folder_records_each_clips_sound_track(tmp_path):
    from scripts.index_folder import main

    folder = media_folder(tmp_path / "media")
    assert main([str(folder)]) == 0
    lines = {
        json.loads(line)["path"]: json.loads(line)
        for line in (folder / "manifest.jsonl").read_text().splitlines()
    }
    sound = {
        path: tuple(line[k] for k in ("audio", "audio_rate", "audio_channels"))
        for path, line in lines.items()
    }
    assert sound == {
        "a.mp4": (True, 44100, 2),
        "b.mp4": (True, 44100, 2),
        "c.mp4": (False, None, None),
        "d.png": (False, None, None),
    }
    entries = read_manifest(folder / "manifest.jsonl")  # the keys pass the manifest's checks
    assert [e["audio"] for e in entries] == [True, True, False, False]


@pytest.mark.parametrize(
    "key, value", [("audio", "yes"), ("audio", 1), ("audio_rate", 0), ("audio_channels", True)]
)
def test_a_malformed_sound_key_is_refused_naming_the_line(tmp_path, key, value):
    write_manifest(
        tmp_path / "m.jsonl",
        [{"path": "a.mp4", "caption": "x"}, {"path": "b.mp4", "caption": "y", key: value}],
    )
    with pytest.raises(ValueError, match=f"m.jsonl:2: '{key}' must be"):
        read_manifest(tmp_path / "m.jsonl")


def sized(path, **sound):
    return {"path": path, "caption": path, "width": 16, "height": 16, "num_frames": 8, "fps": 8, **sound}


def test_the_summary_counts_the_clips_with_sound_from_the_manifest(tmp_path):
    """Never opens a file: the manifest's keys alone. Without them (an older manifest) it says nothing."""
    table = build_buckets(load_config(TINY, ["data.frame_counts=[1,4]"]))
    with_keys = [
        sized("a.mp4", audio=True, audio_rate=48000, audio_channels=2),
        sized("b.mp4", audio=True, audio_rate=44100, audio_channels=1),
        sized("c.mp4", audio=False, audio_rate=None, audio_channels=None),
        sized("d.mp4", audio=True, audio_rate=48000, audio_channels=2),
        sized("e.mp4"),  # a line written before sound was indexed
    ]
    dataset = MediaDataset(with_keys, table)
    assert dataset.entries[0]["audio"] is True and dataset.entries[2]["audio"] is False
    assert dataset.entries[4]["audio"] is None
    first = dataset.summary().splitlines()[0]
    assert first == "5 samples in 1 of 2 buckets (3 of 4 carry sound, 44.1 / 48 kHz; 1 not indexed for sound)"
    old = MediaDataset([sized(p) for p in ("a.mp4", "b.mp4")], table)
    assert "sound" not in old.summary() and old.summary().splitlines()[0] == "2 samples in 1 of 2 buckets"


def test_data_audio_refuses_clips_without_sound_at_start_up_naming_them(tmp_path):
    """build_dataset runs in train.check_before_start, before any process group or model exists."""
    lines = [sized(f"{i}.mp4", audio=i % 3 != 0) for i in range(10)]  # 0, 3, 6, 9 without sound
    write_manifest(tmp_path / "m.jsonl", lines)
    recipe = [f"data.manifest={tmp_path / 'm.jsonl'}", "data.frame_counts=[4]", f"run.output_dir={tmp_path}"]
    for i in range(10):
        (tmp_path / f"{i}.mp4").touch()  # present (stat'ed at start-up), never opened
    cfg = load_config(TINY, recipe)
    assert cfg.data.audio is False and len(build_dataset(cfg, build_buckets(cfg))) == 10  # the default
    cfg = load_config(TINY, recipe + ["data.audio=true", "data.fps=8"])  # fps: one sound length per bucket
    with pytest.raises(ValueError) as refused:
        build_dataset(cfg, build_buckets(cfg))
    message = str(refused.value)
    assert "data.audio=true, but 4 of the 10 lines" in message and "without a sound track" in message
    assert f"({tmp_path}/0.mp4, {tmp_path}/3.mp4, {tmp_path}/6.mp4, ...)" in message, message
    # A manifest indexed before sound was: re-index, it says.
    write_manifest(tmp_path / "m.jsonl", [sized(f"{i}.mp4") for i in range(10)])
    with pytest.raises(
        ValueError, match="10 of the 10 lines .* predates audio indexing; re-run scripts/index_f"
    ):
        build_dataset(cfg, build_buckets(cfg))
    write_manifest(tmp_path / "m.jsonl", [sized(f"{i}.mp4", audio=True) for i in range(10)])
    assert len(build_dataset(cfg, build_buckets(cfg))) == 10
    cfg = load_config(TINY, ["data.audio=true"])
    with pytest.raises(ValueError, match="data.audio=true .* the synthetic demo"):
        build_dataset(cfg, build_buckets(cfg))
