"""The training loader's sound (data.audio): each sample carries its clip's sound for exactly its frames'
span (frames / data.fps seconds from the first frame's time), at the family's rate and channels; collate
stacks it; a clip whose sound cannot be read is replaced like any unreadable sample; data.audio=true
without data.fps is refused before any file is read."""

from fractions import Fraction

import numpy as np
import pytest

from configs import load_config
from data.dataset import MediaDataset, collate
from data.loader import build_buckets, build_dataset
from data.manifest import write_manifest
from data.media import mix_channels, write_video
from tests.conftest import TINY
from tests.test_decode import frame_numbers

ONSET = 1.0  # seconds: the tone starts here, at a frame's time at every rate written below
TONE_HZ, LEVEL = 1000.0, 0.5


def counter_with_tone(path, fps: int, seconds: float = 2.0, rate: int = 48000, channels: int = 1):
    """Frame k flat grey at 8 + 5k (frame_numbers reads k back); silence, then from ONSET a 1 kHz tone at
    LEVEL in every channel (AAC, dated so that the track starts with the picture)."""
    import av

    t = np.arange(round(seconds * rate)) / rate
    wave = np.where(t >= ONSET, LEVEL * np.sin(2 * np.pi * TONE_HZ * t), 0.0).astype(np.float32)
    layout = {1: "mono", 2: "stereo"}[channels]
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.height, video.width, video.pix_fmt = 16, 16, "yuv420p"
        video.options = {"crf": "0", "g": "6"}  # key frames every 6: the clips' starts are seeks
        sound = container.add_stream("aac", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.repeat(wave[None], channels, 0), format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
        for k in range(round(seconds * fps)):
            image = np.full((16, 16, 3), 8 + 5 * k, dtype=np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux([*video.encode(), *sound.encode(frame), *sound.encode()])
    return path


def entry(path, fps: float, frames: int, sound: bool = True) -> dict:
    return {"path": str(path), "caption": "c", "width": 16, "height": 16, "num_frames": frames, "fps": fps,
            "audio": sound}  # fmt: skip


def dataset_of(entries, frames: int, fps: float, audio=(16000, 2)) -> MediaDataset:
    table = build_buckets(load_config(TINY, [f"data.frame_counts=[{frames}]"]))
    return MediaDataset(entries, table, fps=fps, audio=audio)


@pytest.mark.parametrize("native", [24, 25])
def test_the_sound_is_the_clips_span_in_step_with_its_frames_and_mono_becomes_two_equal_channels(
    tmp_path, native
):
    """9 frames at data.fps=24 from a mono 48 kHz clip at its own 24 or 25 fps, starts drawn per epoch: the
    sound is (2, round(9 / 24 * 16000) = 6000) float32, both channels equal, and where the frames say the
    tone starts (frame k0 first: ONSET - k0 / native seconds in) it starts, to 4 samples at 16 kHz (a
    sample above LEVEL / 2 comes 2 samples after a 1 kHz onset; the AAC frame is 341 samples there, a start
    on the 1/24 s grid instead of the first frame's time up to 333 off)."""
    path = counter_with_tone(tmp_path / "tone.mp4", native)
    dataset = dataset_of([entry(path, native, 2 * native)], 9, 24.0)
    offsets = []
    for epoch in range(40):
        sample = dataset[(0, epoch)]
        sound, first = sample["audio"], frame_numbers(sample["video"].permute(1, 2, 3, 0).numpy())[0]
        assert sound.shape == (2, 6000) and sound.dtype.is_floating_point and not sample["failures"]
        assert (sound[0] == sound[1]).all()
        expected = (ONSET - first / native) * 16000
        if 0 < expected < 5800:  # the onset inside the clip, with room for the tone to rise
            offsets.append(int(np.flatnonzero(sound[0].abs().numpy() > LEVEL / 2)[0]) - expected)
        elif expected >= 6000:  # the clip ends before the tone
            assert sound.abs().max() < 0.02, (epoch, first)
    assert len(offsets) >= 5 and max(abs(d) for d in offsets) <= 4, offsets


def test_collate_stacks_the_sound_and_a_clip_without_it_is_replaced_and_named(tmp_path):
    """A stereo clip's two channels stay apart (left 440 Hz, right 660 Hz: tests/test_audio_data.py's
    tone); 4 frames at 8 fps is half a second, 8000 samples at 16 kHz; a clip the manifest says has sound
    but has none fails its read and gives way to the other clip, named with the reason."""
    from tests.test_audio_data import clip

    tone, silent = clip(tmp_path / "tone.mp4"), clip(tmp_path / "silent.mp4", sound=False)
    dataset = dataset_of([entry(tone, 8, 8), entry(silent, 8, 8)], 4, 8.0)
    batch = collate([dataset[(0, 0)], dataset[(1, 0)]])
    assert batch["audio"].shape == (2, 2, 8000) and batch["video"].shape == (2, 3, 4, 16, 16)
    assert batch["index"] == [0, 1] and len(batch["failures"]) == 1
    assert batch["failures"][0][0] == str(silent) and "has no sound track" in batch["failures"][0][1]
    left, right = batch["audio"][0].numpy()
    spectrum = [np.abs(np.fft.rfft(c)).argmax() * 16000 / 8000 for c in (left, right)]  # Hz, 2 Hz bins
    assert spectrum == [440.0, 660.0] and (batch["audio"][1] == batch["audio"][0]).all()


def test_mix_channels_duplicates_mono_and_mixes_surround_down_as_lightricks_trainer():
    """5.1 to stereo: L = (L + 0.707 C + 0.707 Ls) / 2.414 (LFE out); stereo to mono the mean."""
    mono = np.array([[0.5, -0.25]], np.float32)
    assert np.array_equal(mix_channels(mono, 2), [[0.5, -0.25], [0.5, -0.25]])
    surround = np.arange(6, dtype=np.float32)[:, None] + 1  # L R C LFE Ls Rs = 1 .. 6
    mixed = mix_channels(surround, 2)[:, 0]
    assert mixed == pytest.approx([(1 + 0.707 * 3 + 0.707 * 5) / 2.414, (2 + 0.707 * 3 + 0.707 * 6) / 2.414])
    assert mix_channels(np.array([[1.0], [3.0]], np.float32), 1).tolist() == [[2.0]]
    stereo = np.array([[1.0], [3.0]], np.float32)
    assert mix_channels(stereo, 2) is stereo


def recipe(tmp_path, manifest, *more):
    return load_config(
        TINY, [f"data.manifest={manifest}", "data.frame_counts=[4]", f"run.output_dir={tmp_path}", *more]
    )


def test_data_audio_without_data_fps_is_refused_before_any_file_is_read(tmp_path):
    """The manifest does not exist: had build_dataset read it first, its FileNotFoundError would come."""
    cfg = recipe(tmp_path, tmp_path / "absent.jsonl", "data.audio=true")
    with pytest.raises(ValueError, match=r"data.audio=true needs data.fps: .* same number of sound samples"):
        build_dataset(cfg, build_buckets(cfg))
    with pytest.raises(ValueError, match="needs data.fps"):  # the dataset itself holds the rule too
        dataset_of([entry(tmp_path / "a.mp4", 8, 8)], 4, None)


def test_build_dataset_reads_the_sound_at_the_familys_format(tmp_path, monkeypatch):
    """data.audio=true with data.fps: the family's sound_format; a family without one (None, refused by
    check_family_inputs before this) gives samples without sound, no crash."""
    from models.families import family_named

    path = write_video(tmp_path / "a.mp4", np.zeros((8, 16, 16, 3)), fps=8, audio=(np.zeros((1, 8000)), 8000))
    write_manifest(tmp_path / "m.jsonl", [{**entry("a.mp4", 8, 8), "audio_rate": 8000, "audio_channels": 1}])
    cfg = recipe(tmp_path, tmp_path / "m.jsonl", "data.audio=true", "data.fps=8")
    family = type(family_named(cfg.model.family))
    assert family.sound_format(family_named(cfg.model.family), cfg) is None
    assert "audio" not in build_dataset(cfg, build_buckets(cfg))[(0, 0)]
    monkeypatch.setattr(family, "sound_format", lambda self, cfg: (22050, 2))
    dataset = build_dataset(cfg, build_buckets(cfg))
    assert dataset.audio == (22050, 2) and dataset[(0, 0)]["audio"].shape == (2, 11025), path
