"""Sample videos (or images, with --frames 1) from a trained DiT.

    torchrun --nproc_per_node N infer.py --config configs/X.yaml --prompt "a red square moving left" \\
        --frames 24 --output out.mp4 [section.key=value ...]

The output format follows the extension: .mp4, .gif, .png (an image, or one file per frame) or .npy
(float32 [frames, height, width, 3] in [0, 1], unquantised). With several prompts, files are numbered
(out_000.mp4, ...). With N processes and data parallelism, the prompts are split across ranks; each
replica samples its prompts sample.batch_size at a time and writes each batch as it finishes.
"""

import parallel.startup  # noqa: F401  (first: before torch loads)

# isort: split

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from configs import DEFAULT_RECIPE, load_config, split_overrides
from data.media import OUTPUT_EXTENSIONS, write_video
from models.dit import size_of
from models.families import family_named
from models.family import part_folder
from models.image_condition import image_encoder_folder, read_images
from models.lora import merge_deltas
from models.lora_formats import check_file, parse_lora_spec
from models.sampler import Sampling
from models.step_cache import step_cache
from models.tiling import plan_tiles
from models.util import reading_weights
from models.vae import vae_latent_space
from parallel import comm
from parallel.cache import check_calibration, share_step_cache
from parallel.cfg import family_denoiser
from parallel.checkpoint_files import find_checkpoint
from parallel.checkpoint_reading import check_checkpoint_files
from parallel.components import (
    check_pretrained,
)
from parallel.dit_sampling import check_expert_pair, dit_batches, load_sampler, read_experts
from parallel.entrypoint import run_as_process
from parallel.family_sampling import (
    family_batches,
    family_checkpoint,
    family_images,
    family_layout,
    load_run_weights,
    refuse_flags,
)
from parallel.layout import ParallelLayout
from parallel.lora import lora_base
from parallel.operators import apply_operators
from parallel.pipefusion_family import FamilyPipeFusion
from parallel.pipefusion_plan import held_elsewhere, keep_blocks
from parallel.rendezvous import finish_line
from parallel.runtime import init_runtime, links_are_slow, local_world_size, world_from_env


def parse_args(argv):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe YAML (default: the demo)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a step_<N> folder, a `latest` pointer file, a checkpoints/ folder or a "
        "run directory (default: the recipe run's latest)",
    )
    p.add_argument("--prompt", nargs="+", default=None, help="one or more prompts (default: sample.prompts)")
    p.add_argument("--negative-prompt", default=None, help="default: sample.negative_prompt")
    p.add_argument("--frames", type=int, default=None, help="default: sample.frames, else data.frames")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="default: sample.steps")
    p.add_argument(
        "--guidance", type=float, default=None, help="classifier-free guidance scale; 1 turns it off"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    p.add_argument(
        "--output", default="outputs/sample.mp4", help=f"file to write ({', '.join(OUTPUT_EXTENSIONS)})"
    )
    p.add_argument(
        "--upscale",
        type=int,
        default=1,
        help="enlarge the written frames N times, nearest neighbour, to watch tiny videos (not .npy)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="sample from an untrained model whose every layer is active (tests, benchmarks)",
    )
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA weights")
    p.add_argument(
        "--lora",
        nargs="+",
        default=[],
        metavar="FILE[:SCALE]",
        help="LoRA files to apply (diffusers/PEFT, ComfyUI/Wan-original or kohya/musubi .safetensors), "
        "each at SCALE (default 1)",
    )
    p.add_argument(
        "--image",
        nargs="+",
        default=None,
        help="image-to-video (model.task=i2v or flf2v): the first frame, one for every prompt or one each",
    )
    p.add_argument("--last-image", nargs="+", default=None, help="FLF2V (model.task=flf2v): the last frame")
    p.add_argument(
        "--no-audio",
        action="store_true",
        help="a family that samples sound (LTX-2): write the video without it (the same video: its sound is "
        "sampled beside it, but neither decoded nor written)",
    )
    parsed = p.parse_args(args)
    parsed.overrides = overrides
    return parsed


def output_paths(output: str, count: int) -> list[Path]:
    path = Path(output)
    if path.suffix.lower() not in OUTPUT_EXTENSIONS:
        raise ValueError(f"--output {output}: the extension must be one of {', '.join(OUTPUT_EXTENSIONS)}")
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i:03d}{path.suffix}") for i in range(count)]


def check_outputs(paths: list[Path]) -> None:
    """Every output can be written: a file, not a folder, in a folder that exists (or can be created)
    and takes a new file (one is created and removed). Checked on every rank before the model is built:
    found only when the writer writes, the failure would cost the whole sampling."""
    for path in paths:
        if path.is_dir():
            example = path / f"sample{path.suffix}"
            raise ValueError(f"--output {path} is a folder: name a file in it, e.g. --output {example}")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"--output {path} is read-only: make it writable, or name another file")
    for folder in sorted({path.parent for path in paths}):
        existing = folder
        while not existing.exists():  # the folders write_video would create, up to one that exists
            existing = existing.parent
        why = None if existing.is_dir() else f"{existing} is a file, not a folder"
        if why is None:
            try:
                with tempfile.NamedTemporaryFile(dir=existing, prefix=".tessera-output-check-"):
                    pass
            except OSError as e:
                why = f"no file can be created in {existing} ({e.strerror or e})"
        if why is not None:
            raise ValueError(
                f"--output {paths[0]} cannot be written: {why}. Name a file in a writable folder, or make "
                "it writable (checked before sampling: a failure after it would lose the videos)"
            )


def read_loras(cfg, specs) -> list:
    """Every --lora FILE[:SCALE] read and matched to the recipe's transformer (on the meta device) before
    init_runtime: a missing or damaged file, or a key that fits no layer, stops every rank alike here."""
    if not specs:
        return []
    for spec in specs:
        check_file(parse_lora_spec(spec)[0])  # all files exist before the first is read
    family = family_named(cfg.model.family)
    return [family.read_lora(cfg, spec) for spec in specs]


@dataclass
class Request:
    """What to sample, from the command line over the recipe (sample.*, then data.*)."""

    prompts: list
    outputs: list  # one path per prompt
    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    negative_prompt: str
    grid: list  # tokens along (t, h, w)
    latent: tuple  # (C, t, h, w)
    cache: object = None  # models.step_cache.StepCache (sample.cache), or None
    images: list | None = None  # image-to-video: each prompt's first frame (PIL), or None
    last_images: list | None = None  # FLF2V: each prompt's last frame
    experts: tuple | None = None  # Wan 2.2 A14B: (the low-noise expert's folder, boundary, guidance_2)

    def sampling(self, batch: list, seed: int, cfg) -> Sampling:
        """models/sampler.py's Sampling of the prompts `batch` (prompt i from seed + i), for the families
        (tessera's DiT takes the same values through models/pipeline.generate)."""
        size = (self.frames, self.height, self.width)
        prompts, seeds = [self.prompts[i] for i in batch], [seed + i for i in batch]
        images = None if self.images is None else [self.images[i] for i in batch]
        return Sampling(
            prompts,
            seeds,
            size,
            self.steps,
            self.guidance,
            self.negative_prompt,
            cfg.text_encoder.max_length,
            images,
        )


def read_request(cfg, args) -> Request:
    """The request, with every size checked (a ValueError naming the flag) before anything starts."""
    prompts, outputs, frames, height, width, steps, guidance, negative = read_sizes(cfg, args)
    latent = vae_latent_space(cfg.vae).latent_shape(frames, height, width, cfg.model.patch_size)
    grid = [s // p for s, p in zip(latent[1:], cfg.model.patch_size)]
    cache = step_cache(cfg.sample, steps)
    vae = vae_latent_space(cfg.vae)
    images, last_images = read_images(
        cfg.model.task,
        (args.image, args.last_image),
        ("--image", "--last-image", "--height", "--width"),
        len(prompts),
        frames,
        height,
        width,
        vae.temporal_stride,
        multiple=tuple(vae.spatial_stride * p for p in cfg.model.patch_size[1:]),
        say=_warn_on_main,
    )
    return Request(
        prompts,
        outputs,
        frames,
        height,
        width,
        steps,
        guidance,
        negative,
        grid,
        latent,
        cache,
        images,
        last_images,
        read_experts(cfg, args, guidance),
    )


def read_sizes(cfg, args) -> tuple:
    """(prompts, outputs, frames, height, width, steps, guidance, negative prompt) from the flags over the
    recipe, every size checked (a ValueError naming the flag)."""
    sc = cfg.sample
    prompts = args.prompt or list(sc.prompts)
    first = lambda *values: next(v for v in values if v is not None)  # noqa: E731  (0 is a value, not a default)
    frames = first(args.frames, sc.frames, cfg.data.frames)
    height, width = (
        first(args.height, sc.height, cfg.data.height),
        first(args.width, sc.width, cfg.data.width),
    )
    guidance, steps = first(args.guidance, sc.guidance), first(args.steps, sc.steps)
    for name, value in (
        ("--steps", steps),
        ("--frames", frames),
        ("--height", height),
        ("--width", width),
        ("--upscale", args.upscale),
        ("sample.batch_size", sc.batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    outputs = output_paths(args.output, len(prompts))
    negative = sc.negative_prompt if args.negative_prompt is None else args.negative_prompt
    return prompts, outputs, frames, height, width, steps, guidance, negative


def plan_layout(cfg, request: Request) -> tuple[ParallelLayout, int, str]:
    """(the layout, PipeFusion's patch count, the links parallel.auto saw), refused by name if invalid."""
    _, world_size, _ = world_from_env()
    size, grid = size_of(cfg.model), request.grid
    slow_links, links = links_are_slow() if cfg.parallel.auto else (False, "")
    layout = ParallelLayout.from_config(
        cfg.parallel,
        world_size,
        size["num_heads"],
        "sample",
        local_world_size(),
        # first_block needs every block on one stage: a depth of 1 keeps parallel.auto from PipeFusion
        depth=1 if cfg.sample.cache == "first_block" else size["depth"],
        guided=request.guidance != 1.0,
        slow_links=slow_links,
        tokens=grid[0] * grid[1] * grid[2],
    )
    if request.experts is not None and layout.pipefusion > 1:
        raise ValueError(
            "Wan 2.2's two experts do not run under PipeFusion yet "
            f"(parallel.pipefusion={layout.pipefusion}): use cfg, ulysses or ring"
        )
    return layout, layout.check_patches(cfg.parallel, grid), links


def main(argv=None, session=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    family = family_named(cfg.model.family)
    family.check_sample_keys(cfg)  # a guidance term it does not read: refused, never ignored
    if args.no_audio and not family.samples_audio:
        raise ValueError(f"--no-audio: {family.title} samples no sound to leave out")
    if not family.native:  # loaded by family.load (tessera's DiT: load_sampler, below); one sampling loop
        return sample_family(cfg, args, family, session)
    # Every refusal comes before any model is built or any collective is issued.
    request = read_request(cfg, args)
    layout, patches, links = plan_layout(cfg, request)
    checkpoint = find_checkpoint(cfg, args.checkpoint, args.random_weights)
    record = None
    if checkpoint is not None:
        check_checkpoint_files(checkpoint)
    if request.experts is not None:  # before lora_base: a LoRA expert's base is not the recipe's
        check_expert_pair(checkpoint, request.experts[0])
    if checkpoint is not None:
        record = lora_base(cfg, checkpoint)
    if cfg.model.pretrained and not args.random_weights and (checkpoint is None or record):
        check_pretrained(cfg.model.pretrained)
    if request.experts is not None:
        check_pretrained(request.experts[0])
    loras = read_loras(cfg, args.lora)
    check_calibration(request.cache, cfg, args, checkpoint, request.guidance)  # made for these weights?
    if request.images is not None and cfg.model.image_dim:
        image_encoder_folder(cfg)  # a missing CLIP folder is named before any process group starts
    check_outputs(request.outputs)  # a folder or a read-only path, named now rather than after sampling

    runtime = init_runtime(cfg.parallel, layout, cfg.run.output_dir, task="sample", session=session)
    # the ranks of a replica compare their cache settings before any weight is loaded
    share_step_cache(request.cache, runtime.sampling, request.steps, runtime.device, runtime.faults)
    if runtime.is_main:
        print(_layout_line(cfg, runtime, request, patches, links), flush=True)
        if request.cache is not None and request.cache.method == "calibrated":  # the same on every rank
            calls = sum(step.compute for step in request.cache.plan(request.steps))
            print(f"[tessera] step cache: {calls} of {request.steps} steps call the model", flush=True)
    use_ema = cfg.sample.use_ema and not args.no_ema
    components = load_sampler(
        cfg, runtime, checkpoint, use_ema, args.random_weights, patches, loras, request.experts
    )
    del loras  # merged into the weights: the files' tensors need not outlive the sampling
    mine = list(range(layout.dp_rank(runtime.rank), len(request.prompts), layout.dp))  # split over dp
    nonfinite = None
    if mine:
        weights = describe_weights(cfg, args, checkpoint, record, use_ema)
        sample_batch = dit_batches(cfg, args, runtime, request, *components)
        nonfinite = sample_and_write(cfg, args, runtime, request, mine, sample_batch, weights)
        say_full_calls(runtime, request, sample_batch.full_calls / len(mine))
    finish(runtime, nonfinite)


def say_full_calls(runtime, request: Request, calls: float) -> None:
    """first_block's line: how many steps ran every block, per sample."""
    if runtime.is_main and request.cache is not None and request.cache.method == "first_block":
        print(
            f"[tessera] step cache: {calls:g} of {request.steps} steps ran every block (first_block, per "
            "sample)",
            flush=True,
        )


def finish(runtime, nonfinite: Exception | None) -> None:
    """Every rank waits for every other before leaving (on the store, with no timeout: a replica without
    prompts may wait out the others' sampling): a rank that died or failed meanwhile is then named by the
    survivors, not only by torchrun's summary of exit codes; and a NaN video fails every rank alike."""
    if finish_line(runtime.watchdog, nonfinite is not None):
        raise nonfinite or ValueError(
            "a video of another data-parallel replica held NaN or inf and was not written (its ranks' error "
            "line names it and the likely cause); this replica's videos were written"
        )


def sample_family(cfg, args, family, session) -> None:
    """infer.py for a family sampled by models/sampler.py (models/families.py: Qwen-Image, Sana): the same
    flags, outputs and error lines, over model.pretrained's pipeline folder; every refusal comes before
    any process group."""
    refuse_flags(cfg, args, family)
    checkpoint, record = family_checkpoint(cfg, args, family)
    loras = read_loras(cfg, args.lora)
    prompts, outputs, frames, height, width, steps, guidance, negative = read_sizes(cfg, args)
    images, height, width, picked = family_images(cfg, args, family, len(prompts), height, width)
    if picked:
        _warn_on_main(
            f"--image: sampling {width}x{height}, the size {family.title}'s image-to-video pipeline picks "
            "for the image (sample.height and sample.width are not used with --image: give --height and "
            "--width)"
        )
    family.check_size(cfg, frames, height, width)
    family.check_guidance(cfg, guidance)  # the scale this sampling uses, with the recipe's other terms
    cache = step_cache(cfg.sample, steps)
    sizes = (frames, height, width, steps, guidance, negative)
    request = Request(prompts, outputs, *sizes, [], (), cache, images)
    layout, patches = family_layout(cfg, family, request)
    check_outputs(outputs)
    if cfg.text_encoder.max_length != family.max_length:  # a recipe without the family's own setting
        _warn_on_main(
            f"text_encoder.max_length={cfg.text_encoder.max_length}: {family.title}'s pipeline encodes "
            f"{family.max_length} tokens (configs/ has its recipe)"
        )
    runtime = init_runtime(cfg.parallel, layout, cfg.run.output_dir, task="sample", session=session)
    share_step_cache(cache, runtime.sampling, steps, runtime.device, runtime.faults)  # before any weight
    if runtime.is_main:
        run = f" with {checkpoint}" + (" (LoRA)" if record else "") if checkpoint is not None else ""
        line = f"[tessera] {family.title} from {cfg.model.pretrained}{run}; layout {layout.describe()}"
        print(line + _pipefusion_words(cfg, layout, patches), flush=True)
    groups, use_ema = runtime.sampling, cfg.sample.use_ema and not args.no_ema
    keep = (lambda model: keep_blocks(model, groups.stage, groups.stages)) if layout.pipefusion > 1 else None
    dtype = torch.bfloat16 if runtime.bf16(cfg.train.precision) else torch.float32
    with reading_weights(f"{family.title}'s parts (model.pretrained={cfg.model.pretrained})"):
        parts = family.load(cfg, runtime.device, dtype, keep=keep)  # under PipeFusion: this stage's blocks
    parts.cache = cache
    if checkpoint is not None:  # a run's weights: a full fine-tuning's, or its LoRA on its base
        load_run_weights(cfg, runtime, family, parts.transformer, checkpoint, record, use_ema)
    for update, strength in loras:  # merged: every layout then runs the plain transformer
        merge_deltas(parts.transformer, update.deltas(strength), elsewhere=held_elsewhere(parts.transformer))
    del loras
    if layout.pipefusion > 1:
        warmup = cfg.parallel.pipefusion_warmup
        denoise_with = FamilyPipeFusion(parts.transformer, groups, patches, warmup, runtime.faults).denoise
    else:
        parts.transformer = apply_operators(parts.transformer, runtime.sequence)
        denoise_with = family_denoiser(groups)
    mine = list(range(layout.dp_rank(runtime.rank), len(prompts), layout.dp))  # split over dp
    nonfinite = None
    if mine:
        weights = describe_weights(cfg, args, checkpoint, record, use_ema)
        sample_batch = family_batches(cfg, args, runtime, request, family, parts, denoise_with)
        vae = str(part_folder(cfg, "vae"))
        nonfinite = sample_and_write(cfg, args, runtime, request, mine, sample_batch, weights, vae)
        say_full_calls(runtime, request, sample_batch.full_calls / len(mine))
    finish(runtime, nonfinite)


def sample_and_write(cfg, args, runtime, request: Request, mine: list, sample_batch, weights: str, vae=None):
    """Sample this replica's prompts `mine` on every rank of the replica, sample.batch_size at a time
    (`sample_batch(batch, progress)`: dit_batches' or family_batches'): the same batches in the same
    order on every rank (they share `mine`), and a video does not depend on its batch (seed + i,
    per-sample cache decisions). The replica's leader writes each batch as it finishes. A video with NaN
    or inf is never written: every rank of the replica finds it in the same latents and the sampling goes
    on (no prompt's work is lost); returns the error naming the likely cause (`weights`: where they came
    from; `vae`: the VAE's folder, when not vae.pretrained's), or None, for main to raise once every
    replica is done."""
    size, unwritten = cfg.sample.batch_size, {}
    batches = [mine[k : k + size] for k in range(0, len(mine), size)]
    hidden = not runtime.is_main
    with tqdm(
        total=len(batches) * request.steps, desc="sample", disable=hidden, dynamic_ncols=True, unit="step"
    ) as bar:
        for k, batch in enumerate(batches):
            bar.set_description(f"sample: batch {k + 1} of {len(batches)}")
            progress = lambda done, total: (  # noqa: E731
                bar.update(1),
                runtime.watchdog.sampling_progress(done, total),
                runtime.faults.at_sampling_step(done + 1, total),
            )
            videos, bad = sample_batch(batch, progress)
            bad = {batch[j]: where for j, where in bad.items()}
            write_batch(cfg, args, runtime, request, batch, videos, bad, sample_batch.sound)
            unwritten.update(bad)
    return (
        ValueError(nonfinite_message(cfg, runtime, request, unwritten, weights, vae)) if unwritten else None
    )


def write_batch(cfg, args, runtime, request: Request, batch: list, videos, bad: dict, sound=None) -> None:
    """The replica's leader writes the batch's videos (but those in `bad`), with their sound (`sound`:
    (waveforms (B, channels, samples), rate), or None); the others wait for it."""
    replica = runtime.sampling
    if runtime.rank == runtime.layout.replica_leader(runtime.rank):  # one writer per data-parallel replica
        runtime.watchdog.mark("writing")
        for j, i in enumerate(batch):
            if i in bad:
                continue
            audio = None if sound is None else (sound[0][j], sound[1])
            written = write_video(request.outputs[i], videos[j], cfg.sample.fps, args.upscale, audio)
            for path in written:
                tqdm.write(f"[tessera] wrote {path}", file=sys.stdout)  # above the progress bar
                sys.stdout.flush()
    # The replica's other ranks wait for its writer on gloo with the control timeout, so none of them
    # leaves, fails, or sits in the next batch's short-deadline collectives while a long video is encoded.
    # Replicas are not fenced against each other: one with no prompts must not wait out another's sampling.
    if replica.replica_control is not None:
        comm.barrier(replica.replica_control)


def describe_weights(cfg, args, checkpoint, record, use_ema: bool) -> str:
    """Where the sampled weights came from, for the message about a video with NaN or inf."""
    if args.random_weights:
        weights = "--random-weights"
    elif checkpoint is None:
        weights = f"model.pretrained={cfg.model.pretrained}"
    elif record is not None:
        weights = f"the LoRA checkpoint {checkpoint} on model.pretrained={cfg.model.pretrained}"
    else:
        weights = f"the checkpoint {checkpoint}" + (" (its EMA weights: try --no-ema)" if use_ema else "")
    if args.lora:
        weights += f" with --lora {' '.join(args.lora)} (try without them, or at lower scales)"
    return weights


def nonfinite_message(cfg, runtime, request: Request, bad: dict, weights: str, vae: str | None = None) -> str:
    """The `error:` line about videos with NaN or inf ({prompt: where found}): what was not written, and
    the likely causes, most likely first (`vae`: the VAE's folder, when not vae.pretrained's)."""
    found = "; ".join(f"prompt {i} ({request.prompts[i]!r}) in {where}" for i, where in bad.items())
    paths = ", ".join(str(request.outputs[i]) for i in bad)
    causes = []
    if all(where == "the decoded video" for where in bad.values()):  # the DiT's latents were finite
        vae = vae or f"vae.pretrained={cfg.vae.pretrained or 'null: the tiny random one'}"
        causes.append(f"the VAE ({vae})")
    causes.append(f"the weights, {weights}, overflowing or diverged")
    if request.cache is not None and request.cache.method == "calibrated":
        causes.append(
            f"the step cache's calibration sample.cache_calibration={cfg.sample.cache_calibration} "
            "(try sample.cache=none)"
        )
    if runtime.bf16(cfg.train.precision):
        causes.append("a bf16 overflow (try train.precision=fp32)")
    return (
        f"sampling gave NaN or inf values ({found}): nothing was written for {paths}. Likely causes: "
        + "; ".join(causes)
    )


def _warn_on_main(line: str) -> None:
    """A warning every rank reaches alike (before any process group), printed by rank 0 alone."""
    if world_from_env()[0] == 0:
        print(f"[tessera] warning: {line}", flush=True)


def _pipefusion_words(cfg, layout, patches: int) -> str:
    if layout.pipefusion == 1:
        return ""
    return f"; PipeFusion: {patches} patches, {cfg.parallel.pipefusion_warmup} warm-up step(s)"


def _layout_line(cfg, runtime, request: Request, patches: int, links: str) -> str:
    layout = runtime.layout
    chosen = f" (parallel.auto: {links})" if cfg.parallel.auto else ""
    pipeline = _pipefusion_words(cfg, layout, patches)
    vae = vae_latent_space(cfg.vae)
    tiles = len(plan_tiles(vae, request.latent[1:], cfg.vae.tile_latent, cfg.vae.tile_overlap))
    return (
        f"[tessera] layout {layout.describe()}{chosen}{pipeline}; VAE decode: {tiles} tile(s) over "
        f"{runtime.sampling.replica_size} rank(s)"
    )


if __name__ == "__main__":
    run_as_process(main)
