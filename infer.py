"""Sample videos (or images, with --frames 1) from a trained DiT.

    torchrun --nproc_per_node N infer.py --config configs/X.yaml --prompt "a red square moving left" \\
        --frames 24 --output out.mp4 [section.key=value ...]

The output format follows the extension: .mp4, .gif, .png (an image, or one file per frame) or .npy
(float32 [frames, height, width, 3] in [0, 1], unquantised). With several prompts, files are numbered
(out_000.mp4, ...). With N processes and data parallelism, the prompts are split across ranks; each
replica samples its prompts sample.batch_size at a time and writes each batch as it finishes.
"""

import parallel.lifecycle.startup  # noqa: F401  (first: before torch loads)

# isort: split

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from configs import DEFAULT_RECIPE, load_config, split_overrides
from data.loader import warn_on_main
from data.media import OUTPUT_EXTENSIONS, write_video
from models.families import family_named
from models.family import part_folder
from models.lora_formats import check_file, parse_lora_spec
from models.sampler import Sampling
from models.step_cache import step_cache
from models.tiling import plan_tiles
from parallel.compute import comm
from parallel.compute.cache import check_calibration, share_step_cache
from parallel.drive.distill import student_sampling
from parallel.drive.family_sampling import (
    Weights,
    family_batches,
    load_sampling,
    refuse_calibration,
    sampled_weights,
    sampling_layout,
)
from parallel.lifecycle.entrypoint import run_as_process
from parallel.lifecycle.rendezvous import finish_line
from parallel.lifecycle.runtime import init_runtime


def parse_args(argv):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe YAML (default: the demo)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a step_<N> folder, a `latest` pointer file, a checkpoints/ folder or a "
        "run directory (default: the recipe run's latest); none: model.pretrained as it is, e.g. the base "
        "with --lora files",
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
        help="image-to-video (model.task=i2v or flf2v): the first frame, one for every prompt or one each; "
        "Qwen-Image-Edit: its 1 to 3 reference images, in order, for every prompt",
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
    grid: list  # tokens along (t, h, w) (parallel/drive/family_sampling.py sampling_layout fills it)
    latent: tuple  # (C, t, h, w)
    cache: object = None  # models.step_cache.StepCache (sample.cache), or None
    images: list | None = None  # image-to-video: each prompt's first frame (PIL), or None
    last_images: list | None = None  # FLF2V: each prompt's last frame
    experts: tuple | None = None  # Wan 2.2 A14B: (the low-noise expert's folder, boundary, guidance_2)

    def sampling(self, batch: list, seed: int, cfg) -> Sampling:
        """models/sampler.py's Sampling of the prompts `batch` (prompt i from seed + i)."""
        size = (self.frames, self.height, self.width)
        prompts, seeds = [self.prompts[i] for i in batch], [seed + i for i in batch]
        pick = lambda given: None if given is None else [given[i] for i in batch]  # noqa: E731
        return Sampling(
            prompts,
            seeds,
            size,
            self.steps,
            self.guidance,
            self.negative_prompt,
            cfg.text_encoder.max_length,
            pick(self.images),
            pick(self.last_images),
        )


def read_request(cfg, args, family, sizes: tuple, experts) -> Request:
    """The request, with every size and image checked (a ValueError naming the flag) before anything
    starts: `sizes`, read_sizes'; `experts`, Family.sampling_experts'."""
    prompts, outputs, frames, height, width, steps, guidance, negative = sizes
    sized = args.height is not None or args.width is not None
    given, size = (args.image, args.last_image), (frames, height, width)
    images, last, height, width = family.sampling_images(cfg, given, len(prompts), size, sized, warn_on_main)
    family.check_size(cfg, frames, height, width)
    family.check_guidance(cfg, guidance)  # the scale this sampling uses, with the recipe's other terms
    flag = "sample.negative_prompt" if args.negative_prompt is None else "--negative-prompt"
    family.check_negative(negative, flag)  # a family without a negative branch would ignore it
    cache = step_cache(cfg.sample, steps)
    sizes = (frames, height, width, steps, guidance, negative)
    return Request(prompts, outputs, *sizes, [], (), cache, images, last, experts)


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


def main(argv=None, session=None, walk=None):
    """`walk(denoise_with) -> denoise_with`: what a script puts in place of the walk of the schedule
    (scripts/calibrate_cache.py records each step's velocity; bench_cache.py times the walks)."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    family = family_named(cfg.model.family)
    # Every refusal comes before any model is built or any collective is issued.
    family.check_sample_keys(cfg)  # a guidance term it does not read: refused, never ignored
    if args.no_audio and not family.capabilities.samples_audio:
        raise ValueError(f"--no-audio: {family.title} samples no sound to leave out")
    if cfg.sample.cache == "calibrated":
        refuse_calibration(family, "sample.cache=calibrated")
    student_sampling(cfg, args, warn_on_main)  # a distilled student's steps, without guidance
    sizes = read_sizes(cfg, args)
    experts = family.sampling_experts(cfg, sizes[6], args.random_weights, bool(args.lora))
    if family.loading.from_pretrained:  # its folder says the sizes and images it takes: checked first
        family.check_pretrained(cfg)
    request = read_request(cfg, args, family, sizes, experts)
    layout, patches, links = sampling_layout(cfg, family, request)
    weights = sampled_weights(cfg, args, family, experts)  # a LoRA run's base: model.pretrained from here
    loras = read_loras(cfg, args.lora)
    check_calibration(request.cache, cfg, args, weights.checkpoint, request.guidance)  # for these weights?
    check_outputs(request.outputs)  # a folder or a read-only path, named now rather than after sampling
    if family.max_length and cfg.text_encoder.max_length != family.max_length:  # not the family's recipe
        warn_on_main(
            f"text_encoder.max_length={cfg.text_encoder.max_length}: {family.title}'s pipeline encodes "
            f"{family.max_length} tokens (configs/ has its recipe)"
        )

    runtime = init_runtime(cfg.parallel, layout, cfg.run.output_dir, task="sample", session=session)
    # the ranks of a replica compare their cache settings before any weight is loaded
    share_step_cache(request.cache, runtime.sampling, request.steps, runtime.device, runtime.faults)
    if runtime.is_main:
        print(_layout_line(cfg, family, runtime, request, weights, patches, links), flush=True)
        if request.cache is not None and request.cache.method == "calibrated":  # the same on every rank
            calls = sum(step.compute for step in request.cache.plan(request.steps))
            print(f"[tessera] step cache: {calls} of {request.steps} steps call the model", flush=True)
    parts, denoise_with, decode = load_sampling(cfg, runtime, family, request, weights, loras, patches)
    del loras  # merged into the weights: the files' tensors need not outlive the sampling
    mine = list(layout.replica_share(runtime.rank, len(request.prompts)))  # split over dp
    nonfinite = None
    if mine:
        described = describe_weights(cfg, args, weights)
        denoise_with = denoise_with if walk is None else walk(denoise_with)
        sample_batch = family_batches(cfg, args, runtime, request, family, parts, denoise_with, decode)
        vae = str(part_folder(cfg, "vae")) if family.loading.from_pretrained else None
        nonfinite = sample_and_write(cfg, args, runtime, request, mine, sample_batch, described, vae)
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


def sample_and_write(cfg, args, runtime, request: Request, mine: list, sample_batch, weights: str, vae=None):
    """Sample this replica's prompts `mine` on every rank of the replica, sample.batch_size at a time
    (`sample_batch(batch, progress)`: family_batches'): the same batches in the same
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


def describe_weights(cfg, args, weights: Weights) -> str:
    """Where the sampled weights came from, for the message about a video with NaN or inf."""
    checkpoint = weights.checkpoint
    if args.random_weights:
        described = "--random-weights"
    elif checkpoint is None:
        described = f"model.pretrained={cfg.model.pretrained}"
    elif weights.record is not None:
        described = f"the LoRA checkpoint {checkpoint} on model.pretrained={cfg.model.pretrained}"
    else:
        described = f"the checkpoint {checkpoint}" + (
            " (its EMA weights: try --no-ema)" if weights.use_ema else ""
        )
    if args.lora:
        described += f" with --lora {' '.join(args.lora)} (try without them, or at lower scales)"
    return described


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


def _pipefusion_words(cfg, layout, patches: int) -> str:
    if layout.pipefusion == 1:
        return ""
    return f"; PipeFusion: {patches} patches, {cfg.parallel.pipefusion_warmup} warm-up step(s)"


def _layout_line(cfg, family, runtime, request: Request, weights: Weights, patches: int, links: str) -> str:
    layout, checkpoint, name = runtime.layout, weights.checkpoint, family.describe(cfg)
    if weights.random:
        name += ", random weights (train.seed)"
    elif checkpoint is not None:
        name += f", {checkpoint}" + (" (LoRA)" if weights.record is not None else "")
    elif cfg.model.pretrained and str(cfg.model.pretrained) not in name:
        name += f", {cfg.model.pretrained}"
    name += ", float8 base" if cfg.model.base_dtype == "float8" else ""
    chosen = f" (parallel.auto: {links})" if cfg.parallel.auto else ""
    pipeline = _pipefusion_words(cfg, layout, patches)
    tiles = ""
    if family.loading.tiled_vae:  # its replica's ranks share the decode's tiles
        vae = family.geometry(cfg)[0]
        count = len(plan_tiles(vae, request.latent[1:], cfg.vae.tile_latent, cfg.vae.tile_overlap))
        tiles = f"; VAE decode: {count} tile(s) over {runtime.sampling.replica_size} rank(s)"
    threads = f"; {runtime.threads}" if runtime.threads else ""  # a CPU run's
    return f"[tessera] {name}; layout {layout.describe()}{chosen}{pipeline}{tiles}{threads}"


if __name__ == "__main__":
    run_as_process(main)
