"""The second round of adversarial probes (issue 50, items 4 to 13), each as the probe ran it on bf7d40d, and
what happens now: a non-finite sample named and left out, a resume with other frozen encoders refused, a
full disk named truly while sampling with no partial file left, a checkpoint rotated away while read
named as such, float images read as floats, the folder's real class named, user errors one `error:` line
with exit 2, impossible LoRA strengths and environment interpolation refused while the command is read.
(The LTX-2 --image probe, item 7, is in tests/test_ltx2_pipeline.py, beside its tiny pipeline.)"""

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

import infer
import train
from configs.rundir import read_data_report
from parallel.checkpoints import checkpoint_files, checkpoint_reading
from tests.conftest import ROOT, TINY, run_main

COMMON = ["--config", str(TINY), "train.max_steps=2", "train.checkpoint_every=2"]


def one_error(err: str) -> str:
    """The one `error:` line of a run (exit 2, which prints no traceback of tessera's: a library's logging
    may print its own, under pytest's capture)."""
    lines = [line for line in err.splitlines() if line.startswith("error:") or "] error:" in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert run_main(train, COMMON + [f"run.output_dir={run_dir}"]) == 0
    return run_dir


# ---------------------------------------------------------------------------------------------------------
# 4. NaN in precomputed latents


def test_a_non_finite_latent_is_named_and_left_out(tmp_path, capfd):
    """bf7d40d: `training diverged ... try a lower train.lr`, the same step on every resume, and
    data_report.jsonl empty. Now the sample is replaced like an unreadable one, named in the data report,
    and the run trains on."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import precompute_latents

    latents = tmp_path / "latents"
    assert run_main(precompute_latents, ["--config", str(TINY), "--out", str(latents)]) == 0
    files = sorted((latents / "latents").iterdir())
    from safetensors.torch import load_file, save_file

    poisoned = files[3]
    tensors = load_file(poisoned)
    tensors["latent"][0, 0, 0, 0] = float("nan")
    save_file(tensors, poisoned)
    run_dir = tmp_path / "run"
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", f"data.latents={latents}"]
    assert run_main(train, argv + ["train.max_steps=16", "train.checkpoint_every=16"]) == 0  # one epoch
    capfd.readouterr()
    reported = [r for r in read_data_report(run_dir) if r["kind"] == "replaced"]
    assert reported and {r["path"] for r in reported} == {str(poisoned)}, reported
    assert "latent holds 1 NaN or inf values" in reported[0]["reason"]


# ---------------------------------------------------------------------------------------------------------
# 5. a resume with other frozen encoders


def test_a_resume_with_other_frozen_encoders_is_refused(tmp_path, capsys):
    """bf7d40d resumed silently with another VAE of the same shapes, or another text_encoder.seed. A VAE
    folder moved elsewhere (the same weights) still resumes."""
    from omegaconf import OmegaConf

    from configs.schema import VAEConfig
    from models.vae import build_vae

    for seed in (0, 1):
        build_vae(OmegaConf.structured(VAEConfig(kind="kl", seed=seed))).vae.save_pretrained(
            tmp_path / f"vae{seed}"
        )
    run_dir = tmp_path / "run"
    argv = [
        "--config",
        str(TINY),
        f"run.output_dir={run_dir}",
        "vae.kind=kl",
        "data.height=32",
        "data.width=32",
    ]
    argv += ["model.patch_size=[1,2,2]", "train.checkpoint_every=2"]
    assert run_main(train, argv + [f"vae.pretrained={tmp_path / 'vae0'}", "train.max_steps=2"]) == 0
    capsys.readouterr()
    refusals = {
        f"vae.pretrained={tmp_path / 'vae1'}": f"vae.pretrained: {tmp_path / 'vae0'} (weights ",
        "text_encoder.seed=5": "text_encoder.seed: 0 there, 5 here",
    }
    for override, named in refusals.items():
        vae = [] if override.startswith("vae.") else [f"vae.pretrained={tmp_path / 'vae0'}"]
        assert run_main(train, argv + [override, *vae, "train.max_steps=4"]) == 2
        line = one_error(capsys.readouterr().err)
        assert "was trained with other frozen encoders" in line and named in line, line
    shutil.move(tmp_path / "vae0", tmp_path / "moved")
    assert run_main(train, argv + [f"vae.pretrained={tmp_path / 'moved'}", "train.max_steps=4"]) == 0


# ---------------------------------------------------------------------------------------------------------
# 6. a full disk while sampling


def _full_disk(monkeypatch, folder):
    """numpy's write on a full disk: part of the file written, then an OSError without an errno ("problem
    writing element ... to file", as np.save said on a 200 KiB tmpfs), with the folder's free space 0."""
    import shutil as shutil_module

    _real_save, real_usage = np.save, shutil_module.disk_usage

    def save(file, array, *args, **kwargs):
        file.write(b"\x93NUMPY partial")
        raise OSError("problem writing element 51200 to file")

    def usage(path):
        found = real_usage(path)
        inside = str(os.path.abspath(path)).startswith(str(folder))
        return found._replace(free=0) if inside else found

    monkeypatch.setattr(np, "save", save)
    monkeypatch.setattr(shutil_module, "disk_usage", usage)


def test_a_full_disk_while_sampling_names_the_output_and_leaves_no_partial_file(
    trained, tmp_path, monkeypatch, capsys
):
    """bf7d40d: `OSError ... a failure inside tessera`, exit 1, or the wrong file system named (the run's
    checkpoints/), and a truncated .npy left as if it were a result. Now the file being written, its own
    file system and free space are named, exit 2, and nothing is left in the output folder."""
    out = tmp_path / "full"
    out.mkdir()
    _full_disk(monkeypatch, out)
    argv = [
        "--config",
        str(TINY),
        f"run.output_dir={trained}",
        "--steps",
        "1",
        "--output",
        str(out / "v.npy"),
    ]
    assert run_main(infer, argv) == 2
    line = one_error(capsys.readouterr().err)
    assert "no space left on" in line and f"while writing {out / 'v.npy'}" in line and "0.0 MB free" in line
    assert "checkpoints" not in line, line
    assert list(out.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_full_disk_while_sampling(trained, tmp_path):
    """The same on a 16 KiB tmpfs, where the machine lets this user mount one (root in a container)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        for ext in (".npy", ".mp4"):
            done = subprocess.run(
                [sys.executable, str(ROOT / "infer.py"), "--config", str(TINY), f"run.output_dir={trained}",
                 "--steps", "1", "--height", "128", "--width", "128", "--output", str(small / f"v{ext}")],
                cwd=ROOT, capture_output=True, text=True, timeout=120,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            assert done.returncode == 2, done.stderr[-3000:]
            line = one_error(done.stderr)
            assert f"no space left on {small} (tmpfs) while writing {small / f'v{ext}'}" in line, line
            assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


# ---------------------------------------------------------------------------------------------------------
# 8. a checkpoint rotated away while it is read


def test_a_checkpoint_rotated_away_while_read_is_named_as_such(trained, tmp_path):
    """bf7d40d: "has no trainer_rank0.pt ... not a complete tessera training checkpoint ...
    train.resume=none" (8 of 8 reads of a run at checkpoint_every=1): it was complete, and deleted while
    read. Every reader now says so, with advice that fits any command: run it again."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step = checkpoint_files.find_latest(run_dir)
    shutil.rmtree(step)  # what the training run's rotation did between resolving `latest` and reading
    readers = {
        "trainer state": checkpoint_reading.read_trainer_state,
        "files": checkpoint_reading.check_checkpoint_files,
        "checksums": checkpoint_reading.verify_checkpoint,
        "metadata": checkpoint_reading.read_metadata,
    }
    for what, read in readers.items():
        with pytest.raises(checkpoint_files.CheckpointError, match="was removed while it was read") as e:
            read(step)
        assert "rotated this one away" in str(e.value) and "Run the same command again" in str(e.value), what
        assert "train.resume=none" not in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reading_a_run_that_rotates_each_step(tmp_path):
    """infer.py on a run training with checkpoint_every=1, keep_checkpoints=1: each read either samples or
    names the rotation (at least one meets it: bf7d40d's 8 reads of 8 did); never "not a complete tessera
    training checkpoint"."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), f"run.output_dir={run_dir}",
         "train.max_steps=100000", "train.checkpoint_every=1", "train.keep_checkpoints=1",
         "train.sample_every=0"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        import time

        while not (run_dir / "checkpoints" / "latest").exists():
            assert trainer.poll() is None and time.sleep(0.1) is None
        outcomes = []
        for i in range(4):
            done = subprocess.run(
                [sys.executable, str(ROOT / "infer.py"), "--config", str(TINY), f"run.output_dir={run_dir}",
                 "--steps", "1", "--output", str(tmp_path / f"v{i}.npy")],
                cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
            )  # fmt: skip
            if done.returncode:
                line = one_error(done.stderr)
                assert "was removed while it was read" in line, line
            outcomes.append(done.returncode)
        assert set(outcomes) <= {0, 2} and 2 in outcomes, outcomes  # a read did meet the rotation
    finally:
        trainer.kill()
        trainer.wait()


# ---------------------------------------------------------------------------------------------------------
# 9. float images, NaN pixels


def test_float_images_are_read_as_floats_and_nan_pixels_are_refused(tmp_path):
    """bf7d40d read a float TIFF in 0..1 as black, and turned NaN and inf into 0 and 255 silently."""
    from PIL import Image

    from data.media import read_image
    from models.image_condition import load_image

    ramp = np.linspace(0, 1, 16 * 16, dtype=np.float32).reshape(16, 16)
    Image.fromarray(ramp, mode="F").save(tmp_path / "ramp.tif")
    pixels = read_image(tmp_path / "ramp.tif")[0]
    assert pixels.shape == (16, 16, 3) and pixels.max() == 1.0
    assert np.allclose(pixels[..., 0], np.round(ramp * 255) / 255)
    assert np.asarray(load_image(tmp_path / "ramp.tif")).max() == 255
    poisoned = ramp.copy()
    poisoned[3, 4] = np.nan
    poisoned[5, 6] = np.inf
    Image.fromarray(poisoned, mode="F").save(tmp_path / "nan.tif")
    with pytest.raises(
        ValueError, match=r"nan.tif cannot be used as an image: 2 of its 256 pixels are NaN or inf"
    ):
        load_image(tmp_path / "nan.tif")
    with pytest.raises(ValueError, match="NaN or inf"):
        read_image(tmp_path / "nan.tif")


# ---------------------------------------------------------------------------------------------------------
# 10. the right cause named


def test_another_models_folder_is_named_by_its_class(tmp_path, capsys):
    """bf7d40d: a Flux folder given to Sana's recipe failed on "cross_attention_dim"; a CogVideoX folder given
    to HunyuanVideo 1.5's was "HunyuanVideo 1.5's image-to-video pipeline". A folder's declared classes are
    named now, from model_index.json or, without one, from its transformer's config.json."""
    cases = {
        ("sana-1600m-1024px.yaml", "flux"): ("FluxPipeline", "FluxTransformer2DModel"),
        ("hunyuanvideo-1.5-480p.yaml", "cogvideox"): ("CogVideoXPipeline", "CogVideoXTransformer3DModel"),
    }
    for (recipe, name), (pipeline, transformer) in cases.items():
        folder = tmp_path / name
        (folder / "transformer").mkdir(parents=True)
        (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
        for index in (False, True):
            if index:
                (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
            named = " / ".join(sorted({transformer, *([pipeline] if index else [])}))
            for program, extra in ((train, []), (infer, ["--output", str(tmp_path / "v.png")])):
                argv = ["--config", str(ROOT / "configs" / recipe), f"model.pretrained={folder}", *extra]
                assert run_main(program, argv + [f"run.output_dir={tmp_path / 'run'}"]) == 2
                line = one_error(capsys.readouterr().err)
                assert f"holds a {named}, a family tessera does not know" in line, line


def test_a_clip_too_short_at_data_fps_says_so():
    """bf7d40d: at data.fps=5 a 9-frame clip of 24 fps was "too short (fewer than 9 frames)"."""
    from types import SimpleNamespace

    from data.buckets import BucketTable
    from models.vae import IdentityVAE

    data = SimpleNamespace(
        frame_counts=[9], resolutions=[16], aspect_ratios=["1:1"], max_upscale=1.0, tokens_per_batch=None,
        max_batch_size=None, frames=9, height=16, width=16,
    )  # fmt: skip
    table = BucketTable(data, IdentityVAE(), (1, 4, 4), 1)
    bucket, why = table.assign(16, 16, 9, source_fps=24, target_fps=5)
    assert bucket is None and why == "too short at data.fps=5 (its span holds fewer than 9 frames)", why
    assert table.assign(16, 16, 8)[1] == "too short (fewer than 9 frames)"


# ---------------------------------------------------------------------------------------------------------
# 11. user errors: one line, exit 2


def test_user_errors_are_one_line_with_exit_2(trained, tmp_path, capsys):
    """bf7d40d exited 1 with a traceback for each: a .metadata whose storage data is a list, run.lock being
    a folder (which it renamed aside), a VAE folder whose weights are a .bin pickle the library refuses."""
    run_dir = tmp_path / "listed"
    shutil.copytree(trained, run_dir)
    step = run_dir / "checkpoints" / "step_2"
    metadata = checkpoint_reading.read_metadata(step)
    metadata.storage_data = list(metadata.storage_data.values())
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    listing = json.loads((step / "checksums.json").read_text())
    data = (step / ".metadata").read_bytes()
    import zlib

    listing["files"][".metadata"] = {"size": len(data), "crc32": zlib.crc32(data)}
    (step / "checksums.json").write_text(json.dumps(listing))
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4"]
    assert run_main(train, argv) == 2
    assert "its storage_data is a list, not a dict" in one_error(capsys.readouterr().err)

    locked = tmp_path / "locked"
    (locked / "run.lock").mkdir(parents=True)
    assert run_main(train, COMMON + [f"run.output_dir={locked}"]) == 2
    assert "is a folder, not a lock file" in one_error(capsys.readouterr().err)
    assert (locked / "run.lock").is_dir() and len(list(locked.iterdir())) == 1

    from omegaconf import OmegaConf

    from configs.schema import VAEConfig
    from models.vae import build_vae

    folder = tmp_path / "vae"
    build_vae(OmegaConf.structured(VAEConfig(kind="kl"))).vae.save_pretrained(
        folder, safe_serialization=False
    )
    (folder / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(print))  # names builtins.print
    argv = COMMON + [f"run.output_dir={tmp_path / 'bin'}", "vae.kind=kl", f"vae.pretrained={folder}"]
    assert run_main(train, argv + ["data.height=32", "data.width=32", "model.patch_size=[1,2,2]"]) == 2
    line = one_error(capsys.readouterr().err)
    assert f"vae.pretrained={folder}: its weights could not be read" in line and "safetensors" in line, line


# ---------------------------------------------------------------------------------------------------------
# 12, 13. impossible LoRA strengths; environment interpolation


@pytest.mark.parametrize("strength", ["nan", "inf", "1e39", "-500"])
def test_an_impossible_lora_strength_is_refused_before_anything_loads(
    trained, tmp_path, monkeypatch, capsys, strength
):
    """bf7d40d accepted file:nan and file:1e39; the NaN output was refused after all the sampling."""
    monkeypatch.setattr(infer, "init_runtime", lambda *a, **k: pytest.fail("started"))
    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    argv = ["--config", str(TINY), f"run.output_dir={trained}", "--lora", f"{lora}:{strength}"]
    assert run_main(infer, argv + ["--output", str(tmp_path / "v.npy")]) == 2
    line = one_error(capsys.readouterr().err)
    assert f"its strength {strength} is not a number between -100 and 100" in line, line


def test_environment_interpolation_in_a_recipe_is_refused(tmp_path, capsys):
    """bf7d40d resolved ${oc.env:VAR} into config.yaml and W&B: a shared recipe copied the user's tokens
    into files they then share."""
    recipe = tmp_path / "shared.yaml"
    text = TINY.read_text().replace("wandb: false", "wandb: false\n  wandb_project: ${oc.env:SECRET_TOKEN}")
    recipe.write_text(text)
    os.environ["SECRET_TOKEN"] = "hunter2"
    run = f"run.output_dir={tmp_path / 'run'}"
    try:
        for argv in ([run], [run, "logging.wandb_project=${oc.env:SECRET_TOKEN}"]):
            assert run_main(train, ["--config", str(recipe if len(argv) == 1 else TINY), *argv]) == 2
            line = one_error(capsys.readouterr().err)
            assert "reads the environment (oc.env)" in line and "hunter2" not in line, line
    finally:
        del os.environ["SECRET_TOKEN"]
    assert not (tmp_path / "run").exists()


def test_a_storage_error_names_its_errno():
    """The full-disk error write_video raises carries the file it was writing (data/media.py _named)."""
    from pathlib import Path

    from data.media import _named

    named = _named(OSError(errno.ENOSPC, "No space left on device", "/x/.v.npy.partial"), Path("/x/v.npy"))
    assert named.filename == "/x/v.npy" and named.errno == errno.ENOSPC
