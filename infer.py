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
from models.flow import RectifiedFlow
from models.image_condition import image_encoder_folder, image_inputs, read_images, sampling_condition
from models.lora import deltas_of, merge_deltas
from models.lora_formats import check_file, parse_lora_spec
from models.pipeline import generate_checked
from models.sampler import Sampling, checked, generate_images
from models.step_cache import step_cache
from models.tiling import plan_tiles
from models.vae import vae_latent_space
from models.wan import second_expert
from parallel import comm
from parallel import vae as parallel_vae
from parallel.cache import check_cache_decisions, check_calibration, share_step_cache
from parallel.cfg import family_denoiser
from parallel.checkpoint import check_architecture, load_weights
from parallel.checkpoint_files import CheckpointError, check_checkpoint_files, resolve_checkpoint
from parallel.components import (
    build_frozen,
    build_model,
    check_pretrained,
    fill_unsharded,
    open_pretrained,
)
from parallel.entrypoint import run_as_process
from parallel.finite import check_adapters_finite, check_checkpoint_finite
from parallel.layout import ParallelLayout
from parallel.lora import base_of_run, checkpoint_adapters, is_tessera_run, lora_of
from parallel.operators import apply_operators, check_sequence_layout, operator_kinds
from parallel.pipefusion_family import KINDS, FamilyPipeFusion
from parallel.pipefusion_plan import held_elsewhere, keep_blocks, keep_stage
from parallel.rendezvous import finish_line
from parallel.runtime import init_runtime, links_are_slow, local_world_size, world_from_env
from parallel.sampling import ParallelSampler
from parallel.sequence import apply_sequence_parallel


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


def find_checkpoint(cfg, checkpoint: str | None, random_weights: bool):
    if random_weights:
        return None
    found = resolve_checkpoint(checkpoint or "auto", cfg.run.output_dir)
    if found is None and checkpoint in (None, "none") and cfg.model.pretrained:
        return None  # sample from the pretrained weights themselves
    if found is None:
        raise CheckpointError(
            f"no checkpoint found in {Path(cfg.run.output_dir) / 'checkpoints'}: train first "
            f"(train.py with the same recipe), pass --checkpoint, or use --random-weights"
        )
    return found


def load_sampler(
    cfg,
    runtime,
    checkpoint,
    use_ema: bool = True,
    random_weights: bool = False,
    patches: int = 1,
    loras: list = (),
    experts: tuple | None = None,
):
    """The frozen components, the DiT with the checkpoint's weights (without a checkpoint, the pretrained
    ones, model.pretrained, or with random_weights random ones from train.seed), and the sampler that
    runs it across the layout (None: models/sampler.py serial_denoise on this process). A LoRA run's
    checkpoint and the `loras` (read_loras: files matched, with their scales) are merged into the
    weights: every layout then runs the same plain DiT.
    Under PipeFusion the DiT is this rank's stage: only its blocks are ever allocated and filled."""
    text_encoder, vae = build_frozen(cfg, runtime.device)
    model = build_model(cfg, text_encoder, vae, weights=False)
    layout, groups = runtime.layout, runtime.sampling
    record = lora_of(checkpoint) if checkpoint is not None else None
    from_base = (checkpoint is None and not random_weights) or record is not None
    pretrained = open_pretrained(cfg, model) if from_base else None
    if checkpoint is not None:  # a full run's or a LoRA run's: the recipe must build its architecture
        check_architecture(checkpoint, model.architecture())
    deltas = lora_deltas(cfg, text_encoder, vae, checkpoint if record else None, record, use_ema, loras)
    if layout.pipefusion > 1:
        model = keep_stage(model, groups.stage, groups.stages)
    if checkpoint is not None and record is None:
        model.to_empty(device="cpu")
        load_weights(checkpoint, model, use_ema=use_ema)
        # NaN: refused by name (PipeFusion stages hold other blocks: their lists of tensors differ)
        check_checkpoint_finite(model, checkpoint, use_ema, runtime.control_group, layout.pipefusion == 1)
    else:  # random weights: adaLN-Zero's zeros would make the output 0 whatever the layout does
        fill_unsharded(
            model,
            cfg.train.seed,
            pretrained,
            zero_init=not random_weights,
            partial=layout.pipefusion > 1,
            group=runtime.control_group,  # PipeFusion stages hold different blocks: one verdict for all
        )
    for update in deltas:
        merge_deltas(model, update, elsewhere=held_elsewhere(model))  # a stage: its blocks' only
    if layout.pipefusion == 1:
        model = apply_sequence_parallel(model, runtime.sequence)
    model = model.to(runtime.device).eval()
    pair = None
    if experts is not None:  # Wan 2.2 A14B: the low-noise expert, built and filled as the first one
        folder, boundary, guidance_2 = experts
        low = build_model(cfg, text_encoder, vae, weights=False)
        fill_unsharded(low, cfg.train.seed, open_pretrained(cfg, low, folder, use_ema))
        # it waits on the host: the sampler keeps one expert on the device at a time (14B each)
        pair = (apply_sequence_parallel(low, runtime.sequence).eval(), boundary, guidance_2)
    sampler = None
    if layout.cfg * layout.pipefusion > 1 or pair is not None:
        sampler = ParallelSampler(
            model, groups, patches, cfg.parallel.pipefusion_warmup, runtime.faults, experts=pair
        )
    return model, vae, text_encoder, sampler


def lora_deltas(cfg, text_encoder, vae, checkpoint, record, use_ema: bool, loras) -> list[dict]:
    """The weight updates to merge: each --lora file at its scale (`loras`: read_loras' answer) and a
    LoRA run's own adapters (from `checkpoint`, whose LoRA `record` it is), matched against the whole
    architecture (a PipeFusion stage merges those of its own blocks)."""
    deltas = [update.deltas(strength) for update, strength in loras]
    if checkpoint is not None:
        whole = build_model(cfg, text_encoder, vae, weights=False)  # meta device: names and shapes only
        adapters = checkpoint_adapters(checkpoint, record, whole, use_ema)
        check_adapters_finite(adapters, checkpoint, use_ema)
        deltas.append(deltas_of(adapters))
    return deltas


def read_loras(cfg, specs) -> list:
    """Every --lora FILE[:SCALE] read and matched to the recipe's transformer (on the meta device) before
    init_runtime: a missing or damaged file, or a key that fits no layer, stops every rank alike here."""
    if not specs:
        return []
    for spec in specs:
        check_file(parse_lora_spec(spec)[0])  # all files exist before the first is read
    family = family_named(cfg.model.family)
    return [family.read_lora(cfg, spec) for spec in specs]


def lora_base(cfg, checkpoint) -> dict | None:
    """A LoRA run's checkpoint samples on its base (parallel.lora.base_of_run); returns its LoRA record
    (None: a full fine-tuning's checkpoint)."""
    record = lora_of(checkpoint)
    if record is not None:
        cfg.model.pretrained = base_of_run(checkpoint, record, cfg.model.pretrained)
    return record


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
        return Sampling(
            prompts, seeds, size, self.steps, self.guidance, self.negative_prompt, cfg.text_encoder.max_length
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


def read_experts(cfg, args, guidance: float):
    """Wan 2.2 A14B's second expert as (folder, boundary, guidance_2), or None for one model; refused by
    name where the recipe cannot pair them."""
    sc = cfg.sample
    folder, boundary = second_expert(cfg.model.pretrained, cfg.model.pretrained_2)
    if args.random_weights:
        if cfg.model.pretrained_2 or sc.guidance_2 is not None:
            raise ValueError(
                "--random-weights samples one model: drop model.pretrained_2 and sample.guidance_2"
            )
        folder = None
    if folder is None:
        if sc.guidance_2 is not None or cfg.model.pretrained_2 or sc.boundary is not None:
            raise ValueError(
                "sample.guidance_2, sample.boundary and model.pretrained_2 are for Wan 2.2's two experts: "
                "model.pretrained has no transformer_2/ (drop them, or name the low-noise expert in "
                "model.pretrained_2)"
            )
        return None
    boundary = sc.boundary if sc.boundary is not None else boundary
    if boundary is None or not 0 < boundary < 1:
        raise ValueError(
            f"two experts need the noise level where they switch: set sample.boundary (0.875 for Wan2.2 "
            f"T2V-A14B, 0.9 for I2V-A14B), got {boundary}"
        )
    if args.lora:
        raise ValueError("pairing LoRAs with Wan 2.2's two experts is not built yet: drop --lora")
    if sc.cache != "none":  # a calibration or a residual would span the switch from one expert to the other
        raise ValueError(f"sample.cache={sc.cache} does not pair with two experts yet: set sample.cache=none")
    guidance_2 = guidance if sc.guidance_2 is None else sc.guidance_2
    if guidance == 1.0:  # as diffusers: guidance_scale alone decides whether either expert is guided
        guidance_2 = 1.0
    return folder, boundary, guidance_2


def check_expert_pair(checkpoint, low_folder) -> None:
    """Wan 2.2's experts trained as two runs (model.expert=high / low): the checkpoint (run.output_dir)
    samples the high-noise steps and model.pretrained_2 (a run or a folder) the low-noise ones; a pair the
    other way round, or a LoRA run in either role, is refused by name."""
    roles = [("the checkpoint", checkpoint, "low", "high")]
    if is_tessera_run(low_folder):
        roles.append(
            ("model.pretrained_2", resolve_checkpoint(str(low_folder), Path(low_folder)), "high", "low")
        )
    for name, step, _, _ in roles:
        if step is not None and lora_of(step) is not None:
            raise ValueError(
                f"{name} ({step}) is a LoRA run: pairing LoRA runs as Wan 2.2's two experts goes through "
                "an export (scripts/export.py --checkpoint HIGH_RUN --low-noise-expert LOW_RUN --pipeline "
                "--output F), then sample model.pretrained=F --checkpoint none"
            )
    for name, step, wrong, right in roles:
        if step is not None and run_expert(step) == wrong:
            raise ValueError(
                f"{name} ({step}) trained the {wrong}-noise expert, but would sample the {right}-noise "
                "steps here: name the high-noise expert's run in run.output_dir and the low-noise one's in "
                "model.pretrained_2"
            )


def run_expert(step) -> str:
    """model.expert of the run a checkpoint step_<N> belongs to ("none" if its recipe is unreadable)."""
    from omegaconf import OmegaConf

    recipe = Path(step).parent.parent / "config.yaml"
    try:
        return OmegaConf.load(recipe).get("model", {}).get("expert", "none")
    except (OSError, ValueError):
        return "none"


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
    family.check_size(cfg, frames, height, width)
    cache = step_cache(cfg.sample, steps)
    request = Request(prompts, outputs, frames, height, width, steps, guidance, negative, [], (), cache)
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
        check_sequence_layout(parts.transformer, layout.ulysses, layout.ring, family.title)  # on every rank
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


def refuse_flags(cfg, args, family) -> None:
    """What the family's sampling does not take yet, refused by name."""
    given = {
        "--image": args.image,
        "--last-image": args.last_image,
        "--random-weights": args.random_weights,
    }
    if cfg.sample.cache == "calibrated":
        raise ValueError(
            f"sample.cache=calibrated: scripts/calibrate_cache.py calibrates tessera's DiT only; "
            f"{family.title} takes sample.cache=first_block (no calibration needed)"
        )
    wrong = [name for name, value in given.items() if value]
    if wrong:
        raise ValueError(
            f"{family.title} samples its pretrained or trained weights: {', '.join(wrong)} is not supported "
            "for it yet"
        )


def family_checkpoint(cfg, args, family) -> tuple:
    """(the run's checkpoint to sample, its LoRA record) as for tessera's DiT (--checkpoint, else the
    recipe's run.output_dir; none: model.pretrained as it is), checked with model.pretrained's parts
    (a LoRA run's base: its record's) before any process group."""
    checkpoint = find_checkpoint(cfg, args.checkpoint, False)
    record = None
    if args.no_ema and checkpoint is None:
        raise ValueError(
            f"--no-ema picks a run's raw weights, and no run is named (none in run.output_dir="
            f"{cfg.run.output_dir}): name one with --checkpoint, or drop --no-ema"
        )
    if checkpoint is not None:
        check_checkpoint_files(checkpoint)
        record = lora_base(cfg, checkpoint)
    family.check_pretrained(cfg)
    if checkpoint is not None:
        check_architecture(checkpoint, family.meta_transformer(cfg).architecture())
    return checkpoint, record


def load_run_weights(cfg, runtime, family, transformer, checkpoint, record, use_ema: bool) -> None:
    """A training run's weights into the family's transformer (under PipeFusion: this stage's blocks): a
    full fine-tuning's (its EMA weights when `use_ema`), or a LoRA run's adapters merged into its
    base. NaN or inf is refused alike on every rank."""
    if record is None:
        load_weights(checkpoint, transformer, use_ema=use_ema)
        whole = runtime.layout.pipefusion == 1  # PipeFusion stages hold different blocks: one verdict
        check_checkpoint_finite(transformer, checkpoint, use_ema, runtime.control_group, whole)
        return
    adapters = checkpoint_adapters(checkpoint, record, family.meta_transformer(cfg), use_ema)
    check_adapters_finite(adapters, checkpoint, use_ema)
    merge_deltas(transformer, deltas_of(adapters), elsewhere=held_elsewhere(transformer))


def family_layout(cfg, family, request: Request) -> tuple[ParallelLayout, int]:
    """(the sampling layout, PipeFusion's patch count), with the degrees the family's sampling cannot run
    under, an attention backend that cannot mask the split's padding, and a size too small to split
    refused by name."""
    wrong = [
        f"parallel.{name}={cfg.parallel[name]}"
        for name in ("cfg", "ulysses", "ring", "pipefusion")
        if (cfg.parallel[name] or 1) > 1 and name not in family.parallel_degrees
    ]
    if wrong or cfg.parallel.auto:  # auto would choose among layouts it may not run
        runs = ", ".join(("dp", *family.parallel_degrees))
        raise ValueError(
            f"{family.title} does not sample under {' '.join(wrong) or 'parallel.auto'} yet: it runs under "
            f"{runs}"
        )
    ranks, pipefusion = cfg.parallel.ulysses * cfg.parallel.ring, cfg.parallel.pipefusion
    if request.cache is not None and "pipefusion" not in family.parallel_degrees:  # it has no block pieces
        raise ValueError(f"sample.cache={cfg.sample.cache}: {family.title} does not run the step cache yet")
    if request.cache is not None and ranks * pipefusion > 1:  # models/step_cache.py FirstBlockFamily
        raise ValueError(
            f"sample.cache={cfg.sample.cache}: {family.title}'s step cache runs each sample's whole token "
            "sequence on one rank: use dp or parallel.cfg with it, not parallel.ulysses, ring or pipefusion"
        )
    if ranks > 1 and pipefusion > 1:
        raise ValueError(
            f"{family.title} samples under parallel.pipefusion or a sequence split (ulysses, ring), not both "
            "yet: pick one"
        )
    if (ranks > 1 or pipefusion > 1) and cfg.model.attention_backend not in ("sdpa", "math"):
        raise ValueError(
            f"model.attention_backend={cfg.model.attention_backend} takes no mask, and a sequence split "
            "and PipeFusion's patches mask keys: use sdpa or math with parallel.ulysses, ring or pipefusion"
        )
    family.check_split(cfg, request.height, request.width, cfg.parallel.ulysses, cfg.parallel.ring)
    transformer = family.meta_transformer(cfg)
    if pipefusion > 1 and operator_kinds(transformer) - KINDS:
        kinds = sorted(operator_kinds(transformer) - KINDS)
        raise ValueError(f"{family.title} has operators of kind {kinds}, which PipeFusion does not run yet")
    _, world_size, _ = world_from_env()
    layout = ParallelLayout.from_config(
        cfg.parallel,
        world_size,
        family.heads(cfg) or cfg.parallel.ulysses,  # None: no operator splits heads
        "sample",
        local_world_size(),
        depth=len(transformer.blocks),
        guided=family.guided(request.guidance),
    )
    scale = family.vae_scale(cfg) * family.patch(cfg)
    return layout, layout.check_patches(cfg.parallel, (1, request.height // scale, request.width // scale))


def family_batches(cfg, args, runtime, request: Request, family, parts, denoise_with):
    """sample_batch(batch, progress) -> (images, {index in the batch: where NaN or inf was found}) for a
    family sampled by models/sampler.py over its own parts (Qwen-Image, Sana)."""

    def sample_batch(batch: list, progress) -> tuple:
        runtime.watchdog.sampling_progress(0, request.steps)  # each step has a deadline from here on
        done = checked(
            generate_images, family, parts, request.sampling(batch, args.seed, cfg), progress, denoise_with
        )
        count_full_calls(sample_batch, request.cache, runtime.sampling, runtime.device, len(batch))
        return done

    sample_batch.full_calls = 0.0
    return sample_batch


def count_full_calls(sample_batch, cache, replica, device, samples: int) -> None:
    """After a batch: every rank of the replica took the same first_block decisions, and the calls that
    ran every block are added to `sample_batch.full_calls` (summed over the samples)."""
    check_cache_decisions(cache, replica, device)  # per batch: start() resets them
    if cache is not None and cache.method == "first_block":
        sample_batch.full_calls += cache.full_calls * samples


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
            write_batch(cfg, args, runtime, request, batch, videos, bad)
            unwritten.update(bad)
    return (
        ValueError(nonfinite_message(cfg, runtime, request, unwritten, weights, vae)) if unwritten else None
    )


def dit_batches(cfg, args, runtime, request: Request, model, vae, text_encoder, sampler):
    """sample_batch(batch, progress) for tessera's DiT (sample_and_write's): image-to-video's condition of
    the batch, the sampling (models/pipeline.py) with the VAE decode shared by the replica, and the step
    cache's decisions compared between its ranks; `.full_calls`: first_block's calls that ran every
    block, summed over the samples."""
    inputs = image_inputs(cfg, runtime.device) if request.images is not None else None
    encoder = inputs[1] if inputs is not None else None  # the CLIP encoder, if the model reads features
    flow = RectifiedFlow(cfg.flow, cfg.model.patch_size, request.cache)
    replica = runtime.sampling
    decode = parallel_vae.shared_decoder(
        vae, replica.replica_group, replica.replica_control, vae.tile_latent, vae.tile_overlap
    )

    def sample_batch(batch: list, progress) -> tuple:
        condition = None
        if request.images is not None:  # image-to-video: the frames' latents (and CLIP features) of `batch`
            condition = image_condition(cfg, request, batch, vae, encoder, runtime.device)
        runtime.watchdog.sampling_progress(0, request.steps)  # each step has a deadline from here on
        videos, bad = generate_checked(  # NaN or inf: the same verdict on every rank (the same latents)
            model,
            vae,
            text_encoder,
            flow,
            [request.prompts[i] for i in batch],
            request.frames,
            request.height,
            request.width,
            request.steps,
            request.guidance,
            request.negative_prompt,
            seeds=[args.seed + i for i in batch],
            autocast_dtype=torch.bfloat16 if runtime.bf16(cfg.train.precision) else None,
            progress=progress,
            sampler=sampler,
            decode=decode,
            device=runtime.device,  # not the model's: Wan 2.2's experts take turns on it
            condition=condition,
        )
        count_full_calls(sample_batch, request.cache, replica, runtime.device, len(batch))
        return videos, bad

    sample_batch.full_calls = 0.0
    return sample_batch


def write_batch(cfg, args, runtime, request: Request, batch: list, videos, bad: dict) -> None:
    """The replica's leader writes the batch's videos (but those in `bad`); the others wait for it."""
    replica = runtime.sampling
    if runtime.rank == runtime.layout.replica_leader(runtime.rank):  # one writer per data-parallel replica
        runtime.watchdog.mark("writing")
        for j, i in enumerate(batch):
            if i in bad:
                continue
            for path in write_video(request.outputs[i], videos[j], fps=cfg.sample.fps, scale=args.upscale):
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


def image_condition(cfg, request: Request, batch: list, vae, encoder, device):
    """models/image_condition.py's condition of the prompts `batch`, with the CLIP image `encoder` (None
    when the model reads no features)."""
    last = request.last_images
    return sampling_condition(
        cfg.model.task,
        vae,
        encoder,
        [request.images[i] for i in batch],
        None if last is None else [last[i] for i in batch],
        request.frames,
        request.height,
        request.width,
        device,
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
