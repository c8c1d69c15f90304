import numpy as np
import pytest
import torch

from configs import load_config
from data.dataset import MediaDataset, SyntheticDataset
from data.loader import build_buckets
from data.manifest import complete_metadata, read_manifest, write_manifest
from data.media import fit_to_bucket, read_video, write_video
from data.synthetic import (
    ALL_COMBOS,
    COLORS,
    HELD_OUT,
    NEW_HELD_OUT,
    PALETTE,
    SHAPES,
    TRAIN_COMBOS,
    SyntheticVideoDataset,
    classify_shape,
    held_out_prompts,
    largest_component,
    read_clip,
    render_clip,
    train_combos,
)
from tests.conftest import TINY


def test_synthetic_is_deterministic_and_holds_out_combos():
    a, b = SyntheticVideoDataset(20, 4, 16, 16, seed=3), SyntheticVideoDataset(20, 4, 16, 16, seed=3)
    assert all(
        np.array_equal(a.render(i)[0], b.render(i)[0]) and a.render(i)[1] == b.render(i)[1] for i in range(20)
    )
    assert len(HELD_OUT) == 12 and not set(TRAIN_COMBOS) & HELD_OUT
    shapes = {(a.describe(i)["height"], a.describe(i)["width"], a.describe(i)["frames"]) for i in range(20)}
    assert len(shapes) > 3  # several aspect ratios and clip lengths


def test_a_new_colour_has_its_own_held_out_prompts_and_reads_back():
    """data.synthetic_colors=[orange] (demo_lora.sh): training combinations without its held-out ones, an
    unknown colour refused by name, and the judge reads a rendered orange clip as orange once the palette
    holds it (and as one of the demo's six when it does not)."""
    assert train_combos() == TRAIN_COMBOS
    orange = train_combos(["orange"])
    assert len(orange) == 8 and not set(orange) & NEW_HELD_OUT
    assert {p.split()[2] for p in held_out_prompts(["orange"])} == set(SHAPES)
    assert len(held_out_prompts(["orange"])) == 4 and all(
        " orange " in p for p in held_out_prompts(["orange"])
    )
    with pytest.raises(ValueError, match="'purple'.*choose from"):
        train_combos(["purple"])
    clip = render_clip("orange", "circle", "right", 8, 24, 24, np.random.default_rng(0))
    assert read_clip(clip, palette=PALETTE)["color"] == "orange"
    assert read_clip(clip)["color"] in COLORS


def test_read_clip_reads_ground_truth_in_every_bucket():
    """The demo's judge (scripts/eval_demo.py) on rendered clips, fitted to the demo's buckets as training
    sees them: colour, shape, direction and coherence always right."""
    demo = load_config("configs/demo.yaml")
    buckets = build_buckets(demo)
    data = SyntheticVideoDataset(
        144,
        max(buckets.frame_counts),
        demo.data.height,
        demo.data.width,
        seed=1,
        combos=ALL_COMBOS,
        min_frames=min(buckets.frame_counts),
    )
    dataset = SyntheticDataset(data, buckets)
    for i in range(len(data)):
        d, bucket = data.describe(i), buckets.buckets[dataset.bucket_of[i]]
        video = fit_to_bucket(data.render(i)[0], bucket.frames, bucket.height, bucket.width) / 255.0
        seen = read_clip(video)
        assert (seen["color"], seen["shape"], seen["direction"], seen["coherent"]) == (
            d["color"],
            d["shape"],
            d["direction"],
            True,
        ), (i, seen)
    # and at the size the demo samples and judges (data.frames x height x width), one clip per combination
    rng = np.random.default_rng(2)
    for color, shape, direction in ALL_COMBOS:
        video = render_clip(color, shape, direction, demo.data.frames, demo.data.height, demo.data.width, rng)
        assert read_clip(video) | {"min_fraction": None, "areas": None} == dict(
            color=color, shape=shape, direction=direction, coherent=True, min_fraction=None, areas=None
        )


def test_shape_reading_survives_ragged_edges_and_specks():
    """A generated object is never pixel-perfect: in every frame, 3 stray pixels stuck to its outline, 3
    missing from its edge and 2 dark specks inside still read as its shape (a bounding-box fill rule fell to
    68% with the 3 + 3 edge pixels alone: one stray pixel moves a box's side)."""
    demo = load_config("configs/demo.yaml")
    rng = np.random.default_rng(0)
    right = total = 0
    for color, shape, direction in ALL_COMBOS[::3]:
        video = render_clip(color, shape, direction, 4, demo.data.height, demo.data.width, rng)
        for frame in video:
            mask = largest_component(frame)[0]
            p = np.pad(mask, 1)
            neighbours = (p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:])
            grown, inner = mask | np.logical_or.reduce(neighbours), mask & np.logical_and.reduce(neighbours)
            outline, edge, core = (np.argwhere(grown & ~mask), np.argwhere(mask & ~inner), np.argwhere(inner))
            ragged = mask.copy()
            for where, count, value in ((outline, 3, True), (edge, 3, False), (core, 2, False)):
                for y, x in where[rng.choice(len(where), count, replace=False)]:
                    ragged[y, x] = value
            right += classify_shape(ragged) == shape
            total += 1
    assert right / total >= 0.97, f"{right} of {total}"


def test_read_clip_fails_fragments():
    video = np.zeros((4, 32, 32, 3), dtype=np.float32)
    video[:, 4:12, 4:12, 0] = 1.0  # one red square...
    assert read_clip(video)["coherent"] and read_clip(video)["shape"] == "square"
    two = video.copy()
    two[:, 20:27, 20:27, 0] = 1.0  # ...and a second one: 43% of the bright pixels outside the largest
    assert not read_clip(two)["coherent"]
    shrinking = video.copy()
    shrinking[3] = 0
    shrinking[3, 4:7, 4:7, 0] = 1.0  # the object shrinks to a ninth in the last frame
    assert not read_clip(shrinking)["coherent"]
    assert (
        read_clip(np.zeros((2, 8, 8, 3)))["color"] is None
        and not read_clip(np.zeros((2, 8, 8, 3)))["coherent"]
    )
    bar = np.zeros((4, 32, 32, 3), dtype=np.float32)
    bar[:, 4:28, 14:17, 1] = 1.0  # a coherent thing that is no square, circle or triangle: no shape is read
    assert read_clip(bar)["coherent"] and read_clip(bar)["shape"] is None


def test_resize_and_centre_crop():
    pixels = np.zeros((3, 20, 40, 3), dtype=np.float32)
    pixels[:, :, 6:34] = 1.0  # a white band wider than the centre crop
    clip = fit_to_bucket(pixels, frames=2, height=8, width=8)
    assert clip.shape == (2, 8, 8, 3) and clip.dtype == np.uint8
    assert clip.min() == 255  # only the white band survives the crop
    with pytest.raises(ValueError, match="too short: 3 frames, the bucket needs 5"):
        fit_to_bucket(pixels, frames=5, height=8, width=8)


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
    assert np.abs(decoded[:, : clip.shape[1], : clip.shape[2]] - clip).mean() < 0.03
    full = SyntheticVideoDataset(1, 6, 32, 32).render(0)[0].shape[0]
    assert (
        read_video(tmp_path / "c.mp4", fps=4).shape[0] == (full + 1) // 2
    )  # 8 fps -> 4 fps halves the frames
    # enlarged for watching (infer.py --upscale): each pixel becomes a 4 x 4 block; a .npy stays as sampled
    write_video(tmp_path / "big.gif", clip, fps=8, scale=4)
    big = read_video(tmp_path / "big.gif", max_frames=6)
    assert big.shape == (6, 4 * clip.shape[1], 4 * clip.shape[2], 3)
    assert np.abs(big[:, 1::4, 2::4] - clip).mean() < 0.03
    from PIL import Image

    first = write_video(tmp_path / "big.png", clip, scale=4)[0]  # lossless: every 4 x 4 block is one pixel
    frame = np.asarray(Image.open(first))
    assert frame.shape == (4 * clip.shape[1], 4 * clip.shape[2], 3)
    assert all(np.array_equal(frame[i::4, j::4], frame[::4, ::4]) for i in range(4) for j in range(4))
    write_video(tmp_path / "same.npy", clip, scale=4)
    assert np.array_equal(np.load(tmp_path / "same.npy"), clip)


def test_manifest_dataset_reads_videos_and_images(tmp_path):
    from PIL import Image

    data = SyntheticVideoDataset(2, 6, 24, 24)
    clip, caption = data.render(0)
    write_video(tmp_path / "media" / "a.mp4", clip, fps=8)
    Image.fromarray((clip[0] * 255).astype(np.uint8)).save(tmp_path / "media" / "b.png")
    write_manifest(
        tmp_path / "m.jsonl",
        [{"path": "media/a.mp4", "caption": caption}, {"path": "media/b.png", "caption": "an image"}],
    )
    cfg = load_config(TINY, ["data.frame_counts=[1,4]"])
    entries, _ = complete_metadata(read_manifest(tmp_path / "m.jsonl"))  # no sizes in the manifest: probed
    dataset = MediaDataset(entries, build_buckets(cfg))
    video = dataset[(0, 0)]
    assert (
        video["video"].shape == (3, 4, 16, 16)
        and video["video"].dtype == torch.uint8
        and video["caption"] == caption
    )
    assert dataset[(1, 0)]["video"].shape == (3, 1, 16, 16)  # an image is a 1-frame sample


def test_a_manifest_image_conditions_its_clip(tmp_path):
    """Image-to-video: a line's "image" replaces its clip's first frame as the condition (fitted to the
    bucket as the clip is); in a manifest that names images, a line without one keeps its clip's."""
    from PIL import Image

    from data.dataset import collate
    from data.loader import encode_family_batch
    from data.media import read_image
    from models.families import family_named
    from models.family import shared_fields
    from models.image_condition import condition_of_clips
    from parallel.drive.family_training import FamilyRun

    data = SyntheticVideoDataset(2, 5, 32, 32)
    lines = []
    for i in range(2):
        clip, caption = data.render(i)
        write_video(tmp_path / f"{i}.mp4", clip, fps=8)
        lines.append({"path": f"{i}.mp4", "caption": caption})
    picture = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(picture).save(tmp_path / "first.png")
    lines[0]["image"] = "first.png"  # relative to the manifest, as "path"
    write_manifest(tmp_path / "m.jsonl", lines)
    cfg = load_config(TINY, ["vae.kind=wan", "data.frames=5", "model.task=i2v"])
    entries, _ = complete_metadata(read_manifest(tmp_path / "m.jsonl"))
    dataset = MediaDataset(entries, build_buckets(cfg))
    named, own = dataset[(0, 0)], dataset[(1, 0)]
    fitted = fit_to_bucket(read_image(tmp_path / "first.png"), 1, 32, 32)[0]
    assert torch.equal(named["image"], torch.from_numpy(fitted).permute(2, 0, 1))
    assert torch.equal(own["image"], own["video"][:, 0])
    family, batch = family_named(cfg.model.family), collate([named])
    parts = family.load(cfg, torch.device("cpu"), torch.float32, transformer=False)
    vae = parts.vae
    encoded = encode_family_batch(FamilyRun(family, parts, 8), batch, [False], "cpu")
    condition = encoded[1 + shared_fields(family.conditioning).index("image")]  # after x0: its fields
    video = batch["video"].float() / 127.5 - 1
    expected = condition_of_clips(vae, None, video, False, batch["image"].float() / 127.5 - 1)
    assert torch.equal(condition, expected.latent)
    assert not torch.allclose(condition, condition_of_clips(vae, None, video, False).latent)


def test_manifest_frames_the_training_does_not_read_are_named_and_left(tmp_path, capsys):
    """A manifest naming first frames ("image") for a training that conditions on none (model.task=t2v):
    one warning naming the key, the count and the task, and the samples carry no frame (none is read); i2v
    reads them, without a word. (TI2V's given frame is its clip's own: Family.given_frames says none.)"""
    from PIL import Image

    from data.loader import build_dataset

    lines = []
    for i in range(2):
        clip, caption = SyntheticVideoDataset(2, 5, 32, 32).render(i)
        write_video(tmp_path / f"{i}.mp4", clip, fps=8)
        lines.append({"path": f"{i}.mp4", "caption": caption})
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(tmp_path / "first.png")
    lines[0]["image"] = "first.png"
    write_manifest(tmp_path / "m.jsonl", lines)
    for task, read in (("t2v", False), ("i2v", True)):
        cfg = load_config(TINY, ["vae.kind=wan", "data.frames=5", f"model.task={task}",
                                 f"data.manifest={tmp_path / 'm.jsonl'}"])  # fmt: skip
        dataset = build_dataset(cfg, build_buckets(cfg))
        said = capsys.readouterr().out
        assert ("image" in dataset[(0, 0)]) == read, task
        warning = f"`image` on 1 of its 2 lines, and tessera's DiT (Wan 2.1 / 2.2) with model.task={task}"
        assert (warning in said and "conditions on no frame: those frames are not read" in said) != read, said
    from types import SimpleNamespace

    from models.families import family_named

    tasks = {t: family_named("dit").given_frames(SimpleNamespace(model=SimpleNamespace(task=t))) for t in
             ("t2v", "i2v", "flf2v", "ti2v")}  # fmt: skip
    assert tasks == {"t2v": (), "i2v": ("image",), "flf2v": ("image", "last_image"), "ti2v": ()}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"caption": "x"}', "missing key"),
        ("{not json", "not valid JSON"),
    ],
)
def test_manifest_errors_name_the_line(tmp_path, line, message):
    (tmp_path / "m.jsonl").write_text('{"path": "a.png", "caption": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"m.jsonl:2: {message}"):
        read_manifest(tmp_path / "m.jsonl")


def test_a_latent_file_of_another_shape_is_replaced(tmp_path):
    """A stale latent (say, from an earlier recipe) is treated like an unreadable file: replaced by another
    sample of its bucket, never stacked into a batch it does not fit."""
    from safetensors.torch import save_file

    from data.dataset import LatentDataset

    cfg = load_config(TINY)
    table = build_buckets(cfg)  # one bucket, 4 x 16 x 16 pixels, identity VAE: latents (3, 4, 16, 16)
    entries = []
    for i, shape in enumerate([(3, 4, 16, 16), (3, 4, 16, 16), (3, 2, 8, 8)]):
        save_file(
            {"latent": torch.full(shape, float(i)), "text": torch.ones(5, 32)},
            str(tmp_path / f"{i}.safetensors"),
        )
        entries.append(
            {
                "path": str(tmp_path / f"{i}.safetensors"),
                "caption": f"c{i}",
                "frames": 4,
                "height": 16,
                "width": 16,
            }
        )
    dataset = LatentDataset(entries, table)
    item = dataset[(2, 0)]
    assert item["latent"].shape == (3, 4, 16, 16) and item["latent"].unique().item() in (0.0, 1.0)
    assert "latent of shape (3, 2, 8, 8), bucket 4x16x16 needs (3, 4, 16, 16)" in item["failures"][0][1]


@pytest.mark.parametrize("sizes", [True, False], ids=["lines with sizes", "lines without"])
def test_a_manifest_of_mostly_missing_files_is_refused_alike_with_sizes_or_without(tmp_path, sizes):
    """9 of 10 listed files missing: refused at start-up naming the count, the share, the key and the data
    report that lists them, whether the lines carry sizes (never opened at start-up) or not (probed)."""
    import json

    from PIL import Image

    from data.loader import build_dataset

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "there.png")
    size = {"width": 16, "height": 16, "num_frames": 1} if sizes else {}
    lines = [{"path": "there.png", "caption": "kept", **size}]
    lines += [{"path": f"gone{i}.png", "caption": "deleted", **size} for i in range(9)]
    write_manifest(tmp_path / "m.jsonl", lines)
    recipe = [f"data.manifest={tmp_path / 'm.jsonl'}", "data.frame_counts=[1]", f"run.output_dir={tmp_path}"]
    cfg = load_config(TINY, recipe)
    with pytest.raises(ValueError) as refused:
        build_dataset(cfg, build_buckets(cfg))
    message, report = str(refused.value), tmp_path / "data_report.jsonl"
    assert "9 of its 10 files (90.00%) are missing" in message, message
    assert "data.max_missing_fraction=0.2" in message and str(report) in message
    listed = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted(r["path"].rsplit("/", 1)[1] for r in listed) == [f"gone{i}.png" for i in range(9)]
    assert {r["category"] for r in listed} == {"missing"}
    # A share the recipe accepts trains on the rest (the missing files left out, or replaced when loaded).
    cfg = load_config(TINY, recipe + ["data.max_missing_fraction=0.9"])
    dataset = build_dataset(cfg, build_buckets(cfg))
    if sizes:
        assert "9 listed with sizes but missing (replaced when loaded)" in dataset.summary()
    else:
        assert dataset.dropped["missing"] == 9


def test_the_dits_stored_conditioning_is_its_text_encoders():
    """tessera's DiT from data.latents: a sample's stored real tokens come back zero-padded to
    text_encoder.max_length with their mask, and a dropped caption's empty prompt (no empty.safetensors in
    its folders) exactly as its text encoder gives it, padding embeddings included (an unmasked DiT, as
    Wan, attends them): what training from media sees."""
    from models.families import family_named

    cfg = load_config(TINY)
    family = family_named(cfg.model.family)
    parts = family.load(cfg, torch.device("cpu"), torch.float32, transformer=False)
    length = cfg.text_encoder.max_length
    text, mask = parts.text_encoder(["a red square", ""], "cpu")
    real = int(mask[0].sum())
    stored = [{"text": text[0, :real]}, family.empty_conditioning(parts, length)]
    cond = family.load_conditioning(stored, length)
    assert text[1, int(mask[1].sum()) :].any()  # its padding is not zeros: zero-padding would differ
    assert torch.equal(cond.text[1], text[1]) and torch.equal(cond.text_mask[1], mask[1])
    assert torch.equal(cond.text[0, :real], text[0, :real]) and not cond.text[0, real:].any()
    assert torch.equal(cond.text_mask[0], mask[0]) and cond.image is None and cond.image_features is None
