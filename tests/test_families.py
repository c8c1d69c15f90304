"""infer.py on every family (models/families.py) against its diffusers pipeline, code no one here wrote:
tiny random pipeline folders saved here (nothing downloaded; Wan's read by tessera's DiT), loaded back by
diffusers' from_pretrained, and by infer.py from the same folder with model.size=auto: the same images,
videos and sound at a non-square size, with a negative prompt, guidance and per-prompt seeds; on one
process and under the layouts each family takes. And the refusals: a folder of another family, a family
tessera does not know, flags and layouts a family does not take. A family is a row of ROWS; its own file
holds what no other family has (image-to-video, sound alone, its releases' single files)."""

import copy
import importlib
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import infer
import train
from configs import ConfigError, load_config, to_yaml
from configs.auto import resolve_family
from models.families import family_keys, family_named
from models.sampler import generate_images
from tests.conftest import ROOT, ranks, run_main
from tests.test_flux2 import tiny_flux2_dev_pipeline, tiny_flux2_pipeline
from tests.test_hunyuan_video15 import PROMPTS as GLYPH_PROMPTS
from tests.test_hunyuan_video15 import tiny_pipeline as tiny_hunyuan_video15_pipeline
from tests.test_ltx2_pipeline import tiny_pipeline as tiny_ltx2_pipeline
from tests.test_qwen_image import tiny_qwen_pipeline
from tests.test_sana import MAX_LENGTH, NEGATIVE, PROMPTS, tiny_sana_pipeline
from tests.test_wan_pipeline import tiny_wan_pipeline
from tests.test_z_image import tiny_z_image_pipeline


@dataclass
class Row:
    """One family of the suite: its recipe, its tiny pipeline's builder, the pipeline's guidance keyword and
    pipeline-only keywords, the size (height, width: non-square; an image row's 5 x 3 tokens no degree
    divides), a
    scheduler setting other than the release's (a folder whose scheduler/ goes unread samples otherwise),
    the first-block cache's (guidance, threshold) and the attention of the second block that runs only
    when every block runs (None: the family refuses the cache), the config key of its depth, its single
    file in the original names, a LoRA key of another family, and whether its joint attention splits under
    one of ulysses and ring at a time; and its own refusals (infer.py's arguments, the error's words).
    A video family: its frame count and text length; the guidance through its pipeline's guider, the
    sound beside the video (LTX-2's)."""

    recipe: str
    build: Callable
    guidance: str
    keywords: dict
    size: tuple
    scheduler: dict
    first_block: tuple | None
    second_attention: str
    depth_key: str
    original: Callable
    foreign_key: str
    joint: bool
    refusals: tuple = ()
    negative: bool = True  # its pipeline takes a negative prompt (FLUX.2 klein's guides against "")
    frames: int = 1
    max_length: int = 512  # text_encoder.max_length (and the pipeline's max_sequence_length, in keywords)
    guider: bool = False  # its pipeline's guidance is its guider's (HunyuanVideo 1.5), not a keyword
    sound: bool = False  # infer.py writes the sound beside the video, as its pipeline gives it (LTX-2)
    # infer.py in bf16 against the pipeline in bf16 (None: the family keeps float32 weights under autocast,
    # another computation than the pipeline's): the image families' 0.0, the video families' kernels round
    # in another order (measured: HunyuanVideo 1.5 1.2e-2, LTX-2 3.1e-2; their transformers' bf16 against
    # diffusers': their own files)
    bf16: float | None = 1e-3
    file_args: tuple = ()  # what model.pretrained naming one transformer file also needs (test_single_file)
    lora_targets: tuple = ("to_q", "to_v", "to_out.0")  # a PEFT LoRA's target modules
    prompts: tuple = tuple(PROMPTS)  # infer.py's against the pipeline's
    # (diffusers' module, its block class, the indices of the block's outputs) where diffusers' first-block
    # hooks do not know its block
    hooked: tuple = ()


def _original_qwen(state):
    from models.qwen_image import original_state_dict_from_diffusers

    return original_state_dict_from_diffusers(state, "model.diffusion_model.")


def _original_sana(state):
    from models.sana import original_from_diffusers

    return original_from_diffusers(state)


def _original_z_image(state):
    from models.z_image.weights import original_from_diffusers

    return original_from_diffusers(state, "model.diffusion_model.")


def _original_wan(state):
    """Wan-AI's names under ComfyUI's prefix (tests/test_wan.py; diffusers' from_single_file reads them)."""
    from tests.test_wan import original_name

    return {original_name(k): v for k, v in state.items()}


def _original_ltx2(state):
    """The release's whole-model file (tests/test_ltx2.py; diffusers' converter reads its transformer)."""
    from tests.test_ltx2 import release_state

    return release_state(state)


def _original_flux2(state):
    """BFL's names under ComfyUI's prefix; diffusers' own converter reads them back (test_flux2.py)."""
    from models.flux2.weights import original_from_diffusers

    return original_from_diffusers(state, "model.diffusion_model.")


# FLUX.2's first-block thresholds: of 8 steps, middle ones reuse and run every block (klein unguided:
# its pipeline runs each branch in a cache context of its own, and tessera decides once for both; the
# reference is diffusers' rule by hand, first_block_by_hand)
KLEIN_THRESHOLD, DEV_THRESHOLD = 1.2, 0.75
REFERENCE = str(ROOT / "docs" / "step_cache_demo.png")  # any image FLUX.2's pipeline takes as a reference
ROWS = {
    "qwen_image": Row(
        "qwen-image.yaml", lambda: tiny_qwen_pipeline(num_attention_heads=2), "true_cfg_scale", {}, (40, 24),
        dict(shift_terminal=0.05), (1.0, 0.3), "attn", "num_layers", _original_qwen,
        "transformer_blocks.0.attn1.to_q", True,
    ),
    "sana": Row(  # the release's 32x DC-AE: few tokens for the pipeline's sizes (multiples of 32)
        "sana-1600m-1024px.yaml", lambda: tiny_sana_pipeline(stages=6), "guidance_scale",
        dict(max_sequence_length=MAX_LENGTH, use_resolution_binning=False), (160, 96), dict(flow_shift=4.0),
        (4.0, 0.2), "attn1", "num_layers", _original_sana, "transformer_blocks.0.attn.add_q_proj", False,
        # 5 x 3 tokens over 8 ranks: fewer than a row and one each for the convolution's halo
        ((["parallel.ring=8"], "fewer than a row and one (4)"),), max_length=MAX_LENGTH,
        hooked=("sana_transformer", "SanaTransformerBlock", (None,)),  # its output: the hidden states
    ),
    "z_image": Row(
        "z-image.yaml", tiny_z_image_pipeline, "guidance_scale", {}, (40, 24), dict(shift=2.0), None, "",
        "n_layers", _original_z_image, "transformer_blocks.0.attn.add_q_proj", True,
        ((["--guidance", "-1"], "give 0 or more"),),
    ),
    "flux2": Row(
        "flux2-klein.yaml", tiny_flux2_pipeline, "guidance_scale", {}, (40, 24),
        dict(time_shift_type="linear"), (1.0, KLEIN_THRESHOLD), "attn", "num_layers", _original_flux2,
        "transformer_blocks.0.attn1.to_q", True, negative=False,
    ),
    "flux2_dev": Row(  # the guidance scale the transformer's input: no negative prompt, no CFG batch
        "flux2-dev.yaml", tiny_flux2_dev_pipeline, "guidance_scale", {}, (40, 24),
        dict(time_shift_type="linear"), (4.0, DEV_THRESHOLD), "attn", "num_layers", _original_flux2,
        "transformer_blocks.0.attn1.to_q", True,
        ((["--guidance", "-1"], "embeds a guidance scale of 0 or more"),
         (["--negative-prompt", "blurry"], "--negative-prompt='blurry': FLUX.2 dev embeds its guidance")),
        negative=False,
    ),
    "dit": Row(  # Wan 2.1's pipeline, read by tessera's DiT; its schedule is the recipe's flow.shift (Wan's
        # releases ship UniPC, which tessera does not run): no scheduler setting to read
        "wan2.1-t2v-1.3b.yaml", tiny_wan_pipeline, "guidance_scale", dict(max_sequence_length=40), (48, 80),
        {}, (1.0, 0.8), "attn1", "num_layers", _original_wan, "transformer_blocks.0.attn1.to_q", False,
        frames=5, max_length=40, bf16=None, file_args=("model.num_heads=4",),  # a file's width, not its heads
    ),
    "hunyuan_video15": Row(
        "hunyuanvideo-1.5-480p.yaml", tiny_hunyuan_video15_pipeline, "", {}, (24, 40), dict(shift=7.0),
        (1.0, 0.4), "attn", "num_layers", None, "transformer_blocks.0.attn1.to_q", True,
        ((["--frames", "4"], "--frames"), (["--height", "26"], "height")), frames=5, max_length=1000,
        guider=True, hooked=("transformer_hunyuan_video15", "HunyuanVideo15TransformerBlock", (0, 1)),
        bf16=3e-2,
        # the joint attention's, the refiner's and the blocks' MLPs
        lora_targets=("to_q", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2", "proj_in"),
        prompts=tuple(GLYPH_PROMPTS),  # quoted glyph texts in one (ByT5's), none in the other
    ),
    "ltx2": Row(  # the recipe's other terms the pipeline's defaults (audio CFG 7, modality 3, rescale 0.7)
        "ltx-2.yaml", tiny_ltx2_pipeline, "guidance_scale", dict(frame_rate=24.0, max_sequence_length=16),
        (32, 64), dict(shift_terminal=0.2), None, "", "num_layers", _original_ltx2,
        "transformer_blocks.0.attn.add_q_proj", False, frames=9, max_length=16, sound=True, bf16=6e-2,
    ),
}  # fmt: skip
FAMILIES = list(ROWS)
# PipeFusion's patch pieces against the whole forward (the video families': tests/test_pipefusion.py, the
# DiT's; tests/test_hunyuan_video15.py)
PIECES = [name for name in ROWS if ROWS[name].first_block is not None and ROWS[name].frames == 1]
LAYOUTS = {  # (processes, overrides, families): each launch checks its degrees together
    "one-process": (1, [], tuple(ROWS)),
    # no CFG batch to split; each replica encodes its own prompt alone (texts_first) before the transformer
    "dp2-ulysses2": (4, ["parallel.dp=2", "parallel.ulysses=2"], ("flux2_dev",)),
    # Sana's operators split the tokens alike under ulysses and ring (no head split): ring covers both
    "cfg2-ulysses2": (4, ["parallel.cfg=2", "parallel.ulysses=2"], ("qwen_image", "z_image", "flux2")),
    "cfg2-ring2": (4, ["parallel.cfg=2", "parallel.ring=2"], ("qwen_image", "sana", "z_image", "flux2")),
    # warm-up over every step: exact (stale K/V is approximate by design; a patch against
    # the whole forward: test_pipefusion_patches_match_the_whole_forward)
    "pipefusion2": (
        2,
        ["parallel.pipefusion=2", "parallel.pipefusion_warmup=3"],
        ("sana", "flux2_dev", "dit"),
    ),
    # LTX-2's video tokens split, its sound whole on each rank; its guidance's passes split over two halves
    "ulysses2": (2, ["parallel.ulysses=2"], ("ltx2",)),
    "cfg2": (2, ["parallel.cfg=2"], ("ltx2",)),
    # a patch's tokens split inside each stage (Qwen-Image's text whole on both ranks): ring gathers the
    # image keys and values (ulysses, with patches: test_pipefusion_patches_across_processes)
    "pipefusion2-ring2": (
        4,
        ["parallel.pipefusion=2", "parallel.ring=2", "parallel.pipefusion_warmup=3"],
        ("qwen_image", "flux2"),
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(family, its tiny pipeline saved as a diffusers folder)."""
    return saved_folder(request.param, tmp_path_factory)


def saved_folder(name, tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp(name) / "pipeline"
    with torch.random.fork_rng():
        pipe = ROWS[name].build()
    # a scheduler setting other than the release's: a folder whose scheduler/ goes unread samples otherwise
    pipe.scheduler = type(pipe.scheduler).from_config({**pipe.scheduler.config, **ROWS[name].scheduler})
    pipe.save_pretrained(folder)
    return name, folder


def parts_of_another_width(folder, tmp_path, parts=("vae", "text_encoder")) -> list:
    """[(the overrides naming a copy of `folder` whose part is 8 wider, the words of its refusal)]: a VAE
    or text encoder of another release, named before anything loads (Family.widths)."""
    keys = dict(vae=("z_dim", "latent_channels"), text_encoder=("hidden_size", "d_model"))
    keys["text_encoder_2"] = ("d_model",)
    cases = []
    for part in parts:
        mixed = tmp_path / f"other-{part}"
        shutil.copytree(folder, mixed)
        config = mixed / part / "config.json"
        values = json.loads(config.read_text())
        inner = values.get("text_config") or values  # a vision-language encoder's text model
        key = next(k for k in keys[part] if k in inner)
        inner[key] += 8
        config.write_text(json.dumps(values))
        where = "model" if part == "text_encoder_2" else part  # no key of its own: the pipeline folder's
        cases.append(([f"{where}.pretrained={mixed}"], "parts are of different models"))
    return cases


def negative(name) -> str:
    """The negative prompt of a family's comparisons: NEGATIVE, or the empty one its pipeline uses."""
    return NEGATIVE if ROWS[name].negative else ""


def pipeline_output(
    pipe, name, prompt=PROMPTS[0], steps: int = 2, seed: int = 1, guidance=4.0, negative=True, **given
):
    """(frames (T, H, W, 3), its sound (channels, samples) or None) of the pipeline for `prompt` with its
    row's negative prompt (`negative`) and `guidance`, at its row's size; `given`: more keywords (an
    image-to-video pipeline's image: one that picks the size from it takes no height and width)."""
    import inspect

    row = ROWS[name]
    takes = inspect.signature(pipe.__call__).parameters
    size = dict(height=row.size[0], width=row.size[1], num_frames=row.frames)
    size = {k: v for k, v in size.items() if k in takes and (row.frames > 1 or k != "num_frames")}
    if row.guider:
        from diffusers.guiders import ClassifierFreeGuidance

        pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        **size,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **({} if row.guider else {row.guidance: guidance}),
        **row.keywords,
        **({"negative_prompt": NEGATIVE} if row.negative and negative else {}),
        **given,
    )
    if row.frames == 1:
        return out.images[0][None], None
    return out.frames[0], (out.audio[0].float().numpy() if row.sound else None)


def pipeline_image(pipe, name, prompt=PROMPTS[0], steps: int = 2, seed: int = 1, guidance=4.0, **given):
    """The pipeline's frames (T, H, W, 3) of `prompt` (pipeline_output)."""
    return pipeline_output(pipe, name, prompt, steps, seed, guidance, **given)[0]


def assert_written(name, folder, out, prompts=PROMPTS, steps: int = 3, seed: int = 5, guidance=4.0, **given):
    """infer.py's outputs of `prompts` from --output `out` (its .npy per prompt; the .wav beside it, for a
    family with sound) against the folder's pipeline, prompt by prompt from `seed` on: within 1e-5."""
    from diffusers import DiffusionPipeline

    from data.media import read_wav

    pipe = DiffusionPipeline.from_pretrained(folder)
    height, width = ROWS[name].size
    for i, prompt in enumerate(prompts):
        want, sound = pipeline_output(pipe, name, prompt, steps, seed + i, guidance, **given)
        got = np.load(out.with_name(f"{out.stem}_{i:03d}.npy"))
        diff = float(np.abs(got - want).max())
        print(f"{name} prompt {i}: infer.py vs {type(pipe).__name__} max abs diff {diff:.2e}")
        assert got.shape == want.shape and got.dtype == np.float32 and want.std() > 0.01, got.shape
        # an image-to-video pipeline's size is its image's: the row's here
        assert diff <= 1e-5 and got.shape == (ROWS[name].frames, height, width, 3)
        if sound is not None:
            wave, rate = read_wav(out.with_name(f"{out.stem}_{i:03d}.wav"))
            heard = float(np.abs(wave - sound).max())
            print(f"{name} prompt {i}: its sound max abs diff {heard:.2e} (std {sound.std():.3f})")
            assert wave.shape == sound.shape and sound.std() > 0.01 and heard <= 1e-5
            assert rate == pipe.vocoder.config.output_sampling_rate


def infer_args(name, folder, tmp_path, *extra):
    recipe, (height, width) = ROWS[name].recipe, ROWS[name].size
    return [
        "--config",
        str(ROOT / "configs" / recipe),
        "model.size=auto",
        f"model.pretrained={folder}",
        f"vae.pretrained={folder}",
        f"text_encoder.pretrained={folder}",
        f"text_encoder.max_length={ROWS[name].max_length}",
        f"run.output_dir={tmp_path / 'run'}",
        "--frames",
        str(ROWS[name].frames),
        "--height",
        str(height),
        "--width",
        str(width),
        *extra,
    ]


@torch.no_grad()
@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[pytest.mark.slow] * (LAYOUTS[name][0] > 1)) for name in LAYOUTS]
)
def test_infer_matches_the_pipeline(saved, tmp_path, layout):
    """Two prompts (the row's; Sana's are cut or padded), a negative prompt, 3 steps, guidance 4, seeds 5
    and 6: infer.py's .npy images or videos (and sound) are the pipeline's, prompt by prompt; on one
    process, and with the guidance branches and the tokens split over processes (tests/ranks.py)."""
    name, folder = saved
    processes, overrides, families = LAYOUTS[layout]
    if name not in families:
        pytest.skip(
            f"{name} under {layout}: the other family's launch covers what differs (one launch fewer)"
        )
    out = tmp_path / "image.npy"
    prompts = ROWS[name].prompts
    argv = infer_args(name, folder, tmp_path, "--prompt", *prompts, "--negative-prompt", negative(name))
    argv += ["--steps", "3", "--guidance", "4", "--seed", "5", "--output", str(out), *overrides]
    if processes == 1:
        assert run_main(infer, argv) == 0
    else:  # both prompts in one batch: their texts' lengths differ (Z-Image's per-sample positions split)
        # the degrees by hand (Wan's recipe has parallel.auto on)
        done = ranks(processes, "infer.py", *argv, "sample.batch_size=2", "parallel.auto=false", timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        shown = [o.split(".")[1] for o in overrides if "warmup" not in o]  # the layout line
        shown += ["2 patches, 3 warm-up step(s)"] if "parallel.pipefusion=2" in overrides else []
        assert all(words in done.stdout for words in shown), done.stdout
    assert_written(name, folder, out, prompts)


# (guidance, threshold) of the first-block cache test: diffusers decides per branch for Qwen-Image (its
# pipeline calls the branches in two cache contexts) and over both for Sana (one batch of the two), as
# tessera always does: Qwen-Image is compared unguided. The thresholds skip some middle steps and not the
# last (tessera runs the last step whole; diffusers' hooks may not)


@torch.no_grad()
@pytest.mark.parametrize(
    "layout", ["one-process", *(pytest.param(layout, marks=pytest.mark.slow) for layout in ("cfg2", "ring2"))]
)
def test_first_block_cache_matches_diffusers(saved, tmp_path, capsys, layout):
    """sample.cache=first_block against diffusers' own first-block cache hooks on the pipeline
    (diffusers.hooks.apply_first_block_cache, code no one here wrote; FLUX.2's: the same rule by hand,
    first_block_by_hand), 8 steps: the same steps run every block (fewer than 8) and the same image; under
    cfg=2 (the branches on two processes) and under ring=2 (each sample's tokens on two processes), their
    sums agreed, as on one."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    name, folder = saved
    if ROWS[name].first_block is None:
        pytest.skip(f"{name} refuses the first-block cache (test_refusals)")
    guidance, threshold = ROWS[name].first_block
    if layout == "cfg2" and name != "sana":
        pytest.skip(f"{name} is compared unguided or has no CFG batch: nothing for cfg=2 to split")
    out = tmp_path / "image.npy"
    argv = infer_args(name, folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", negative(name))
    argv += ["--steps", "8", "--guidance", str(guidance), "--seed", "5", "--output", str(out)]
    argv += ["sample.cache=first_block", f"sample.cache_first_block_threshold={threshold}"]
    argv += ["sample.cache_max_skips=8"]  # diffusers' hooks have no limit
    if layout == "one-process":
        assert run_main(infer, argv) == 0
        said = capsys.readouterr().out
    else:
        done = ranks(2, "infer.py", *argv, f"parallel.{layout[:-1]}=2", "parallel.auto=false", timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        said = done.stdout
    full = float(said.split("[tessera] step cache: ")[1].split(" of 8")[0])
    if ROWS[name].hooked:
        module, block, indices = ROWS[name].hooked
        block = getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), block)
        metadata = dict(zip(("return_hidden_states_index", "return_encoder_hidden_states_index"), indices))
        TransformerBlockRegistry.register(model_class=block, metadata=TransformerBlockMetadata(**metadata))
    pipe = DiffusionPipeline.from_pretrained(folder)
    if name.startswith("flux2"):  # diffusers' tail hook fails on its single stream: the same rule by hand
        first_block_by_hand(pipe.transformer, threshold, steps=8)
    else:
        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=threshold))
        _set_cache_context(pipe.transformer, CacheContext("sana"))  # Qwen-Image's pipeline sets its own
    blocks = getattr(pipe.transformer, "transformer_blocks", None) or pipe.transformer.blocks  # Wan's
    calls = []  # the second block's attention runs only when every block runs
    getattr(blocks[1], ROWS[name].second_attention).register_forward_hook(lambda *a: calls.append(1))
    want = pipeline_image(pipe, name, PROMPTS[0], steps=8, seed=5, guidance=guidance)
    diff = float(np.abs(np.load(out) - want).max())
    print(
        f"{name} {layout}: {full:g} of 8 steps ran every block (diffusers: {len(calls)}), max abs {diff:.2e}"
    )
    assert 1 < full < 8 and full == len(calls) and want.std() > 0.01
    assert diff <= 1e-5


def first_block_by_hand(transformer, threshold: float, steps: int) -> None:
    """diffusers' first-block cache (hooks/first_block_cache.py: its head hook's rule and residuals) on
    diffusers' FLUX.2 transformer, whose single blocks take text and image as one stream, which that
    file's tail hook cannot subtract the head's two outputs from (a TypeError in diffusers 0.42): the first
    block's image residual against the last computed step's, relative L1 above `threshold` runs every block;
    else the head adds the last tail's residuals (text, image) and the other blocks pass their input on.
    And tessera's rule (docs/step_cache.md): the last of `steps` (one call each: no CFG batch) runs all."""
    head, doubles = transformer.transformer_blocks[0], transformer.transformer_blocks[1:]
    singles = list(transformer.single_transformer_blocks)
    state = dict(residual=None, head=None, tail=None, skip=False, calls=0)

    def head_forward(forward):
        def run(*args, **kwargs):
            text, image = forward(*args, **kwargs)  # diffusers' double block: (text, image)
            residual, before = image - kwargs["hidden_states"], state["residual"]
            mean = lambda x: x.abs().mean().item()  # noqa: E731
            state["calls"] += 1
            state["skip"] = before is not None and not mean(residual - before) / mean(before) > threshold
            state["skip"] &= state["calls"] < steps
            if state["skip"]:
                return text + state["tail"][0], image + state["tail"][1]
            state["residual"], state["head"] = residual, (text, image)
            return text, image

        return run

    def passing(forward, last=False):
        def run(*args, **kwargs):
            if state["skip"]:  # double blocks: (text, image); single blocks: the joined stream
                given, text = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
                return given if text is None else (text, given)
            out = forward(*args, **kwargs)
            if last:  # the joined stream: the text's tokens first
                text, image = state["head"]
                state["tail"] = (out[:, : text.shape[1]] - text, out[:, text.shape[1] :] - image)
            return out

        return run

    head.forward = head_forward(head.forward)
    for block in doubles:
        block.forward = passing(block.forward)
    for i, block in enumerate(singles):
        block.forward = passing(block.forward, last=i == len(singles) - 1)


@pytest.mark.parametrize(
    "world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 8]
)
def test_parallel_auto_chooses_a_layout_the_family_samples_under(saved, tmp_path, monkeypatch, world):
    """parallel.auto for a family (guidance 4, one node of `world` processes): a layout of every process,
    cfg 2 first (where a family has a CFG batch), that the same degrees given by hand sample under
    (Qwen-Image's joint attention never under ulysses x ring; Sana's split never past its rows' halo); over
    PCIe, PipeFusion for FLUX.2, but not with reference images (recomputed beside every patch: PipeFusion
    stays theirs to ask for)."""
    from models.families import family_named
    from parallel.drive import family_sampling

    name, folder = saved
    monkeypatch.setattr(family_sampling, "world_from_env", lambda: (0, world, 0))
    monkeypatch.setattr(family_sampling, "local_world_size", lambda: world)
    monkeypatch.setattr(family_sampling, "links_are_slow", lambda: (False, "NVLink (a test)"))

    def layout_of(*extra):
        args = infer.parse_args(infer_args(name, folder, tmp_path, "--guidance", "4", *extra))
        cfg = load_config(args.config, args.overrides)
        family = family_named(cfg.model.family)
        request = infer.read_request(cfg, args, family, infer.read_sizes(cfg, args), None)
        return family_sampling.sampling_layout(cfg, family, request)[0]

    chosen = layout_of("parallel.auto=true")
    cfg = 2 if "cfg" in family_named(name).capabilities.parallel else 1  # FLUX.2 dev: no CFG batch to split
    assert chosen.world_size == world and chosen.cfg == cfg, chosen
    if ROWS[name].joint:
        assert not (chosen.ulysses > 1 and chosen.ring > 1), chosen
    degrees = [f"parallel.{k}={getattr(chosen, k)}" for k in ("dp", "cfg", "ulysses", "ring", "pipefusion")]
    assert layout_of("parallel.auto=false", *degrees) == chosen  # refused by hand otherwise
    can = family_named(name).capabilities
    if can.references and world == 8:  # PCIe: PipeFusion, but not with reference images
        monkeypatch.setattr(family_sampling, "links_are_slow", lambda: (True, "PCIe (a test)"))
        assert layout_of("parallel.auto=true", "--image", REFERENCE).pipefusion == 1
        assert layout_of("parallel.auto=true").pipefusion == 2
        assert layout_of("parallel.pipefusion=2", "--image", REFERENCE).pipefusion == 2  # asked for


def test_refusals(saved, tmp_path, capsys):
    """Each bad request: one error line naming it, before any process group or model."""
    name, folder = saved
    family, row = family_named(name), ROWS[name]
    cases = [
        (["--lora", "x.safetensors"], "LoRA file x.safetensors does not exist"),
        (["--checkpoint", "runs/x"], "'runs/x' is not a complete tessera checkpoint folder"),
        *row.refusals,
    ]
    if family.capabilities.masks_through_kernel:  # else it picks SDPA itself where keys are masked (the DiT)
        cases += [(["parallel.ulysses=2", "model.attention_backend=flash"], "flash takes no mask")]
    if family.capabilities.calibrated_cache:
        cases += [(["sample.cache=calibrated", "sample.cache_calibration=c.json"], "c.json cannot be read")]
    terms = [k.key for k in family_keys() if k.what == "guidance term" and name not in k.families]
    cases += [([f"{terms[0]}=0.5"], "takes no such guidance term")]  # one not its own
    if row.frames == 1:  # an image family: one frame, the DiT's keys and initialisation not its own
        cases += [(["--frames", "5"], "--frames 1"), (["--height", "33"], "multiples of")]
        cases += [(["model.image_dim=16"], "model.image_dim=16: " + family.title)]
    if row.first_block is not None:  # PipeFusion and the first-block cache through its patch pieces
        if family.capabilities.masks_through_kernel:
            cases += [(["parallel.pipefusion=2", "model.attention_backend=flash"], "patches mask keys")]
    calibrated = ["sample.cache=calibrated", "sample.cache_calibration=c.json"]
    caches = dict(first_block=["sample.cache=first_block"], calibrated_cache=calibrated)
    for lacks in family.capabilities.lacking():  # each named with the model's reason
        asked = caches.get(lacks, [f"parallel.{lacks}=2"])
        why = family.capabilities.reasons[lacks]
        cases += [(asked, f"{asked[0]}: {family.title} does not take it ({why})")]
    if row.joint:  # its joint attention splits under one of the two at a time
        cases.append((["parallel.ulysses=2", "parallel.ring=2"], "not both"))
    if row.scheduler:  # it reads the folder's scheduler: one its schedule does not run is named
        other = tmp_path / "other"
        shutil.copytree(folder, other)
        config = other / "scheduler" / "scheduler_config.json"
        values = {**json.loads(config.read_text()), "_class_name": "EulerDiscreteScheduler"}
        config.write_text(json.dumps(values))
        cases.append(([f"model.pretrained={other}"], "EulerDiscreteScheduler"))
    cases += parts_of_another_width(folder, tmp_path)
    failed = []
    for extra, expected in cases:
        code = run_main(infer, [*infer_args(name, folder, tmp_path), *extra])
        err = capsys.readouterr().err
        if not (code != 0 and expected in err and err.count("error:") == 1):
            failed.append((extra, expected, err[-300:]))
    assert not failed, "\n".join(map(str, failed))
    assert not (tmp_path / "run").exists()
    args = infer.parse_args(infer_args(name, folder, tmp_path))
    assert_capabilities(family, family.meta_transformer(load_config(args.config, args.overrides)))
    if row.frames > 1:
        return  # a video family's training refusals: its own file's (it reads clips and their sound)
    train_cases = [  # train.py's own refusals for a family
        (
            ["data.frame_counts=[5]"],
            "aspect_ratios): " + family_named(name).title,
        ),
        (["data.latents=x"], "data.latents"),
        (["model.task=i2v"], "leaves it at t2v"),
    ]
    if family_named(name).guidance_embedded:  # FLUX.2 dev
        train_cases += [
            (["sample.negative_prompt=blurry"], "sample.negative_prompt='blurry': FLUX.2 dev embeds"),
            (["train.guidance=-1"], "train.guidance=-1.0: a guidance scale is 0 or more"),
            (["train.objective=dmd", "lora.rank=4"], "guided through its transformer's input"),
        ]
    else:
        title = family_named(name).title
        train_cases.append((["train.guidance=3.5"], f"{title} takes no such guidance scale"))
    for extra, expected in train_cases:
        argv = [
            "--config",
            str(ROOT / "configs" / ROWS[name].recipe),
            *infer_args(name, folder, tmp_path)[2:8],
        ]
        assert run_main(train, [*argv, *extra]) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()


@torch.no_grad()
def test_random_weights_are_the_pipelines_with_them(saved, tmp_path):
    """infer.py --random-weights (every layer from train.seed, by name) against the pipeline whose
    transformer holds the same seeded weights: a copy of the folder with them exported in its place."""
    from parallel.build.init import materialize

    name, folder = saved
    out, prompts = tmp_path / "image.npy", ROWS[name].prompts
    argv = infer_args(name, folder, tmp_path, "--prompt", *prompts, "--negative-prompt", negative(name))
    argv += ["--steps", "3", "--guidance", "4", "--seed", "5", "--output", str(out), "train.seed=7"]
    assert run_main(infer, [*argv, "--random-weights"]) == 0
    family, args = family_named(name), infer.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    model = family.meta_transformer(cfg)
    materialize(model, "cpu", 7, zero_init=False)
    seeded = tmp_path / "seeded"
    weights = lambda where, names: [n for n in names if ".safetensors" in n and where.endswith("transformer")]  # noqa: E731
    shutil.copytree(folder, seeded, ignore=weights)
    family.export_transformer(cfg, model).save_pretrained(seeded / "transformer")
    assert_written(name, seeded, out, prompts)


def assert_capabilities(family, transformer) -> None:
    """A family's declared capabilities against its transformer: PipeFusion and the first-block cache
    where it has the patch pieces; for each sampling capability it lacks, a reason in the model's terms
    (issue 51, item 3: never "not built")."""
    can, pieces = family.capabilities, hasattr(transformer, "patch_blocks")
    assert can.first_block == pieces and ("pipefusion" in can.parallel) == pieces, (can, pieces)
    for lacks in can.lacking():
        reason = can.reasons.get(lacks, "")
        assert len(reason) > 20 and "not built" not in reason and "yet" not in reason, (lacks, reason)


def test_weights_without_a_place_are_named(saved, tmp_path, capsys):
    """A transformer config.json with one block fewer than its weights: the weights of the last block have
    no place in the model built from it, and infer.py says so (one error line) instead of sampling a
    shallower model."""
    name, folder = saved
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = other / "transformer" / "config.json"
    values = json.loads(config.read_text())
    values[ROWS[name].depth_key] -= 1
    config.write_text(json.dumps(values))
    argv = infer_args(
        name, other, tmp_path, "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "x.npy")
    )
    assert run_main(infer, argv) != 0
    err = capsys.readouterr().err
    assert "does not fit the model: weights without a place" in err and err.count("error:") == 1, err


def test_family_of_a_folder(saved, tmp_path):
    """model.size=auto takes the family from the folder; a folder of another family or of one tessera
    does not know is refused by name."""
    name, folder = saved
    reads = any(k.key == "model.patch_size" and name in k.families for k in family_keys())  # the DiT
    given = ["model.size=auto", f"model.pretrained={folder}"]
    if reads:  # the demo recipe's DiT keys contradict a Wan folder: the refusal names the way
        with pytest.raises(ConfigError, match=r"configs/demo.yaml: name a recipe of .* with --config"):
            load_config(None, given)
    recipe = ROOT / "configs" / ROWS[name].recipe if reads else None
    cfg = load_config(recipe, given)
    assert cfg.model.family == name
    # the default (demo) recipe's DiT keys are dropped (the DiT's: its folder's), not kept in the run's
    # config.yaml, which loads back
    assert cfg.model.patch_size == [1, 2, 2] and cfg.model.absolute_positions is (False if reads else None)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "config.yaml").model.family == name
    title = family_named(name).title
    refused = "model.patch_size=\\[2, 4, 4\\]" + (" contradicts" if reads else f": {title}")
    with pytest.raises(ConfigError, match=refused):
        load_config(recipe, [*given, "model.patch_size=[2,4,4]"])
    if not reads:  # a named size is the DiT's own (a tessera run's or a Wan folder's weights)
        with pytest.raises(ConfigError, match="model.size=auto"):
            load_config(None, ["model.size=DiT-S", f"model.pretrained={folder}"])
    other = next(n for n in FAMILIES if n != name)
    with pytest.raises(ConfigError, match=f"model.family={other}"):
        load_config(None, ["model.size=auto", f"model.family={other}", f"model.pretrained={folder}"])
    wan = tmp_path / "wan"  # Wan-AI's own layout: its config.json names WanModel (tessera's DiT reads it)
    wan.mkdir()
    (wan / "config.json").write_text(json.dumps({"_class_name": "WanModel", "model_type": "t2v"}))
    cfg = load_config(None)
    cfg.model.size, cfg.model.pretrained, cfg.model.family = "auto", str(wan), "auto"
    resolve_family(cfg)
    assert cfg.model.family == "dit"
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ConfigError, match="FluxPipeline, a family tessera does not know"):
        load_config(None, ["model.size=auto", f"model.pretrained={flux}"])


def peft_lora(pipe, folder, targets=("to_q", "to_v", "to_out.0"), adapter="default"):
    """A LoRA made by PEFT on the pipeline's diffusers transformer (random B, alpha 2 r: a scale that
    matters), saved as diffusers saves a pipeline's LoRA (its PEFT config in the header); where diffusers
    has no LoRA loader for the pipeline (HunyuanVideo 1.5's), the same file by hand. The adapter stays in
    `pipe` under the name `adapter`."""
    import json

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        pipe.transformer.add_adapter(config, adapter)
    state = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    if hasattr(pipe, "save_lora_weights"):
        saved = dict(transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict())
        pipe.save_lora_weights(folder, **saved)
    else:
        state = {f"transformer.{key}": value.contiguous() for key, value in state.items()}
        metadata = {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8})}
        save_file(state, str(folder / "pytorch_lora_weights.safetensors"), metadata=metadata)
    return folder / "pytorch_lora_weights.safetensors"


@torch.no_grad()
def test_peft_lora_loads(saved, tmp_path, capsys):
    """infer.py --lora FILE:0.5 with a PEFT LoRA gives the image the pipeline gives after load_lora_weights
    (HunyuanVideo 1.5's, without a loader: the same adapter on its transformer)
    at adapter weight 0.5 (and not the image without it); a LoRA of the other family is refused by name."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import save_file

    name, folder = saved
    sample = lambda pipe: pipeline_image(pipe, name)  # noqa: E731

    pipe = DiffusionPipeline.from_pretrained(folder)
    plain = sample(pipe)
    lora = peft_lora(DiffusionPipeline.from_pretrained(folder), tmp_path, ROWS[name].lora_targets)
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(lora, adapter_name="tiny")
        pipe.set_adapters("tiny", 0.5)
    else:  # no loader: the file's adapter made again on the pipeline's transformer
        (tmp_path / "again").mkdir()
        peft_lora(pipe, tmp_path / "again", ROWS[name].lora_targets, adapter="tiny")
        pipe.transformer.set_adapters("tiny", 0.5)
    want = sample(pipe)
    out = tmp_path / "lora.npy"
    argv = infer_args(name, folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", negative(name))
    argv += ["--steps", "2", "--guidance", "4", "--seed", "1", "--output", str(out), "--lora", f"{lora}:0.5"]
    assert run_main(infer, argv) == 0
    got = np.load(out)
    diff = float(np.abs(got - want).max())
    print(
        f"{name} PEFT LoRA at 0.5: infer.py --lora vs load_lora_weights max abs diff {diff:.2e}",
        file=sys.__stderr__,
    )
    assert diff <= 1e-4 and np.abs(want - plain).max() > 1e-3  # the LoRA changes the image

    # the other family's layer names: Sana's attn1 in a Qwen-Image file, Qwen-Image's add_q_proj in Sana's
    key = ROWS[name].foreign_key
    wrong = tmp_path / "other.safetensors"
    save_file(
        {
            f"transformer.{key}.lora_A.weight": torch.zeros(4, 8),
            f"transformer.{key}.lora_B.weight": torch.zeros(8, 4),
        },
        wrong,
    )
    capsys.readouterr()
    assert run_main(infer, [*infer_args(name, folder, tmp_path), "--lora", str(wrong)]) != 0
    err = capsys.readouterr().err
    assert f"no layer for transformer.{key}.lora_A.weight" in err and err.count("error:") == 1, err


def release_layouts(name, folder, lora, tmp_path) -> dict:
    """The PEFT LoRA file `lora` as trainers on the original release's code write it, each fused q/k/v
    one block-diagonal adapter: kohya's (musubi-tuner's: lora_unet_ and underscores, lora_down/up, an alpha
    twice the rank) and, for FLUX.2, ai-toolkit's (BFL's names under diffusion_model., the scale in B).
    Whether a file holds that LoRA is for diffusers' load_lora_weights to say (the test)."""
    from safetensors.torch import save_file

    from models.lora_formats import export_adapters, read_file

    family = family_named(name)
    cfg = load_config(None, ["model.size=auto", f"model.pretrained={folder}"])
    projections, _ = family.projections(family.meta_transformer(cfg))
    module = {p.diffusers: p.module for found in projections.values() for p in found}
    tensors, config = read_file(lora)
    adapters = {
        module[key.removeprefix("transformer.").removesuffix(".lora_A.weight")]: (
            A, tensors[key.replace("lora_A", "lora_B")], config["lora_alpha"] / config["r"]
        )
        for key, A in tensors.items()
        if key.endswith(".lora_A.weight")
    }  # fmt: skip
    toolkit = export_adapters(adapters, projections, "comfyui", alphas=False, release=True)
    kohya = {}
    for key, tensor in toolkit.items():
        stem, role = key.removeprefix("diffusion_model.").rsplit(".lora_", 1)
        stem = "lora_unet_" + stem.replace(".", "_")
        if role == "A.weight":
            kohya[f"{stem}.lora_down.weight"] = tensor
            kohya[f"{stem}.alpha"] = torch.tensor(2.0 * tensor.shape[0])
        else:
            kohya[f"{stem}.lora_up.weight"] = tensor / 2
    layouts = {"kohya": kohya} | ({"ai-toolkit": toolkit} if name == "flux2" else {})
    for kind, state in layouts.items():
        save_file(state, tmp_path / f"{kind}.safetensors")
    return {kind: tmp_path / f"{kind}.safetensors" for kind in layouts}


@pytest.mark.parametrize("saved", ["flux2", "z_image"], indirect=True)
@torch.no_grad()
def test_loras_in_the_release_names_load_as_diffusers_loads_them(saved, tmp_path):
    """A LoRA in the original release's names, its q, k and v one fused adapter (musubi-tuner's kohya keys;
    ai-toolkit's for FLUX.2): diffusers' load_lora_weights reads it as the PEFT LoRA it was made from, and
    infer.py --lora gives that image too."""
    from diffusers import DiffusionPipeline

    name, folder = saved
    targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")
    lora = peft_lora(DiffusionPipeline.from_pretrained(folder), tmp_path, targets)
    pipe = DiffusionPipeline.from_pretrained(folder)
    plain = pipeline_image(pipe, name)
    pipe.load_lora_weights(lora)
    want = pipeline_image(pipe, name)
    found = {}
    for kind, file in release_layouts(name, folder, lora, tmp_path).items():
        pipe = DiffusionPipeline.from_pretrained(folder)
        pipe.load_lora_weights(file)
        theirs = pipeline_image(pipe, name)
        out = tmp_path / f"{kind}.npy"
        argv = infer_args(name, folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", negative(name))
        argv += ["--steps", "2", "--guidance", "4", "--seed", "1", "--output", str(out), "--lora", str(file)]
        assert run_main(infer, argv) == 0
        found[kind] = (float(np.abs(theirs - want).max()), float(np.abs(np.load(out) - want).max()))
    print(f"{name} release-named LoRAs (diffusers, infer.py) vs the PEFT LoRA: {found}", file=sys.__stderr__)
    assert np.abs(want - plain).max() > 1e-3  # the LoRA changes the image
    assert all(theirs <= 1e-4 and ours <= 1e-4 for theirs, ours in found.values()), found


@torch.no_grad()
def test_bf16_matches_the_pipeline(saved, tmp_path):
    """train.precision=bf16: the pipeline loaded in bf16 samples the same image (Qwen-Image's latents stay
    in the model's dtype between steps, Sana's in float32; tessera's loop does the same). The image rows
    give 0.0: even a tensor's memory layout is diffusers' where a bf16 matmul's rounding depends on it
    (Sana's cross-attention residual); the video rows within their row's bound."""
    from diffusers import DiffusionPipeline

    name, folder = saved
    if ROWS[name].bf16 is None:
        pytest.skip(f"{name} keeps float32 weights under autocast: another computation than the pipeline's")
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    want = pipeline_image(pipe, name, PROMPTS[1], steps=3, seed=2)
    out = tmp_path / "bf16.npy"
    argv = infer_args(name, folder, tmp_path, "--prompt", PROMPTS[1], "--negative-prompt", negative(name))
    argv += ["--steps", "3", "--guidance", "4", "--seed", "2", "--output", str(out), "train.precision=bf16"]
    assert run_main(infer, argv) == 0
    diff = float(np.abs(np.load(out) - want).max())
    print(f"{name} bf16: infer.py vs the pipeline in bf16 max abs diff {diff:.2e}", file=sys.__stderr__)
    assert diff <= ROWS[name].bf16


@torch.no_grad()
@pytest.mark.parametrize("names", ["original", "diffusers"])
def test_single_file(saved, tmp_path, names):
    """model.pretrained naming one transformer file (the original release's names: ComfyUI's prefix for
    Qwen-Image and Wan, NVlabs' fused projections for Sana, LTX-2's whole-model file; or diffusers'), the
    other parts from a copy of the pipeline folder without the transformer's weights (the VAE from its
    VAE-only vae/ folder, the transformer's config from text_encoder.pretrained's transformer/): the image
    of the folder's weights."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import save_file

    name, folder = saved
    state = DiffusionPipeline.from_pretrained(folder).transformer.state_dict()
    if names == "original":
        if ROWS[name].original is None:  # HunyuanVideo 1.5's: tests/test_hunyuan_video15_original.py
            pytest.skip(f"{name}: no converter to the original names here")
        state = ROWS[name].original(state)
    single = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, single)
    parts = tmp_path / "parts"  # the pipeline folder less the transformer's weights
    shutil.copytree(
        folder,
        parts,
        ignore=lambda d, files: [f for f in files if f.endswith(".safetensors") and "transformer" in d],
    )
    out = tmp_path / "folder.npy"
    argv = infer_args(name, folder, tmp_path, "--prompt", PROMPTS[0], "--steps", "2", "--output", str(out))
    assert run_main(infer, argv) == 0
    parts_args = [
        f"model.pretrained={single}",
        f"vae.pretrained={parts / 'vae'}",
        f"text_encoder.pretrained={parts}",
        *ROWS[name].file_args,
    ]
    assert run_main(infer, [*argv, *parts_args, f"--output={tmp_path / 'file.npy'}"]) == 0
    want, got = np.load(out), np.load(tmp_path / "file.npy")
    # the same weights; a file's tensors sit at other byte offsets than the folder's, which can change the
    # CPU kernels' summation order: float32 rounding, not 0.0
    assert np.abs(want - got).max() <= 1e-5 and want.std() > 0.01


def test_qwen_image_config_from_a_single_files_shapes():
    """Without a config.json beside it, a Qwen-Image file's config comes from its tensors' shapes: the
    config of the diffusers model that made them (the release's 128-wide heads)."""
    from diffusers import QwenImageTransformer2DModel

    from models.qwen_image.family import QwenImage

    config = dict(num_layers=3, attention_head_dim=128, num_attention_heads=2, joint_attention_dim=24)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config, in_channels=64, out_channels=16)
    shapes = {"model.diffusion_model." + k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = QwenImage().config_of_file(shapes)
    plain = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731
    assert found.pop("_class_name") == "QwenImageTransformer2DModel"
    assert {k: plain(v) for k, v in found.items()} == {k: plain(model.config[k]) for k in found}
    narrow = {**shapes, "model.diffusion_model.transformer_blocks.0.attn.norm_q.weight": (64,)}
    with pytest.raises(ValueError, match="transformer/config.json"):  # how 64 splits over the rope's axes
        QwenImage().config_of_file(narrow)


def test_transformer_files_take_one_set_of_weights(tmp_path):
    """A transformer folder's weights: the index's shards, else the plain file, else its one variant; a
    variant beside the plain file is never mixed in, and missing shards or two variants are named."""
    from models.family import transformer_files

    def folder(name, *files, index=None):
        path = tmp_path / name
        path.mkdir()
        for file in files:
            (path / file).write_bytes(b"")
        if index:
            weight_map = {f"w{i}": shard for i, shard in enumerate(index)}
            (path / "diffusion_pytorch_model.safetensors.index.json").write_text(
                json.dumps({"weight_map": weight_map})
            )
        return path

    plain = folder("plain", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors")
    assert [f.name for f in transformer_files(plain)] == ["diffusion_pytorch_model.safetensors"]
    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    sharded = folder("sharded", *shards, "diffusion_pytorch_model.fp16.safetensors", index=shards)
    assert [f.name for f in transformer_files(sharded)] == shards
    variant = folder(
        "variant", "diffusion_pytorch_model.fp16.safetensors", index=shards
    )  # a plain index, fp16 files
    assert [f.name for f in transformer_files(variant)] == ["diffusion_pytorch_model.fp16.safetensors"]
    with pytest.raises(FileNotFoundError, match="00002-of-00002"):
        transformer_files(folder("broken", shards[0], index=shards))
    with pytest.raises(ValueError, match="several variants"):
        transformer_files(
            folder(
                "two", "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.bf16.safetensors"
            )
        )


def _tiny_transformer(name):
    """tessera's transformer of a tiny diffusers config, every weight random (no zero-initialised layer)."""
    if name == "qwen_image":
        from diffusers import QwenImageTransformer2DModel

        from models.qwen_image.weights import build_transformer
        from tests.test_qwen_image import TINY_TRANSFORMER

        model = build_transformer(dict(QwenImageTransformer2DModel(**TINY_TRANSFORMER).config))
    elif name.startswith("flux2"):
        from models.flux2.weights import build_transformer
        from tests.test_flux2 import TINY_TRANSFORMER

        config = {**TINY_TRANSFORMER, "guidance_embeds": name == "flux2_dev"}
        model = build_transformer(config)
    else:
        from models.sana.weights import build_sana
        from tests.test_sana import TINY_VARIANT

        model = build_sana(TINY_VARIANT)  # patch 2, positions, q/k norms
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _piece_inputs(name) -> tuple:
    """(its conditioning's class, taking (text, mask); its text width; a first-block threshold at which the
    samples of test_first_block_decides_per_sample decide differently at some step). FLUX.2 masks no
    text (its conditioning keeps the mask unread): its samples differ by their noise and text alone."""
    from models.flux2.transformer import Flux2Cond
    from models.qwen_image.transformer import QwenImageCond
    from models.sana.transformer import SanaConditioning

    return {"qwen_image": (QwenImageCond, 16, 2.3), "sana": (SanaConditioning, 12, 0.9),
            "flux2": (Flux2Cond, 24, 1.1), "flux2_dev": (Flux2Cond, 24, 1.1)}[name]  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("name", PIECES)
def test_first_block_decides_per_sample(name):
    """models/step_cache.py FirstBlockFamily on a batch of three guided samples whose decisions differ (the
    middle one's noise 3x the others'; texts masked to 6, 3 and 4 tokens): each sample's steps and latents
    are those it gets alone (whose rule test_first_block_cache_matches_diffusers checks); at some step the
    first and last samples run the other blocks and the middle one reuses; and each step runs the other
    blocks on as many rows as samples do not reuse."""
    from models.loop import Schedule
    from models.step_cache import FirstBlockCache, FirstBlockFamily, walk_cached

    with torch.random.fork_rng():
        torch.manual_seed(0)  # the thresholds below are for these weights
        model = _tiny_transformer(name)
    gen = torch.Generator().manual_seed(4)
    C, p = model.in_channels, model.patch_size
    scale = torch.tensor([1.0, 3.0, 1.0]).view(3, 1, 1, 1, 1)
    noise = torch.randn(3, C, 1, 5 * p, 3 * p, generator=gen) * scale
    make, dim, threshold = _piece_inputs(name)  # threshold: the middle sample's first change is below it
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]).bool()
    cond, uncond = (make(torch.randn(3, 6, dim, generator=gen), mask) for _ in range(2))
    sigmas = torch.linspace(1.0, 0.0, 9, dtype=torch.float64)
    euler = lambda x, v, i, state: (x + (sigmas[i + 1] - sigmas[i]).float() * v, None)  # noqa: E731
    schedule = Schedule(sigmas, sigmas[:-1], euler)
    ran = []  # the rows of each call of the last block
    model.blocks[-1].register_forward_hook(lambda module, args, out: ran.append(args[0].shape[0]))

    def sample(rows):
        cache = FirstBlockCache(threshold, 8)
        branches = [make(c.text[rows], c.text_mask[rows]) for c in (cond, uncond)]

        def velocity(x, t):
            v_cond, v_uncond = FirstBlockFamily(model, cache)(x, t.expand(x.shape[0]), *branches)
            return v_uncond + 4.0 * (v_cond - v_uncond)

        ran.clear()
        latents, _ = walk_cached(cache, schedule, noise[rows], velocity)
        return latents, [d for d in cache.decisions], list(ran)

    together, decisions, calls = sample(slice(0, 3))
    assert any(0 < sum(d) < len(d) for d in decisions), decisions  # at some step some reuse, some run
    if name in ("qwen_image", "sana"):  # the middle sample's masked text: it reuses first
        assert [False, True, False] in decisions, decisions  # two samples run, not the first two
    for i in range(3):
        latents, decided, _ = sample(slice(i, i + 1))
        assert [d[i] for d in decisions] == [d[0] for d in decided]
        # relative to the latents' size: guidance 4 on random weights magnifies batch-size rounding
        assert float((together[i] - latents[0]).abs().max()) <= 1e-5 * float(latents.abs().max())
    running = [len(d) - sum(d) for d in decisions if not all(d)]  # each branch once per such step
    assert calls == [n for n in running for _ in range(2)]


def _with_references(model, cond, gen):
    """`cond` with two reference images of 4 x 4 and 2 x 3 tokens, their tokens after the noisy ones in the
    transformer's forward (Qwen-Image-Edit's, FLUX.2's)."""
    grids = [(1, 4, 4), (1, 2, 3)]
    cond.reference_grids = torch.tensor([grids] * len(cond.text))
    channels = model.in_channels * model.patch_size**2
    cond.references = torch.randn(len(cond.text), 16 + 6, channels, generator=gen)
    return cond


@torch.no_grad()
@pytest.mark.parametrize(
    "name, references", [(name, False) for name in PIECES] + [("qwen_image", True), ("flux2", True)]
)
def test_pipefusion_patches_match_the_whole_forward(name, references):
    """PipeFusion's operators (parallel/compute/pipefusion_operators.py) on one process: after a whole pass,
    each patch of 2 (rows 0-1, 2-4 of a 5 x 3 grid) run through every block gives the whole forward's tokens
    and companion (Qwen-Image's text; with reference images (Qwen-Image-Edit 2511's, FLUX.2's) the text and
    their tokens, which pass beside each patch), and the final layer of the whole pass its velocity. Then
    the same with the held tensors from another input (stale): the patches differ, as they should."""
    from parallel.compute.pipefusion_operators import PatchState, install
    from parallel.compute.pipefusion_plan import keep_blocks, patch_ranges

    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same weights whatever ran before: 1e-6 is float32 rounding on these
        reference = _tiny_transformer(name)
    if references and name == "qwen_image":  # 2511's: the references' tokens modulated at t = 0
        reference.zero_cond_t = True
    model = keep_blocks(copy.deepcopy(reference), 0, 1)
    gen = torch.Generator().manual_seed(3)
    C, p = reference.in_channels, reference.patch_size
    x, other = (torch.randn(2, C, 1, 5 * p, 3 * p, generator=gen) for _ in range(2))
    make, text_dim, _ = _piece_inputs(name)
    text, mask = (
        torch.randn(2, 6, text_dim, generator=gen),
        torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]).bool(),
    )
    cond = make(text, mask)
    if references:
        cond = _with_references(reference, cond, gen)
    t = torch.tensor([0.7, 0.7], dtype=torch.float64)
    state = PatchState(15)  # its operators only: no process group
    install(model, state)
    tokens, grid = model.embed(x)
    state.grid, blocks = grid, model.stage_range
    ctx = model.patch_context(t, cond, grid)

    def run(latent, start, end):
        state.start, state.end = start, end
        h = model.embed(latent)[0][:, start:end]
        return model.patch_blocks(blocks, h, model.companion(ctx), ctx, grid, start, end)

    def differ(a, b):  # relative to the values' scale (rounding differs with the matrices' sizes)
        return float((a - b).abs().max() / b.abs().max())

    whole, whole_text = run(x, 0, 15)
    velocity = model.unpatchify(model.final_layer(whole, ctx.temb), grid)
    assert differ(velocity, reference(x, t, cond)) <= 1e-6
    for a, b in patch_ranges(grid, 2):
        part, part_text = run(x, a, b)
        assert differ(part, whole[:, a:b]) <= 1e-6
        if part_text is not None:
            assert differ(part_text, whole_text) <= 1e-6
    run(other, 0, 15)  # the held tensors now another input's
    part, _ = run(x, 0, 6)
    assert differ(part, whole[:, :6]) > 1e-3


@pytest.mark.slow
def test_calibrated_cache_under_pipefusion_equals_one_process(saved, tmp_path):
    """sample.cache=calibrated under PipeFusion (2 stages, one warm-up step, then patches): the skipped steps
    run on no stage, the last stage applies them to each patch, Sana's multistep solver carrying its state
    through them: the images of the same schedule and table run item by item on one process; the table
    calibrated by scripts/calibrate_cache.py, which the cache moves the images by."""
    from models.families import family_named
    from models.sampler import Sampling, generate_images
    from models.step_cache import step_cache

    name, folder = saved
    if name != "sana":
        pytest.skip("Sana's solver keeps a state across the skipped steps: the case that can differ")
    sys.path.insert(0, str(ROOT / "scripts"))
    import calibrate_cache

    argv = infer_args(name, folder, tmp_path, "--prompt", *PROMPTS, "--negative-prompt", negative(name))
    argv += ["--steps", "5", "--guidance", "4", "--seed", "5"]
    table = tmp_path / "five.json"
    height, width = ROWS[name].size
    sizes = [f"sample.height={height}", f"sample.width={width}", "sample.frames=1", "sample.guidance=4"]
    calibrate = [*argv[:8], *sizes, f"sample.negative_prompt='{negative(name)}'", "--prompts", PROMPTS[0]]
    calibrate += ["--steps", "5", "--seeds", "1", "--output", str(table)]
    assert run_main(calibrate_cache, calibrate) == 0
    # every other step skipped: steps 1 and 3 reuse the velocity before them
    cached = ["sample.cache=calibrated", f"sample.cache_calibration={table}", "sample.cache_threshold=100",
              "sample.cache_max_skips=1"]  # fmt: skip
    piped = tmp_path / "piped.npy"
    pipefusion = ["parallel.pipefusion=2", "parallel.pipefusion_warmup=1"]
    done = ranks(2, "infer.py", *argv, *cached, *pipefusion, "--output", str(piped), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    family, cfg = family_named(name), load_config(argv[1], [*argv[2:8], *cached])
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    cache = step_cache(cfg.sample, 5)
    assert [s.compute for s in cache.plan(5)] == [True, False, True, False, True]
    length = cfg.text_encoder.max_length  # as infer.py encodes
    for i, prompt in enumerate(PROMPTS):
        sampling = Sampling([prompt], [5 + i], (1, height, width), 5, 4.0, NEGATIVE, length)
        want = generate_images(family, parts, sampling, denoise_with=sequential_pipefusion(2, 1, cache))[0]
        uncached = generate_images(family, parts, sampling, denoise_with=sequential_pipefusion(2, 1))[0]
        got = np.load(tmp_path / f"piped_{i:03d}.npy")
        diff, skipped = float(np.abs(got - want).max()), float(np.abs(want - uncached).max())
        print(f"{name} prompt {i}: cached PipeFusion vs item by item {diff:.2e} (the cache moved the image "
              f"{skipped:.2e})", file=sys.__stderr__)  # fmt: skip
        assert diff <= 1e-5 and skipped > 1e-3


def sequential_pipefusion(patches: int, warmup: int, cache=None):
    """models/sampler.py's denoise_with running PipeFusion's schedule on one process, item by item: the
    whole latent for `warmup` steps, then `patches` patches of token rows in order (every frame's rows
    one under the other, as PipeFusion's strips), each through every block (PipeFusion's operators: this
    step's values for the patches done, the last step's for the others), both guidance branches, the
    solver's step on the patch's rows. What a layer sees depends on the order of the items alone, not on
    the number of stages: the reference for PipeFusion's processes. The transformer's pieces are the
    family's (Steps.patch_pieces: an image condition's embedding). `cache`: sample.cache=calibrated's,
    whose skipped steps reuse the patch's velocity, scaled."""
    from dataclasses import replace

    from parallel.compute.pipefusion import from_strips, to_strips
    from parallel.compute.pipefusion_operators import PatchState, install
    from parallel.compute.pipefusion_plan import keep_blocks, patch_ranges

    def denoise_with(family, parts, schedule, noise, cond, uncond, scale, progress):
        model = keep_blocks(copy.deepcopy(parts.transformer), 0, 1)
        pieces = family.steps.patch_pieces(replace(parts, transformer=model), cond)
        grid = pieces.embed(noise)[1]
        (frames, h, w) = grid
        state = PatchState(frames * h * w)  # PipeFusion's operators only
        state.grid = grid
        install(model, state)
        x, solver = to_strips(noise, frames), None
        r = x.shape[3] // (frames * h)  # latent rows per token row
        branches = [cond] if uncond is None else [cond, uncond]
        steps = len(schedule.timesteps)
        plan = [(True, 1.0)] * steps if cache is None else [(s.compute, s.scale) for s in cache.plan(steps)]
        computed = [i for i in range(steps) if plan[i][0]]
        for index, step in enumerate(computed):
            following = computed[index + 1] if index + 1 < len(computed) else steps
            walked = [(step, 1.0)] + [(j, plan[j][1]) for j in range(step + 1, following)]
            t = schedule.timesteps[step].expand(noise.shape[0])
            contexts = [pieces.patch_context(t, c, grid) for c in branches]
            for a, b in [(0, frames * h * w)] if index < warmup else patch_ranges(grid, patches):
                state.start, state.end = a, b
                v = []
                for state.branch, ctx in enumerate(contexts):
                    tokens = pieces.embed(from_strips(x, frames))[0][:, a:b]
                    tokens, _ = pieces.patch_blocks(
                        model.stage_range, tokens, pieces.companion(ctx), ctx, grid, a, b
                    )
                    out = pieces.unpatchify(pieces.patch_final(tokens, ctx, a, b), (1, (b - a) // w, w))
                    v.append(family.steps.prediction(out))
                v = v[0] if len(v) == 1 else family.guidance.guide(v[0], v[1], scale, parts)
                rows = slice(a // w * r, b // w * r)
                new = x[:, :, :, rows]
                kept = None if step == 0 or solver is None else solver[:, :, :, rows]
                for j, scale_j in walked:
                    new, kept = schedule.step(new, v * scale_j, j, kept)
                if kept is not None:
                    solver = torch.zeros_like(x) if solver is None else solver
                    solver[:, :, :, rows] = kept
                x[:, :, :, rows] = new
        return from_strips(x, frames)

    return denoise_with


def stale_patches(family, parts, sampling, got) -> tuple:
    """(max abs of `got`, PipeFusion's output of `sampling`, from the same schedule run item by item on one
    process: 2 patches after one warm-up step; max abs of that from whole steps: the patches ran)."""
    want = generate_images(family, parts, sampling, denoise_with=sequential_pipefusion(2, 1))[0]
    whole = generate_images(family, parts, sampling)[0]
    return float(np.abs(got - want).max()), float(np.abs(want - whole).max())


def cached_and_uncached(argv, cached, tmp_path, capsys) -> tuple:
    """infer.py's outputs of `argv` (4 steps) with the calibrated table `cached` names, which calls the model
    on 2 of the 4, and without it (c.npy, u.npy in tmp_path)."""
    capsys.readouterr()
    assert run_main(infer, [*argv, *cached, "--output", str(tmp_path / "c.npy")]) == 0
    assert "[tessera] step cache: 2 of 4 steps call the model" in capsys.readouterr().out
    assert run_main(infer, [*argv, "--output", str(tmp_path / "u.npy")]) == 0
    return np.load(tmp_path / "c.npy"), np.load(tmp_path / "u.npy")


@pytest.mark.slow
@torch.no_grad()
def test_pipefusion_patches_across_processes(saved, tmp_path):
    """PipeFusion 2 x a split of 2 inside each stage (4 processes) with one warm-up step, so that the later
    steps run as patches (rows 0-1, 2-4): stage 0 takes each patch back from the last stage, each patch's
    tokens are split over two ranks (padded: 6 and 9 tokens), both guidance branches pass in turn. Sana under
    ring: its solver keeps its state per patch, its linear attention's keys and its convolution's rows are
    gathered from the split. Qwen-Image under ulysses: its text passes with each patch, its image heads are
    exchanged (unwritten and stale keys, each patch's rotary rows). The images are those of the same
    schedule run item by item on one process."""
    from models.sampler import Sampling

    name, folder = saved
    # FLUX.2 klein: its single blocks' text beside each patch, its image heads exchanged under ulysses
    layouts = {"sana": "parallel.ring=2", "qwen_image": "parallel.cfg=2", "flux2": "parallel.ulysses=2"}
    if name not in layouts:
        pytest.skip("the other families' launches cover the operator kinds PipeFusion runs")
    out = tmp_path / "image.npy"
    argv = infer_args(name, folder, tmp_path, "--prompt", *PROMPTS, "--negative-prompt", negative(name))
    argv += ["--steps", "3", "--guidance", "4", "--seed", "5", "--output", str(out)]
    argv += [layouts[name], "parallel.pipefusion=2", "parallel.pipefusion_warmup=1"]
    done = ranks(4, "infer.py", *argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PipeFusion: 2 patches, 1 warm-up step(s)" in done.stdout, done.stdout
    family = family_named(name)
    cfg = load_config(argv[1], argv[2:8])
    parts = family.load(cfg, torch.device("cpu"), torch.float32)
    height, width = ROWS[name].size
    length = cfg.text_encoder.max_length  # as infer.py encodes
    for i, prompt in enumerate(PROMPTS):
        sampling = Sampling([prompt], [5 + i], (1, height, width), 3, 4.0, negative(name), length)
        diff, stale = stale_patches(family, parts, sampling, np.load(tmp_path / f"image_{i:03d}.npy"))
        print(f"{name} prompt {i}: PipeFusion's patches vs one process item by item {diff:.2e} (vs the whole "
              f"steps {stale:.2e})", file=sys.__stderr__)  # fmt: skip
        assert diff <= 1e-5 and stale > 2e-5  # the patches ran: whole steps are 2x the bound off
