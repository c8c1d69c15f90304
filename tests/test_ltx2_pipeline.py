"""LTX-2 as a tessera family (models/ltx2/family.py) against diffusers' LTX2Pipeline, code no one here wrote:
a tiny random pipeline (Gemma 3 text model with the byte-level tokenizer of tests/test_qwen_image.py,
connectors, video and audio VAEs, vocoder, a dynamically shifted scheduler stretched to shift_terminal)
saved and loaded through configs/ltx-2.yaml; the video frames and the sound's waveform of
models/sampler.py generate_images against the pipeline's, per prompt, at a non-square size, with the
pipeline's default guidance and with guidance off; the refusals by name. What every family is checked for
(infer.py against the pipeline on one process and under its layouts, a PEFT LoRA, bf16, the refusals
every family has) is its row of tests/test_families.py."""

import shutil

import numpy as np
import pytest
import torch

from configs import load_config
from models.families import family_named, family_of_folder
from models.sampler import Sampling, generate_images
from tests.conftest import ROOT

TEXT_DIM = 32  # Gemma's width = the connectors' (4 heads x 8) = the transformer's caption_channels
SIZE = (9, 32, 64)  # frames, height, width: 5 x 16 x 32 video latents, 9 audio latents
STEPS, MAX_LENGTH = 3, 16
PROMPTS, SEEDS = ["a red fox runs through snow", "waves on a beach"], [3, 11]
NEGATIVE = "blurry"
OFF = dict(guidance=1.0, audio_guidance=1.0, modality_guidance=1.0, stg=0.0)  # every term off


def tiny_pipeline(stg: bool = False, encodes: bool = False):
    """A tiny random LTX2Pipeline, float32, LTX-2.0's options (perturbed_attn false, as released); `stg`:
    perturbed_attn true and 29 blocks, so that the pipeline's STG pass perturbs its default block 28;
    `encodes`: VAEs that compress as the release's do (the video's 2 x in time too, the audio's 4 x in
    time and mel bins), so that training's encoded clips have the latents' shapes, and a gate timestep
    scale of its own."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tests.test_qwen_image import tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    text = dict(
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=len(tokenizer),
        sliding_window=4,
        max_position_embeddings=256,
    )
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=dict(vision, image_size=16, patch_size=8))
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,  # 2 latent channels x 2 latent mel bins
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=29 if stg else 2,
        caption_channels=TEXT_DIM,
        rope_type="split",
        perturbed_attn=stg,
        # training's gates read the other stream's sigma at this scale, the rest at 1000: told apart
        cross_attn_timestep_scale_multiplier=500 if encodes else 1000,
    )
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_DIM,
        text_proj_in_factor=3,  # Gemma's 2 layers + its embeddings
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),  # 2x in time and space
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",) if encodes else ("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        patch_size=1,
        patch_size_t=1,
        decoder_causal=False,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1, 2, 4) if encodes else (1,),
        num_res_blocks=1,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=16,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    with torch.no_grad():  # outputs of std ~1, and latents statistics that are not the identity
        for p in transformer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        for stats, channels in ((vae, 4), (audio_vae, 4)):
            stats.latents_mean.copy_(torch.randn(channels) * 0.3)
            stats.latents_std.copy_(torch.rand(channels) + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
        time_shift_type="exponential",
    )
    parts = dict(vae=vae, audio_vae=audio_vae, text_encoder=encoder, transformer=transformer)
    parts.update(connectors=connectors, vocoder=vocoder)
    parts = {name: module.eval() for name, module in parts.items()}
    return LTX2Pipeline(scheduler=scheduler, tokenizer=tokenizer, **parts)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_stg(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2_stg") / "pipeline"
    with torch.random.fork_rng():
        tiny_pipeline(stg=True).save_pretrained(folder)
    return folder


def recipe(folder, **sample):
    """configs/ltx-2.yaml on `folder`, with sample.KEY=VALUE overrides."""
    overrides = [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    overrides += [f"text_encoder.max_length={MAX_LENGTH}"]
    overrides += [f"sample.{key}={value}" for key, value in sample.items()]
    return load_config(ROOT / "configs" / "ltx-2.yaml", overrides)


def tessera(folder, count: int = 2, size=SIZE, **sample) -> tuple:
    """(frames (B, T, H, W, 3) in [0, 1], waveforms (B, channels, samples), rate) of generate_images for
    the first `count` prompts."""
    cfg = recipe(folder, **sample)
    family = family_named(cfg.model.family)
    family.check_pretrained(cfg)
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    prompts, seeds = PROMPTS[:count], SEEDS[:count]
    sampling = Sampling(prompts, seeds, size, STEPS, cfg.sample.guidance, NEGATIVE, MAX_LENGTH)
    sound = []
    frames = generate_images(family, parts, sampling, sound=sound)
    return frames, *sound[0]


def pipeline(source, prompt, seed, size=SIZE, **terms) -> tuple:
    """(frames (T, H, W, 3), waveform (channels, samples)) of LTX2Pipeline at its defaults but `terms`;
    `source`: its folder, or the pipeline (a LoRA loaded in it)."""
    from diffusers import LTX2Pipeline

    pipe = (
        source
        if isinstance(source, LTX2Pipeline)
        else LTX2Pipeline.from_pretrained(source, dtype=torch.float32)
    )
    frames, height, width = size
    video, audio = pipe(
        prompt=prompt,
        negative_prompt=NEGATIVE,
        num_frames=frames,
        height=height,
        width=width,
        frame_rate=24.0,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        max_sequence_length=MAX_LENGTH,
        return_dict=False,
        **({"num_inference_steps": STEPS} | terms),
    )
    return video[0], audio[0].float().numpy()  # the video as numpy, the sound a tensor whatever output_type


def compare(folder, got, terms, what, seeds=SEEDS, size=SIZE):
    frames, waves, rate = got
    count = len(frames)
    assert rate == 16000 and frames.shape == (count, *size, 3) and waves.shape[:2] == (count, 2)
    for i, (prompt, seed) in enumerate(zip(PROMPTS[:count], seeds[:count])):
        video, audio = pipeline(folder, prompt, seed, size, **terms)
        dv, da = float(np.abs(frames[i] - video).max()), float(np.abs(waves[i] - audio).max())
        print(
            f"{what} prompt {i}: video max abs {dv:.2e} (std {video.std():.3f}, {video.shape}), "
            f"audio max abs {da:.2e} (std {audio.std():.3f}, {audio.shape})"
        )
        assert video.shape == frames[i].shape and audio.shape == waves[i].shape
        assert video.std() > 0.05 and audio.std() > 0.01
        assert dv <= 1e-5 and da <= 1e-5


def infer_args(folder, run) -> list:
    """infer.py on `folder` with configs/ltx-2.yaml: PROMPTS, NEGATIVE, SIZE, STEPS, --seed 3."""
    frames, height, width = SIZE
    argv = ["--config", str(ROOT / "configs" / "ltx-2.yaml"), f"text_encoder.max_length={MAX_LENGTH}"]
    argv += [f"{key}.pretrained={folder}" for key in ("model", "vae", "text_encoder")]
    argv += [f"run.output_dir={run}", "--prompt", *PROMPTS, "--negative-prompt", NEGATIVE, "--seed", "3"]
    return [
        *argv,
        "--frames",
        str(frames),
        "--height",
        str(height),
        "--width",
        str(width),
        "--steps",
        str(STEPS),
    ]


def written(folder) -> tuple:
    """(videos (B, T, H, W, 3), waveforms (B, channels, samples), rate) of infer.py's out_00i.npy / .wav."""
    from data.media import read_wav

    videos = np.stack([np.load(folder / f"out_{i:03d}.npy") for i in range(len(PROMPTS))])
    sounds = [read_wav(folder / f"out_{i:03d}.wav") for i in range(len(PROMPTS))]
    return videos, np.stack([wave for wave, _ in sounds]), sounds[0][1]


@pytest.fixture(scope="module")
def one_process(saved, tmp_path_factory):
    """infer.py's outputs on one process (the reference of the split layouts)."""
    import infer
    from tests.conftest import run_main

    out = tmp_path_factory.mktemp("ltx2_one")
    argv = [*infer_args(saved, out / "run"), "--output", str(out / "out.npy"), "sample.batch_size=2"]
    assert run_main(infer, argv) == 0  # both prompts in one batch: each video with its own sound
    return written(out)


@torch.no_grad()
def test_infer_matches_the_pipeline(saved, one_process):
    """infer.py --config configs/ltx-2.yaml on the folder with the recipe's guidance (the pipeline's
    defaults: video CFG 3, audio CFG 7, modality 3, rescale 0.7, STG 1 at block 28, a no-op under
    perturbed_attn false), two prompts from --seed 3 (seeds 3 and 4), --output out.npy: out_00i.npy and
    out_00i.wav beside it hold the video and the sound the pipeline gives with its defaults."""
    compare(saved, one_process, {}, "infer.py, default guidance", seeds=[3, 4])


def first_frames(folder) -> list:
    """Two different 64 x 40 PNGs in `folder` (one per prompt)."""
    from PIL import Image

    paths = []
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, (40, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"first_{i}.png")
        paths.append(str(folder / f"first_{i}.png"))
    return paths


@pytest.fixture(scope="module")
def image_to_video(saved, tmp_path_factory):
    """(the images, infer.py --image's outputs on one process): one image per prompt, both in one batch."""
    import infer
    from tests.conftest import run_main

    out = tmp_path_factory.mktemp("ltx2_i2v")
    images = first_frames(out)
    argv = [*infer_args(saved, out / "run"), "--output", str(out / "out.npy"), "sample.batch_size=2"]
    assert run_main(infer, [*argv, "--image", *images]) == 0
    return images, written(out)


@pytest.mark.slow
def test_ring3_from_first_frames_is_one_process(saved, image_to_video, tmp_path):
    """The video tokens split over 3 ranks (the audio whole on each), a token count ring 3 does not divide
    (2,560: the padding masked in the video's self-attention and the video-to-audio keys), from first
    frames (the per-token timesteps split with the tokens): infer.py writes one process's videos and
    sounds. (ulysses 2 and cfg 2 against the pipeline: the row of tests/test_families.py.)"""
    from tests.conftest import ranks

    images, reference = image_to_video
    argv = [*infer_args(saved, tmp_path / "run"), "--output", str(tmp_path / "out.npy")]
    done = ranks(3, "infer.py", *argv, "parallel.ring=3", "--image", *images, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = written(tmp_path)
    dv, da = (float(np.abs(a - b).max()) for a, b in zip(got[:2], reference[:2]))
    print(f"LTX-2 ring3 from first frames: video max abs {dv:.2e}, sound {da:.2e} from one process")
    assert got[2] == reference[2] and dv <= 1e-5 and da <= 1e-5


@pytest.mark.slow  # 29 blocks with the perturbed pass
@torch.no_grad()
def test_stg_pass_matches_the_pipeline(saved_stg):
    """Under perturbed_attn true (29 blocks) STG's pass runs (block 28's self-attentions give their
    values), and moves the video; one prompt, half SIZE's tokens (29 blocks, four passes a step)."""
    size = (SIZE[0], SIZE[1], SIZE[2] // 2)
    default = tessera(saved_stg, 1, size)
    compare(saved_stg, default, {}, "default guidance, STG at block 28", size=size)
    change = np.abs(tessera(saved_stg, 1, size, stg=0.0)[0] - default[0]).max()
    print(f"STG 1 against 0: video max abs {change:.2e}")
    assert change > 1e-3


@torch.no_grad()
def test_guidance_off_matches_the_pipeline(saved):
    """Every term off: one conditional pass a step (the rescale of an unguided x0 changes nothing)."""
    terms = dict(guidance_scale=1.0, audio_guidance_scale=1.0, modality_scale=1.0, stg_scale=0.0)
    terms.update(audio_modality_scale=1.0, audio_stg_scale=0.0)
    compare(saved, tessera(saved, 1, **OFF), terms, "guidance off")


@torch.no_grad()
def test_modality_guidance_changes_the_video(saved, one_process):
    """sample.modality_guidance is read: 1 (no isolated pass) gives another video and sound than the
    recipe's 3 (infer.py's first prompt, seed 3, is the default's)."""
    frames, waves, _ = tessera(saved, 1, modality_guidance=1.0)  # PROMPTS[0] from SEEDS[0] = 3
    assert np.abs(frames[0] - one_process[0][0]).max() > 1e-3
    assert np.abs(waves[0] - one_process[1][0]).max() > 1e-4


def test_no_audio_writes_the_same_video_alone(saved, one_process, tmp_path):
    """--no-audio: the same videos (the sound is sampled beside them, as it must be, then neither decoded
    nor written): no .wav."""
    import infer
    from tests.conftest import run_main

    argv = [
        *infer_args(saved, tmp_path / "run"),
        "--output",
        str(tmp_path / "out.npy"),
        "sample.batch_size=2",
    ]
    assert run_main(infer, [*argv, "--no-audio"]) == 0
    videos = np.stack([np.load(tmp_path / f"out_{i:03d}.npy") for i in range(len(PROMPTS))])
    assert not list(tmp_path.glob("*.wav")) and np.array_equal(videos, one_process[0])


def test_infer_refuses_before_loading(saved, tmp_path, capsys):
    """infer.py and train.py refuse by name, one error line, nothing written: audio CFG without the
    video's (--guidance 1 over the recipe's 3), a guidance term tessera's DiT does not read, and LTX-2's
    training without data.fps (its positions in time, and each bucket's sound length)."""
    import infer
    import train
    from tests.conftest import run_main

    out = ["--output", str(tmp_path / "out.npy")]
    cases = [
        (
            infer,
            [*infer_args(saved, tmp_path / "run"), "--guidance", "1", *out],
            "audio_guidance=7.0 with guidance 1",
        ),
        (
            infer,
            ["--config", str(ROOT / "configs" / "demo.yaml"), "--random-weights", "sample.stg=1.0", *out],
            "sample.stg=1.0: tessera's DiT (Wan 2.1 / 2.2) takes no such guidance",
        ),
        (
            infer,
            ["--config", str(ROOT / "configs" / "demo.yaml"), "--random-weights", "--no-audio", *out],
            "--no-audio: tessera's DiT (Wan 2.1 / 2.2) samples no sound",
        ),
        (
            train,
            [*infer_args(saved, tmp_path / "run")[:7], "data.audio=true", "data.fps=null"],
            "data.fps",
        ),
        (  # its velocity is several passes a step: no calibrated replay (calibrate_cache.py refuses too)
            infer,
            [
                *infer_args(saved, tmp_path / "run"),
                "sample.cache=calibrated",
                "sample.cache_calibration=c.json",
            ],
            "sample.cache=calibrated: LTX-2 does not take it (its velocity is up to four passes",
        ),
    ]
    for program, argv, expected in cases:
        assert run_main(program, argv) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.npy").exists()


def test_family_and_refusals(saved, tmp_path):
    """The folder is LTX-2's; audio CFG without the video's, a missing vocoder, a Karras scheduler, a size
    the pipeline refuses and the step cache are refused by name."""
    family = family_of_folder(saved)
    assert family is not None and family.name == "ltx2"
    with pytest.raises(ValueError, match="sample.audio_guidance"):  # the sampling's guidance is what counts
        family.check_guidance(recipe(saved), 1.0)
    family.check_guidance(recipe(saved, guidance=1.0), 3.0)  # --guidance 3 over sample.guidance=1: fine
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        family.check_scheduler({"use_karras_sigmas": True})
    with pytest.raises(ValueError, match="--frames"):
        family.check_size(recipe(saved), 8, 32, 64)
    with pytest.raises(ValueError, match="--height"):
        family.check_size(recipe(saved), 9, 48, 64)
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    shutil.rmtree(broken / "vocoder")
    with pytest.raises(FileNotFoundError, match="vocoder"):
        family.check_pretrained(recipe(broken))


@torch.no_grad()
def test_a_lora_on_both_streams_loads_as_diffusers_loads_it(saved, one_process, tmp_path):
    """A LoRA made by PEFT on the pipeline's diffusers transformer (both streams' self- and text attention,
    audio-to-video and video-to-audio, both feed-forwards; random B, alpha 2 r), saved in diffusers'
    names with its config: infer.py --lora writes the video and the sound LTX2Pipeline gives after
    load_lora_weights (and not the plain ones)."""
    from diffusers import LTX2Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    import infer
    from tests.conftest import run_main

    targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    with torch.random.fork_rng():
        torch.manual_seed(5)
        transformer = LTX2Pipeline.from_pretrained(saved, dtype=torch.float32).transformer
        transformer.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        )
    state = {f"transformer.{k}": v.contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
    assert any("audio_attn1" in k for k in state) and any("video_to_audio_attn" in k for k in state)
    lora = tmp_path / "lora.safetensors"
    save_file(state, str(lora))  # no config: both take alpha = r (diffusers' would need its targets)
    out = tmp_path / "lora"
    assert (
        run_main(
            infer, [*infer_args(saved, out / "run"), "--output", str(out / "out.npy"), "--lora", str(lora)]
        )
        == 0
    )
    got = written(out)
    pipe = LTX2Pipeline.from_pretrained(saved, dtype=torch.float32)
    pipe.load_lora_weights(str(lora))
    video, audio = pipeline(pipe, PROMPTS[0], 3)
    dv, da = float(np.abs(got[0][0] - video).max()), float(np.abs(got[1][0] - audio).max())
    moved = (
        float(np.abs(got[0][0] - one_process[0][0]).max()),
        float(np.abs(got[1][0] - one_process[1][0]).max()),
    )
    print(f"LTX-2 LoRA: infer.py --lora vs load_lora_weights: video {dv:.2e}, sound {da:.2e}; moved {moved}")
    assert dv <= 1e-4 and da <= 1e-5 and moved[0] > 1e-3 and moved[1] > 1e-5


@torch.no_grad()
def test_image_to_video_matches_the_pipeline(saved, one_process, image_to_video):
    """infer.py --image a.png b.png (the folder's one set of weights; both prompts in one batch): each
    video and sound is what LTX2ImageToVideoPipeline gives from the same folder for its own image
    (re-compressed at the text encoder's CRF, resized to the video, its latents on the first frame, at
    sigma 0 and not stepped), and not the text-to-video one."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    images, got = image_to_video
    pipe = LTX2ImageToVideoPipeline.from_pretrained(saved, dtype=torch.float32)
    frames, height, width = SIZE
    for i, prompt in enumerate(PROMPTS):
        video, audio = pipe(
            image=Image.open(images[i]),
            prompt=prompt,
            negative_prompt=NEGATIVE,
            num_frames=frames,
            height=height,
            width=width,
            frame_rate=24.0,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(3 + i),
            output_type="np",
            max_sequence_length=MAX_LENGTH,
            return_dict=False,
        )
        dv = float(np.abs(got[0][i] - video[0]).max())
        da = float(np.abs(got[1][i] - audio[0].float().numpy()).max())
        moved = float(np.abs(got[0][i] - one_process[0][i]).max())
        print(
            f"LTX-2 image-to-video prompt {i}: video {dv:.2e}, sound {da:.2e}; from text-to-video {moved:.2e}"
        )
        assert dv <= 1e-5 and da <= 1e-5 and moved > 1e-3


def test_odd_first_frames_are_resized_before_their_re_compression(saved, tmp_path):
    """Issue 50's probe: --image of 1 x 1 gave IndexError and of 40000 x 2 a libx264 error, after the model
    had loaded (LTX2ImageToVideoPipeline fails on both, in the H.264 re-compression that runs before its
    resize). Images libx264 cannot take are resized to the video first; both sample."""
    from PIL import Image

    import infer
    from tests.conftest import run_main

    for name, size in (("dot", (1, 1)), ("strip", (20000, 2))):
        Image.new("RGB", size, (200, 30, 30)).save(tmp_path / f"{name}.png")
        out = tmp_path / f"{name}.npy"
        argv = [*infer_args(saved, tmp_path / "run"), "--steps", "2", "--output", str(out)]
        assert run_main(infer, [*argv, "--image", str(tmp_path / f"{name}.png")]) == 0, name
        assert np.isfinite(np.load(tmp_path / f"{name}_000.npy")).all()
