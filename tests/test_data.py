import json

import numpy as np
import pytest
import torch

from data.manifest import ManifestDataset, write_manifest
from data.media import read_video, to_training_clip, write_video
from data.sampler import DistributedEpochSampler
from data.synthetic import (
    ALL_COMBOS,
    HELD_OUT,
    TRAIN_COMBOS,
    SyntheticVideoDataset,
    dominant_color,
    motion_direction,
)


def test_synthetic_is_deterministic_and_holds_out_combos():
    a, b = SyntheticVideoDataset(20, 4, 16, 16, seed=3), SyntheticVideoDataset(20, 4, 16, 16, seed=3)
    assert all(torch.equal(a[i]["video"], b[i]["video"]) and a[i]["caption"] == b[i]["caption"] for i in range(20))
    assert len(HELD_OUT) == 12 and not set(TRAIN_COMBOS) & HELD_OUT
    shapes = {(a.describe(i)["height"], a.describe(i)["width"], a.describe(i)["frames"]) for i in range(20)}
    assert len(shapes) > 3  # several aspect ratios and clip lengths


def test_eval_metrics_read_ground_truth_correctly():
    data = SyntheticVideoDataset(120, 8, 32, 32, seed=1, combos=ALL_COMBOS)
    for i in range(120):
        d = data.describe(i)
        video = (data[i]["video"].permute(1, 2, 3, 0).numpy() + 1) / 2
        assert dominant_color(video) == d["color"]
        assert motion_direction(video) == d["direction"]
    assert dominant_color(np.zeros((2, 8, 8, 3))) is None


def test_resize_and_centre_crop():
    pixels = np.zeros((3, 20, 40, 3), dtype=np.float32)
    pixels[:, :, 6:34] = 1.0  # a white band wider than the centre crop
    clip = to_training_clip(pixels, frames=5, height=8, width=8)
    assert clip.shape == (3, 5, 8, 8)
    assert clip.min() == pytest.approx(1.0, abs=1e-3)  # only the white band survives the crop
    assert torch.equal(clip[:, 3], clip[:, 4])  # short clips repeat their last frame


@pytest.mark.parametrize("ext", [".mp4", ".gif", ".png", ".npy"])
def test_write_formats(tmp_path, ext):
    video = np.random.default_rng(0).random((3, 16, 18, 3)).astype(np.float32)
    files = write_video(tmp_path / f"v{ext}", video, fps=4)
    if ext == ".npy":
        assert np.array_equal(np.load(files[0]), video)
    elif ext == ".png":
        assert len(files) == 3 and all(f.is_file() for f in files)
    else:
        decoded = read_video(files[0])
        assert decoded.shape[0] == 3 and decoded.shape[1:3] == (16, 18)


def test_video_round_trip_is_close(tmp_path):
    clip, _ = SyntheticVideoDataset(1, 6, 32, 32).render(0)
    write_video(tmp_path / "c.mp4", clip, fps=8)
    decoded = read_video(tmp_path / "c.mp4", max_frames=6)
    clip = clip[:6]
    assert decoded.shape == (6, clip.shape[1] + clip.shape[1] % 2, clip.shape[2] + clip.shape[2] % 2, 3)
    assert np.abs(decoded[:, :clip.shape[1], :clip.shape[2]] - clip).mean() < 0.03
    full = SyntheticVideoDataset(1, 6, 32, 32).render(0)[0].shape[0]
    assert read_video(tmp_path / "c.mp4", fps=4).shape[0] == (full + 1) // 2  # 8 fps -> 4 fps halves the frames


def test_manifest_dataset_reads_videos_and_images(tmp_path):
    from PIL import Image

    data = SyntheticVideoDataset(2, 6, 24, 24)
    clip, caption = data.render(0)
    write_video(tmp_path / "media" / "a.mp4", clip, fps=8)
    Image.fromarray((clip[0] * 255).astype(np.uint8)).save(tmp_path / "media" / "b.png")
    write_manifest(tmp_path / "m.jsonl", [{"path": "media/a.mp4", "caption": caption},
                                          {"path": "media/b.png", "caption": "an image"}])
    dataset = ManifestDataset(tmp_path / "m.jsonl", frames=4, height=16, width=16)
    video = dataset[0]
    assert video["video"].shape == (3, 4, 16, 16) and video["caption"] == caption
    assert dataset[1]["video"].shape == (3, 4, 16, 16)


@pytest.mark.parametrize("line, message", [
    ('{"caption": "x"}', "missing key"),
    ("{not json", "not valid JSON"),
])
def test_manifest_errors_name_the_line(tmp_path, line, message):
    (tmp_path / "m.jsonl").write_text('{"path": "a.png", "caption": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"m.jsonl:2: {message}"):
        ManifestDataset(tmp_path / "m.jsonl", 1, 8, 8)


@pytest.mark.parametrize("size, batch, dp", [(10, 2, 3), (64, 4, 2), (7, 1, 7)])
def test_sampler_gives_every_rank_equal_disjoint_batches(size, batch, dp):
    samplers = [DistributedEpochSampler(size, batch, r, dp, seed=5) for r in range(dp)]
    steps = samplers[0].steps_per_epoch
    assert steps == size // (batch * dp)
    epoch = [b for s in samplers for b in (s.batch_at(i) for i in range(steps))]
    flat = [i for b in epoch for i in b]
    assert len(flat) == len(set(flat)) == steps * batch * dp
    assert all(len(b) == batch for b in epoch)


def test_sampler_resume_is_the_continuation():
    full = DistributedEpochSampler(30, 4, 1, 2, seed=1)
    straight = [b for _, b in zip(range(20), iter(full))]
    resumed = DistributedEpochSampler(30, 4, 1, 2, seed=1, start_step=13)
    assert [b for _, b in zip(range(7), iter(resumed))] == straight[13:]


def test_sampler_refuses_a_changed_resume():
    state = DistributedEpochSampler(30, 4, 0, 2).state_dict(10)
    with pytest.raises(ValueError, match="dp_size=2 and this run has dp_size=1"):
        DistributedEpochSampler(30, 4, 0, 1).check_resume(state)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedEpochSampler(3, 4, 0, 1)
    json.dumps(state)  # the state is plain data
