"""infer.py's model families of models/family.py (Qwen-Image, Sana): what a family's sampling refuses,
the run it samples, that run's weights into its transformer, its layout, and each batch sampled by
models/sampler.py.
"""

from models.lora import deltas_of, merge_deltas
from models.sampler import checked, generate_images
from parallel.cache import count_full_calls
from parallel.checkpoint import load_weights
from parallel.checkpoint_files import find_checkpoint
from parallel.checkpoint_reading import check_checkpoint_files
from parallel.checkpoint_records import check_architecture
from parallel.finite import check_adapters_finite, check_checkpoint_finite
from parallel.layout import ParallelLayout
from parallel.lora import checkpoint_adapters, lora_base
from parallel.operators import check_sequence_layout, operator_kinds
from parallel.pipefusion_family import KINDS
from parallel.pipefusion_plan import held_elsewhere
from parallel.runtime import local_world_size, world_from_env


def refuse_flags(cfg, args, family) -> None:
    """What the family's sampling does not take yet, refused by name; an image-to-video folder without
    --image, or --image without one."""
    given = {"--last-image": args.last_image, "--random-weights": args.random_weights}
    if family.needs_images(cfg) and not args.image:
        raise ValueError(
            f"model.pretrained={cfg.model.pretrained} is {family.title}'s image-to-video pipeline: give the "
            "first frame with --image (a PNG or JPEG file)"
        )
    if args.image and family.image_to_video and not family.takes_images(cfg):
        raise ValueError(
            f"--image: model.pretrained={cfg.model.pretrained} is {family.title}'s text-to-video pipeline; "
            "image-to-video samples its image-to-video pipeline's folder"
        )
    if not family.takes_images(cfg):
        given["--image"] = args.image
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


def first_frames(paths: list, count: int, name: str) -> list:
    """Each of `count` prompts' first frame (PIL, read as training data is: models/image_condition.py
    load_image) from `paths`, one for every prompt or one each; another count or an unreadable file is a
    ValueError naming `name` (--image, sample.images)."""
    from models.image_condition import load_image

    if len(paths) not in (1, count):
        raise ValueError(f"{name}: give one image for every prompt or one for each of the {count}")
    try:
        images = [load_image(path) for path in paths]
    except FileNotFoundError as e:
        raise ValueError(f"{name}: {e}") from None
    return images * (count if len(paths) == 1 else 1)


def family_images(cfg, args, family, count: int, height: int, width: int) -> tuple:
    """(each prompt's first frame (PIL) or None for text-to-video, height, width, whether the size is the
    one its pipeline picks for the images): --image, one for every prompt or one each; without --height and
    --width, a family whose pipeline sizes the video from the image (image_size) takes that size (all the
    images must pick the same one)."""
    if not args.image:
        return None, height, width, False
    images = first_frames(args.image, count, "--image")
    if args.height is not None or args.width is not None or family.image_size(cfg, images[0]) is None:
        return images, height, width, False
    sizes = {family.image_size(cfg, image) for image in images}
    if len(sizes) > 1:
        raise ValueError(
            f"--image: the images' shapes pick different video sizes ({sorted(sizes)}): give --height "
            "and --width (each image is cropped to them), or images of one shape"
        )
    return images, *sizes.pop(), True


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


def family_layout(cfg, family, request) -> tuple[ParallelLayout, int]:
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
    check_sequence_layout(transformer, cfg.parallel.ulysses, cfg.parallel.ring, family.title)  # its operators
    if request.cache is not None and not hasattr(transformer, "patch_blocks"):  # FirstBlockFamily's pieces
        raise ValueError(f"sample.cache={cfg.sample.cache}: {family.title} does not run the step cache yet")
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


def family_batches(cfg, args, runtime, request, family, parts, denoise_with):
    """sample_batch(batch, progress) -> (images, {index in the batch: where NaN or inf was found}) for a
    family sampled by models/sampler.py over its own parts (Qwen-Image, Sana); sample_batch.sound: the last
    batch's (waveforms (B, channels, samples), rate) of a family that samples sound (LTX-2), else None."""

    def sample_batch(batch: list, progress) -> tuple:
        runtime.watchdog.sampling_progress(0, request.steps)  # each step has a deadline from here on
        sound = None if args.no_audio else []  # a family that samples sound: the batch's (waveforms, rate)
        sampling = request.sampling(batch, args.seed, cfg)
        done = checked(generate_images, family, parts, sampling, progress, denoise_with, sound=sound)
        count_full_calls(sample_batch, request.cache, runtime.sampling, runtime.device, len(batch))
        sample_batch.sound = sound[0] if sound else None
        return done

    sample_batch.full_calls, sample_batch.sound = 0.0, None
    return sample_batch
