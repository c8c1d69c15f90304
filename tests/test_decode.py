"""Clip decoding (PyAV seek + fps grid + resize/crop), probing, folder indexing, and the
replacement of unreadable samples."""

import sys

import numpy as np
import pytest
import torch

from configs import load_config
from data.dataset import MediaDataset
from data.loader import build_buckets
from data.manifest import index_folder, read_manifest
from data.media import probe_media, read_clip
from tests.conftest import ROOT, TINY


def write_counter_video(
    path,
    frames: int,
    fps: int,
    height: int = 32,
    width: int = 48,
    gop: int = 6,
    times_ms: list[int] | None = None,
):
    """Frame k is flat grey at level 8 + 5k (so the decoded level gives k back); key frames every `gop`
    frames, so a seek lands in the middle of the file. `times_ms` gives each frame its own time (a
    variable frame rate)."""
    from fractions import Fraction

    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        stream.options = {"crf": "0", "g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
        if times_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for k in range(frames):
            image = np.full((height, width, 3), 8 + 5 * k, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if times_ms is not None:
                frame.pts, frame.time_base = times_ms[k], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def cut_by_stream_copy(source, target, skip: int, fps: int):
    """What `ffmpeg -ss ... -c copy` makes: the first `skip` frames stay in the file as pre-roll (negative
    times, hidden by an mp4 edit list), yet the headers still count them."""
    import av

    with av.open(str(source)) as src, av.open(str(target), "w") as dst:
        stream = src.streams.video[0]
        out = dst.add_stream_from_template(stream)
        shift = int(skip / fps / stream.time_base)
        for packet in src.demux(stream):
            if packet.pts is not None:
                packet.pts, packet.dts, packet.stream = packet.pts - shift, packet.dts - shift, out
                dst.mux(packet)
    return target


def frame_numbers(clip: np.ndarray) -> list[int]:
    return [round((float(f.mean()) - 8) / 5) for f in clip]


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return write_counter_video(tmp_path_factory.mktemp("v") / "counter.mp4", frames=40, fps=8)


def test_probe_reads_size_frames_and_rate(counter):
    silent = {"audio": False, "audio_rate": None, "audio_channels": None}  # written without a sound track
    assert probe_media(counter) == {"width": 48, "height": 32, "num_frames": 40, "fps": 8.0, **silent}


def test_consecutive_frames_from_a_seeked_start(counter):
    assert frame_numbers(read_clip(counter, 5, 16, 16)) == [0, 1, 2, 3, 4]  # no rng: the start of the file
    starts = set()
    for seed in range(12):
        got = frame_numbers(read_clip(counter, 5, 16, 16, rng=np.random.default_rng(seed)))
        assert got == list(range(got[0], got[0] + 5)) and 0 <= got[0] <= 35
        starts.add(got[0])
    assert len(starts) > 4 and max(starts) > 12  # starts beyond the second key frame: the seek path runs


def test_fps_resampling_picks_the_nearest_frames(counter):
    assert frame_numbers(read_clip(counter, 5, 16, 16, fps=4)) == [0, 2, 4, 6, 8]  # 8 -> 4 fps
    assert frame_numbers(read_clip(counter, 6, 16, 16, fps=16)) == [0, 0, 1, 1, 2, 2]  # 8 -> 16 fps repeats
    got = frame_numbers(read_clip(counter, 4, 16, 16, fps=2, rng=np.random.default_rng(3)))
    assert [b - a for a, b in zip(got, got[1:])] == [4, 4, 4]
    assert (
        frame_numbers(read_clip(counter, 20, 16, 16, fps=4))[-1] == 38
    )  # the longest clip 40 frames hold at 4 fps
    with pytest.raises(ValueError, match="too short"):
        read_clip(counter, 21, 16, 16, fps=4)


def test_a_cut_file_counts_the_frames_it_shows(tmp_path):
    source = write_counter_video(tmp_path / "source.mp4", frames=40, fps=8, gop=12)
    cut = cut_by_stream_copy(source, tmp_path / "cut.mp4", skip=5, fps=8)
    assert probe_media(cut)["num_frames"] == 35  # the headers say 40
    assert frame_numbers(read_clip(cut, 5, 16, 16)) == [5, 6, 7, 8, 9]
    for seed in range(10):  # every start fits: no clip runs past the end
        got = frame_numbers(read_clip(cut, 30, 16, 16, rng=np.random.default_rng(seed), num_frames=35))
        assert got == list(range(got[0], got[0] + 30))


def test_matroska_without_a_frame_count_in_its_headers(tmp_path):
    mkv = write_counter_video(tmp_path / "counter.mkv", frames=40, fps=8)
    info = probe_media(mkv)
    assert info["num_frames"] == 40 and info["fps"] == 8.0
    starts = {
        frame_numbers(read_clip(mkv, 5, 16, 16, rng=np.random.default_rng(s), num_frames=40))[0]
        for s in range(10)
    }
    assert len(starts) > 4  # random starts from the manifest's count, not always frame 0


def test_variable_frame_rate(tmp_path):
    """20 frames 125 ms apart, then 20 frames 500 ms apart."""
    times = [125 * k for k in range(20)] + [125 * 19 + 500 * (k + 1) for k in range(20)]
    vfr = write_counter_video(tmp_path / "vfr.mp4", frames=40, fps=8, times_ms=times)
    starts = []
    for seed in range(20):  # without data.fps: consecutive frames, whatever the rate
        got = frame_numbers(read_clip(vfr, 10, 16, 16, rng=np.random.default_rng(seed), num_frames=40))
        assert got == list(range(got[0], got[0] + 10))
        starts.append(got[0])
    # a start past the real end (the average rate overstates it) gives the clip ending at the last frame
    assert 30 in starts and starts.count(0) <= 2, starts
    # at 4 fps (every 250 ms) the nearest frames: every second frame, then each slow frame twice
    assert frame_numbers(read_clip(vfr, 14, 16, 16, fps=4)) == [
        0,
        2,
        4,
        6,
        8,
        10,
        12,
        14,
        16,
        18,
        19,
        20,
        20,
        21,
    ]


def test_display_rotation_and_exif_orientation(tmp_path):
    import av
    from PIL import Image

    image = np.zeros((32, 64, 3), dtype=np.uint8)
    image[:, :16] = 255  # a white band on the stored left side
    video = tmp_path / "portrait.mp4"  # shown turned 90 degrees counter-clockwise: the band at the bottom
    with av.open(str(video), mode="w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.height, stream.width, stream.pix_fmt, stream.options = 32, 64, "yuv420p", {"crf": "0"}
        stream.set_display_rotation(90)
        for _ in range(3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    assert probe_media(video)["width"] == 32 and probe_media(video)["height"] == 64
    shown = read_clip(video, 2, 64, 32)[1, ..., 0].astype(float)
    assert shown[52:].mean() > 230 and shown[:44].mean() < 25
    exif = Image.new("RGB", (1, 1)).getexif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: the band comes out on top
    Image.fromarray(image).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    silent = {"audio": False, "audio_rate": None, "audio_channels": None}  # an image has no sound
    assert probe_media(tmp_path / "phone.jpg") == {
        "width": 32,
        "height": 64,
        "num_frames": 1,
        "fps": None,
        **silent,
    }
    shown = read_clip(tmp_path / "phone.jpg", 1, 64, 32)[0, ..., 0].astype(float)
    assert shown[:12].mean() > 230 and shown[20:].mean() < 25


def test_resize_to_cover_and_centre_crop(tmp_path):
    import av

    path = tmp_path / "bands.mp4"
    with av.open(str(path), mode="w") as container:  # 64 x 32: a white centre band between black sides
        stream = container.add_stream("libx264", rate=8)
        stream.height, stream.width, stream.pix_fmt, stream.options = 32, 64, "yuv420p", {"crf": "0"}
        image = np.zeros((32, 64, 3), dtype=np.uint8)
        image[:, 16:48] = 255
        for _ in range(3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clip = read_clip(path, 2, 16, 16)  # 64x32 -> 32x16 covers 16x16; the crop keeps the white centre
    assert clip.shape == (2, 16, 16, 3) and clip.dtype == np.uint8 and clip.min() > 240
    assert read_clip(path, 2, 16, 32).mean() < 200  # a wider crop reaches the black sides


def test_images_fill_one_frame_buckets_only(tmp_path):
    from PIL import Image

    Image.fromarray(np.full((20, 30, 3), 77, dtype=np.uint8)).save(tmp_path / "a.png")
    assert read_clip(tmp_path / "a.png", 1, 8, 8).shape == (1, 8, 8, 3)
    with pytest.raises(ValueError, match="an image cannot fill a 5-frame bucket"):
        read_clip(tmp_path / "a.png", 5, 8, 8)


@pytest.fixture
def messy_folder(tmp_path):
    """Four good clips, a corrupt one, one that is too short, one without a caption."""
    folder = tmp_path / "media"
    folder.mkdir()
    for i in range(4):
        write_counter_video(folder / f"good{i}.mp4", frames=12 + i, fps=8)
        (folder / f"good{i}.txt").write_text(f"clip {i}\n")
    (folder / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 20)
    (folder / "corrupt.txt").write_text("broken")
    write_counter_video(folder / "short.mp4", frames=3, fps=8)
    (folder / "short.txt").write_text("short")
    write_counter_video(folder / "nocaption.mp4", frames=12, fps=8)
    return folder


def test_index_folder_probes_and_names_what_it_leaves_out(messy_folder, tmp_path):
    entries, skipped = index_folder(messy_folder)
    assert sorted(e["path"].rsplit("/", 1)[1] for e in entries) == [
        "good0.mp4",
        "good1.mp4",
        "good2.mp4",
        "good3.mp4",
        "short.mp4",
    ]
    assert entries[0]["caption"] == "clip 0" and entries[0]["num_frames"] == 12 and entries[0]["fps"] == 8.0
    assert {p.rsplit("/", 1)[1] for p in skipped} == {"corrupt.mp4", "nocaption.mp4"}
    assert "no caption file nocaption.txt" in skipped[str(messy_folder / "nocaption.mp4")]

    sys.path.insert(0, str(ROOT / "scripts"))
    import index_folder as script

    assert script.main([str(messy_folder), "--out", str(tmp_path / "m.jsonl")]) == 0
    written = read_manifest(tmp_path / "m.jsonl")
    assert [e["path"] for e in written] == [
        e["path"] for e in entries
    ]  # paths relative to the manifest resolve back


def test_unreadable_samples_are_replaced_from_their_bucket_deterministically(messy_folder):
    cfg = load_config(TINY, ["data.frame_counts=[8]"])
    entries, _ = index_folder(messy_folder)
    entries.append(
        {
            "path": str(messy_folder / "gone.mp4"),
            "caption": "missing",
            "width": 48,
            "height": 32,
            "num_frames": 20,
            "fps": 8,
        }
    )  # listed with sizes, deleted since
    entries.append(
        {
            "path": str(messy_folder / "corrupt.mp4"),
            "caption": "broken",
            "width": 48,
            "height": 32,
            "num_frames": 20,
            "fps": 8,
        }
    )
    dataset = MediaDataset(entries, build_buckets(cfg))
    assert dict(dataset.dropped) == {"too short (fewer than 8 frames)": 1}  # short.mp4, at indexing time
    good = {e["caption"] for e in dataset.entries if e["caption"].startswith("clip")}
    for index, name in ((4, "gone.mp4"), (5, "corrupt.mp4")):
        item = dataset[(index, 0)]
        assert item["index"] == index and item["caption"] in good  # another sample of the same bucket
        assert item["video"].shape == (3, 8, 16, 16)
        assert [p.rsplit("/", 1)[1] for p, _ in item["failures"]] == [name]
        again = dataset[(index, 0)]
        assert again["caption"] == item["caption"] and (again["video"] == item["video"]).all()
    assert (
        "FileNotFoundError" in dataset[(4, 0)]["failures"][0][1]
        or "No such file" in dataset[(4, 0)]["failures"][0][1]
    )
    assert dataset[(0, 0)]["failures"] == []


def test_worker_processes_load_what_the_main_process_loads(messy_folder):
    """Replacements depend on (seed, epoch, index) alone: two loader workers give the batches that
    loading in this process gives, failures included."""
    from data.loader import build_loader
    from data.sampler import BucketSampler

    cfg = load_config(TINY, ["data.frame_counts=[8]"])
    entries, _ = index_folder(messy_folder)
    entries.append(
        {
            "path": str(messy_folder / "gone.mp4"),
            "caption": "missing",
            "width": 48,
            "height": 32,
            "num_frames": 20,
            "fps": 8,
        }
    )
    dataset = MediaDataset(entries, build_buckets(cfg), seed=5)
    sampler = BucketSampler(dataset.bucket_of, [2], seed=5)
    batches = [b for _, b in zip(range(6), build_loader(dataset, sampler, num_workers=2))]
    for step, batch in enumerate(batches):
        items = [dataset[key] for key in sampler.batch_at(step)]
        assert batch["index"] == [it["index"] for it in items] and batch["caption"] == [
            it["caption"] for it in items
        ]
        assert (batch["video"] == torch.stack([it["video"] for it in items])).all()
        assert batch["failures"] == [f for it in items for f in it["failures"]]
    assert any(batch["failures"] for batch in batches)  # the missing file came up


def test_a_bucket_with_nothing_readable_left_borrows_from_a_bucket_with_enough_frames(messy_folder):
    cfg = load_config(
        TINY, ["data.frame_counts=[4,8]", 'data.aspect_ratios=["1:1","3:2"]', "data.resolutions=[16]"]
    )
    entries, _ = index_folder(messy_folder)  # 48 x 32 clips: the 3:2 buckets
    entries.append(
        {
            "path": str(messy_folder / "gone.mp4"),
            "caption": "alone",
            "width": 16,
            "height": 16,
            "num_frames": 20,
            "fps": 8,
        }
    )  # the only 1:1 sample, deleted since
    dataset = MediaDataset(entries, build_buckets(cfg))
    alone = len(dataset) - 1
    assert dataset.table.buckets[dataset.bucket_of[alone]].name == "8x16x16"
    item = dataset[(alone, 0)]
    assert item["video"].shape == (3, 8, 16, 16) and item["caption"].startswith(
        "clip"
    )  # an 8-frame clip, cropped
    assert [p.rsplit("/", 1)[1] for p, _ in item["failures"]] == ["gone.mp4"]

    # images only (no fps anywhere): the same
    from PIL import Image

    Image.fromarray(np.full((32, 48, 3), 90, dtype=np.uint8)).save(messy_folder / "wide.png")
    images = MediaDataset(
        [
            {
                "path": str(messy_folder / "wide.png"),
                "caption": "wide",
                "width": 48,
                "height": 32,
                "num_frames": 1,
                "fps": None,
            },
            {
                "path": str(messy_folder / "gone.png"),
                "caption": "gone",
                "width": 16,
                "height": 16,
                "num_frames": 1,
                "fps": None,
            },
        ],
        build_buckets(
            load_config(
                TINY, ["data.frame_counts=[1]", 'data.aspect_ratios=["1:1","3:2"]', "data.resolutions=[16]"]
            )
        ),
    )
    item = images[(1, 0)]
    assert item["video"].shape == (3, 1, 16, 16) and item["caption"] == "wide"


def test_manifest_lines_are_checked_and_unusable_files_left_out(tmp_path, messy_folder):
    from data.loader import build_dataset
    from data.manifest import write_manifest

    for line, message in (
        ({"path": "a.mp4", "caption": "x", "width": "640"}, "'width' must be a positive whole number"),
        ({"path": "a.mp4", "caption": "x", "num_frames": 0}, "'num_frames' must be a positive"),
        ({"path": "a.mp4", "caption": 3}, "'caption' must be text"),
        ({"path": "a.mp4", "caption": "x", "fps": -1}, "'fps' must be a positive number"),
    ):
        write_manifest(tmp_path / "bad.jsonl", [{"path": "b.png", "caption": "ok"}, line])
        with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
            read_manifest(tmp_path / "bad.jsonl")
    # A 24 fps clip of 12 frames holds 4 frames at data.fps=8, not 8: its rate is probed when the line lacks
    # it.
    write_counter_video(messy_folder / "fast.mp4", frames=12, fps=24)
    write_manifest(
        messy_folder / "m.jsonl",
        [
            {"path": "good0.mp4", "caption": "a"},
            {"path": "fast.mp4", "caption": "b", "width": 48, "height": 32, "num_frames": 12},  # no fps
            {"path": "clip.ts", "caption": "c", "width": 48, "height": 32, "num_frames": 12, "fps": 8},
        ],
    )
    cfg = load_config(
        TINY, [f"data.manifest={messy_folder / 'm.jsonl'}", "data.frame_counts=[4,8]", "data.fps=8"]
    )
    dataset = build_dataset(cfg, build_buckets(cfg))
    assert dict(dataset.dropped) == {"unsupported file type": 1}
    assert "clip.ts: unsupported file type '.ts'" in dataset.summary()
    fast = next(i for i in range(len(dataset)) if dataset.entries[i]["path"].endswith("fast.mp4"))
    assert dataset.entries[fast]["fps"] == 24.0 and dataset.table.buckets[dataset.bucket_of[fast]].frames == 4
    assert dataset[(fast, 0)]["failures"] == []


def test_a_16_bit_grayscale_image_reads_as_its_levels_for_training_and_for_image_to_video(tmp_path):
    """A 16-bit grayscale PNG (Pillow mode I;16) is scaled to 8 bits (value / 257), not clipped to white,
    by the one reader training data and --image / sample.images share."""
    from PIL import Image

    from data.media import read_image
    from models.image_condition import load_image

    levels = (np.arange(16 * 16, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)  # 8-bit 0..255
    Image.fromarray(levels).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode in ("I;16", "I")
    expected = np.repeat(np.round(levels / 257.0).astype(np.uint8)[..., None], 3, axis=2)
    assert np.array_equal(np.asarray(load_image(tmp_path / "gray16.png")), expected)
    assert np.array_equal(np.round(read_image(tmp_path / "gray16.png")[0] * 255).astype(np.uint8), expected)
    clip = read_clip(tmp_path / "gray16.png", 1, 16, 16)  # a training sample of an image bucket
    assert np.array_equal(clip[0], expected)
