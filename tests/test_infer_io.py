"""What infer.py reads and writes: an --output that cannot be written is refused before any model is built;
prompts sampled in batches of sample.batch_size give the videos one batch gives, each batch written as it
finishes (on 2 processes too, step cache included); a video with NaN or inf is never written, on every rank
alike, with the likely cause named (and a training preview with one is not written either); an --image far
from the video's size or shape is warned about, or refused with a size the model can sample."""

import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import infer
import train
from models.flow import RectifiedFlow
from models.image_condition import read_images
from tests.conftest import ROOT, TINY, ranks, run_main

PROMPTS = ["a red square moving left", "a blue circle moving right", "a green square moving up"]
SMALL = ["--random-weights", "--steps", "2"]


def sample_args(tmp_path, output, *extra):
    return [
        "--config",
        str(TINY),
        f"run.output_dir={tmp_path / 'run'}",
        *SMALL,
        "--output",
        str(output),
        *extra,
    ]


def outputs(output, count):
    return [output.with_name(f"{output.stem}_{i:03d}{output.suffix}") for i in range(count)]


def test_an_output_that_cannot_be_written_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was built before the output was checked")

    monkeypatch.setattr(infer, "load_sampling", never)
    folder = tmp_path / "out.npy"
    folder.mkdir()  # a folder named like a file
    (tmp_path / "notes.txt").write_text("a file")
    cases = [
        (folder, f"--output {folder} is a folder: name a file in it"),
        (tmp_path / "notes.txt" / "x.npy", f"{tmp_path / 'notes.txt'} is a file, not a folder"),
    ]
    try:  # a file system no process may create files in (root bypasses permission bits, not this)
        tempfile.NamedTemporaryFile(dir="/sys").close()
    except OSError:
        cases.append((Path("/sys/x.npy"), "no file can be created in /sys"))
    for output, message in cases:
        assert run_main(infer, sample_args(tmp_path, output)) == 2, output
        err = capsys.readouterr().err
        assert message in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_lora_recipe_whose_run_is_not_found_is_refused_not_sampled_as_its_base(tmp_path, capsys):
    """A LoRA recipe with no checkpoint in its run.output_dir (not trained yet, or started from another
    folder) is refused by name: the bare base would pass for the LoRA. --checkpoint none samples the base."""
    base = tmp_path / "base"
    argv = ["--config", str(TINY), f"run.output_dir={base}", "train.max_steps=1", "train.sample_every=0"]
    assert run_main(train, argv) == 0
    lora = ["--config", str(TINY), "lora.rank=4", f"model.pretrained={base}"]
    lora.append(f"run.output_dir={tmp_path / 'lora'}")
    small, out = ["--steps", "2"], tmp_path / "out.npy"
    assert run_main(infer, [*lora, *small, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the run of this LoRA recipe: train first" in err and err.count("error:") == 1
    assert not out.exists()
    assert run_main(infer, [*lora, *small, "--checkpoint", "none", "--output", str(out)]) == 0
    assert out.exists()


def test_batches_sample_what_one_batch_samples_and_are_written_as_they_finish(tmp_path, capsys, monkeypatch):
    """Today's sampling is one batch of every prompt (sample.batch_size at least the prompt count); batches
    of 2 give the same videos, prompt i from seed + i, and batch k's videos exist before batch k + 1
    starts."""
    prompts = PROMPTS + ["a yellow circle moving down", "a red circle moving right"]
    one = tmp_path / "one" / "v.npy"  # a folder write_video creates
    assert run_main(infer, sample_args(tmp_path, one, "sample.batch_size=8", "--prompt", *prompts)) == 0
    reference = np.stack([np.load(p) for p in outputs(one, 5)])
    assert np.abs(reference[0] - reference[1]).max() > 1e-2  # the prompts give different videos

    import parallel.drive.family_sampling

    generate, calls = parallel.drive.family_sampling.generate_images, []

    def watched(family, parts, sampling, *args, **kwargs):
        written = [p.exists() for p in outputs(tmp_path / "b.npy", 5)]
        calls.append((sampling.prompts, sampling.seeds, written))
        return generate(family, parts, sampling, *args, **kwargs)

    monkeypatch.setattr(parallel.drive.family_sampling, "generate_images", watched)
    capsys.readouterr()
    args = sample_args(
        tmp_path, tmp_path / "b.npy", "sample.batch_size=2", "--seed", "0", "--prompt", *prompts
    )
    assert run_main(infer, args) == 0
    assert [(batch, seeds) for batch, seeds, _ in calls] == [
        (prompts[0:2], [0, 1]),
        (prompts[2:4], [2, 3]),
        (prompts[4:5], [4]),
    ]
    assert [written for _, _, written in calls] == [
        [False] * 5,
        [True] * 2 + [False] * 3,
        [True] * 4 + [False],
    ]
    batched = np.stack([np.load(p) for p in outputs(tmp_path / "b.npy", 5)])
    assert np.abs(batched - reference).max() <= 1e-5  # float rounding of other batch shapes, no more
    assert "batch 3 of 3" in capsys.readouterr().err  # the progress bar counts batches


FIRST_BLOCK = ["sample.cache=first_block", "sample.cache_first_block_threshold=0.03"]
CACHED = ["--frames", "3", "--height", "12", "--width", "20", "--steps", "8", *FIRST_BLOCK]


def test_the_step_cache_decides_per_batch_as_in_one_batch(tmp_path, capsys):
    """sample.cache=first_block decides per sample: one prompt a batch skips the blocks one batch skips,
    and the summary counts over every batch."""
    videos, lines = [], []
    for name, size in (("one", 3), ("each", 1)):
        output = tmp_path / f"{name}.npy"
        args = sample_args(tmp_path, output, *CACHED, f"sample.batch_size={size}", "--prompt", *PROMPTS)
        assert run_main(infer, args) == 0
        videos.append(np.stack([np.load(p) for p in outputs(output, 3)]))
        lines.append(re.findall(r"step cache: .* ran every block", capsys.readouterr().out))
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert np.abs(videos[0] - videos[1]).max() <= 1e-5


def poison(monkeypatch, rows):
    """Every Euler step turns the latents of `rows` (of each batch) to NaN, as a model overflowing would."""
    step = RectifiedFlow.euler_step

    def poisoned(x, v, sigmas, i):
        out = step(x, v, sigmas, i)
        mine = rows if isinstance(rows, slice) else [r for r in rows if r < len(out)]  # a shorter last batch
        out[mine] = float("nan")
        return out

    monkeypatch.setattr(RectifiedFlow, "euler_step", staticmethod(poisoned))


def test_a_video_with_nan_is_never_written_and_the_causes_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import calibrate_cache

    calibration = tmp_path / "cache.json"
    made = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--random-weights", "--seeds", "1"]
    assert run_main(calibrate_cache, [*made, "--output", str(calibration)]) == 0
    poison(monkeypatch, [1])  # the second prompt of each batch
    output = tmp_path / "v.npy"
    for extra, cause in (
        ([], "the weights, --random-weights, overflowing or diverged"),
        (
            ["sample.cache=calibrated", f"sample.cache_calibration={calibration}"],
            f"sample.cache_calibration={calibration} (try sample.cache=none)",
        ),
    ):
        args = sample_args(
            tmp_path, output, "sample.batch_size=2", "--steps", "3", "--prompt", *PROMPTS, *extra
        )
        assert run_main(infer, args) == 2
        err = capsys.readouterr().err
        first, second, third = outputs(output, 3)
        assert f"prompt 1 ({PROMPTS[1]!r}) in the denoised latents" in err and cause in err, err
        assert f"nothing was written for {second}" in err and err.count("error:") == 1
        assert np.isfinite(np.load(first)).all()  # the batch's finite video is kept
        assert not second.exists()
        assert np.isfinite(np.load(third)).all()  # the sampling goes on: no other prompt's work is lost
        first.unlink()
        third.unlink()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_sample_in_batches_and_stop_alike_on_nan(tmp_path):
    """cfg 2 on 2 processes with first_block's per-batch agreement: batches 1 and 3 are one process's
    one-batch videos, written as they finish; batch 2 turns NaN on both ranks, which write nothing for it,
    sample batch 3, and then both fail with the error line (not a hang, not a video)."""
    reference = tmp_path / "one.npy"
    args = sample_args(tmp_path, reference, *CACHED, "sample.batch_size=3", "--prompt", *PROMPTS)
    assert run_main(infer, args) == 0
    output = tmp_path / "two.npy"
    result = ranks(
        2,
        "tests/nan_worker.py",
        *sample_args(
            tmp_path, output, *CACHED, "parallel.cfg=2", "sample.batch_size=1", "--prompt", *PROMPTS
        ),
        timeout=200,
        env={"TESSERA_TEST_NAN_BATCH": "2"},
    )
    assert result.returncode != 0, result.stderr[-3000:]
    for rank in (0, 1):  # each its own line (a user error, exit 2), not a peer's failure reported
        assert f"[rank {rank}] error: sampling gave NaN or inf values (prompt 1 " in result.stderr, rank
    assert result.codes == [2, 2], result.stderr[-3000:]
    first, second, third = outputs(output, 3)
    assert not second.exists()
    ours = np.stack([np.load(p) for p in outputs(reference, 3)[::2]])
    assert np.abs(np.stack([np.load(first), np.load(third)]) - ours).max() <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_nan_video_of_one_replica_costs_the_others_nothing(tmp_path):
    """dp 2: replica 1's only video turns NaN. Replica 0 samples and writes its own as if nothing happened
    (the failure is agreed only once every replica is done), then both fail alike, each its own line."""
    output = tmp_path / "dp.npy"
    result = ranks(
        2,
        "tests/nan_worker.py",
        *sample_args(tmp_path, output, "parallel.dp=2", "--steps", "3", "--prompt", *PROMPTS[:2]),
        timeout=200,
        env={"TESSERA_TEST_NAN_BATCH": "1", "TESSERA_TEST_NAN_RANK": "1"},
    )
    first, second = outputs(output, 2)
    assert np.isfinite(np.load(first)).all() and not second.exists(), result.stderr[-3000:]
    tail = result.stderr[-3000:]
    assert "[rank 1] error: sampling gave NaN or inf values (prompt 1 " in result.stderr, tail
    assert "[rank 0] error: a video of another data-parallel replica held NaN or inf" in result.stderr
    assert result.codes == [2, 2], result.stderr[-3000:]


@pytest.mark.slow
def test_a_training_preview_with_nan_is_not_written(tmp_path, capfd, monkeypatch):
    poison(monkeypatch, slice(None))
    run = tmp_path / "run"
    args = ["--config", str(TINY), f"run.output_dir={run}", "train.max_steps=1", "sample.steps=1"]
    assert run_main(train, args) == 0  # a warning, not a stop: the checkpoint is the work
    assert (
        "step 1's preview gave NaN or inf (sample.prompts[0] in the denoised latents)"
        in capfd.readouterr().err
    )
    assert not list((run / "samples").glob("*"))


def picture(path, width, height):
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(path)
    return str(path)


def images_for(paths, height, width, count=1, say=None):
    return read_images(
        "i2v",
        (paths, None),
        ("--image", "--last-image", "--height", "--width"),
        count,
        5,
        height,
        width,
        4,
        multiple=(16, 16),
        say=say,
    )


def test_an_image_far_from_the_video_is_warned_about_or_refused_with_a_sampleable_size(tmp_path):
    said = []
    tiny = picture(tmp_path / "tiny.png", 1, 1)
    images_for([tiny], 32, 32, count=3, say=said.append)  # one image for three prompts: one warning
    assert said == [
        f"--image {tiny} is 1x1, enlarged over 4 times to the video's 32x32: its frame will be "
        "blurred (give a larger image)"
    ]
    images_for([picture(tmp_path / "half.png", 16, 16)], 32, 32, say=said.append)
    assert len(said) == 1  # twice smaller: not worth a word

    strip = picture(tmp_path / "strip.png", 40000, 2)
    with pytest.raises(ValueError, match="strip.png is 40000x2 and the video 832x480") as refused:
        images_for([strip], 480, 832)
    assert "crop the image" in str(refused.value)
    assert all(int(n) <= 832 for n in re.findall(r"\d+", str(refused.value).split("video 832x480")[1]))

    wide = picture(tmp_path / "wide.png", 1000, 500)
    with pytest.raises(ValueError) as refused:
        images_for([wide], 480, 832)
    height, width = map(int, re.search(r"--height (\d+) --width (\d+)", str(refused.value)).groups())
    assert height % 16 == 0 and width % 16 == 0
    assert abs(width / height - 2) <= 0.2 and 0.8 <= width * height / (480 * 832) <= 1.2
    images_for([wide], height, width)  # the suggested size is accepted


def test_sound_is_written_beside_the_video_and_muxed_into_an_mp4(tmp_path):
    """A video with sound (LTX-2's): .npy and .gif get <stem>.wav beside them, float32 samples that PyAV
    (ffmpeg's WAV reader, code no one here wrote) reads back exactly; an .mp4 carries the sound as its AAC
    track, whose decoded samples keep the tone's level; more than two channels are refused by name."""
    import av

    from data.media import write_video

    t = np.arange(16000) / 16000
    tones = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    video = np.random.default_rng(0).random((9, 16, 24, 3), dtype=np.float32)
    for ext in (".npy", ".gif"):
        written = write_video(tmp_path / f"v{ext}", video, fps=24, audio=(tones, 16000))
        assert written == [tmp_path / f"v{ext}", tmp_path / "v.wav"]
        with av.open(str(tmp_path / "v.wav")) as container:
            assert container.streams.audio[0].codec_context.name == "pcm_f32le"
            assert container.streams.audio[0].sample_rate == 16000
            read = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
        read = read.reshape(-1, 2).T  # packed: the channels interleaved
        assert read.shape == tones.shape and np.array_equal(read, tones)
    assert write_video(tmp_path / "v.mp4", video, fps=24, audio=(tones, 16000)) == [tmp_path / "v.mp4"]
    with av.open(str(tmp_path / "v.mp4")) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    assert sound.shape[0] == 2 and sound.shape[1] >= 16000
    # AAC's priming and padding frames are silent: the level compared away from the ends
    assert np.allclose(sound[:, 2048:14000].std(axis=1), tones.std(axis=1), rtol=0.05)
    with pytest.raises(ValueError, match="mono or stereo; this one has 3 channels"):
        write_video(tmp_path / "w.mp4", video, audio=(np.zeros((3, 100), np.float32), 16000))
