"""infer.py's sampling of any family of models/family.py (tessera's DiT included): what its sampling
refuses, the run it samples and the checks of its weights, its layout, its transformer loaded with those
weights for this rank (under PipeFusion: its stage's blocks), its parts and how the schedule is walked
across the layout, and each batch sampled by models/sampler.py.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from models.attention import MASKING_BACKENDS
from models.capabilities import DEGREES
from models.float8 import quantize_blocks
from models.lora import factors_of, merge_deltas
from models.sampler import checked, generate_images
from parallel.build.components import check_pretrained, check_weights_source, fill_unsharded, open_pretrained
from parallel.build.lora import checkpoint_adapters, is_tessera_run, lora_base, lora_of
from parallel.checkpoints.checkpoint import load_weights
from parallel.checkpoints.checkpoint_files import find_checkpoint, resolve_checkpoint
from parallel.checkpoints.checkpoint_reading import check_checkpoint_files
from parallel.checkpoints.checkpoint_records import check_architecture
from parallel.compute import vae as parallel_vae
from parallel.compute.cache import count_full_calls
from parallel.compute.cfg import family_denoiser
from parallel.compute.layout import ParallelLayout
from parallel.compute.operators import apply_operators, check_sequence_layout, operator_kinds
from parallel.compute.pipefusion import PipeFusion
from parallel.compute.pipefusion_operators import KINDS
from parallel.compute.pipefusion_plan import held_elsewhere, keep_blocks
from parallel.lifecycle.finite import check_adapters_finite, check_checkpoint_finite
from parallel.lifecycle.runtime import links_are_slow, local_world_size, world_from_env


@dataclass
class Weights:
    """Where a sampling's transformer weights come from."""

    checkpoint: object  # a run's step_<N> (a full fine-tuning's or a LoRA's), or None
    record: dict | None  # its LoRA record; None: a full fine-tuning's, or no run
    use_ema: bool
    random: bool = False  # --random-weights: every layer from train.seed, none zero


def refuse_calibration(family, what: str, instead: str = "sample.cache=none") -> None:
    """`what` (sample.cache=calibrated, or a script that calibrates it) refused for a family whose sampling
    replays no calibration (its capabilities' calibrated_cache), naming `instead`."""
    if not family.capabilities.calibrated_cache:
        raise ValueError(family.capabilities.refusal("calibrated_cache", what, family.title, instead))


def sampled_weights(cfg, args, family, experts) -> Weights:
    """The run whose weights to sample (--checkpoint, else the recipe's run.output_dir; none: model.pretrained
    as it is; --random-weights: none), checked with the files this sampling reads (model.pretrained's, a
    LoRA run's base, Wan 2.2's second expert's) before any process group."""
    checkpoint = find_checkpoint(cfg, args.checkpoint, args.random_weights)
    record = None
    if args.no_ema and checkpoint is None and family.loading.from_pretrained:  # its folder has no raw weights
        raise ValueError(
            f"--no-ema picks a run's raw weights, and no run is named (none in run.output_dir="
            f"{cfg.run.output_dir}): name one with --checkpoint, or drop --no-ema"
        )
    if checkpoint is not None:
        check_checkpoint_files(checkpoint)
    if experts is not None:  # before lora_base: a LoRA expert's base is not the recipe's
        check_expert_pair(checkpoint, experts[0])
    if checkpoint is not None:
        record = lora_base(cfg, checkpoint)  # a LoRA run samples on its base: model.pretrained
    check_weights_source(cfg, family, not args.random_weights and (checkpoint is None or record is not None))
    if experts is not None:
        check_pretrained(experts[0])
    if checkpoint is not None:
        check_architecture(checkpoint, family.meta_transformer(cfg).architecture())
    return Weights(checkpoint, record, cfg.sample.use_ema and not args.no_ema, args.random_weights)


def sampling_layout(cfg, family, request) -> tuple[ParallelLayout, int, str]:
    """(the sampling layout, PipeFusion's patch count, the links parallel.auto saw), with what the family's
    sampling cannot run under refused by name (parallel.auto: chosen among the layouts it runs under);
    request.latent and request.grid filled in."""
    meta = functools.cache(lambda: family.meta_transformer(cfg))  # built once a check needs it
    check_family_layout(cfg, family, request, cfg.parallel, meta)  # the recipe's (all 1 under auto)
    transformer = meta()
    space, patch = family.geometry(cfg)
    request.latent = space.latent_shape(request.frames, request.height, request.width, patch)
    request.grid = [s // p for s, p in zip(request.latent[1:], patch)]
    _, world_size, _ = world_from_env()
    slow_links, links = links_are_slow() if cfg.parallel.auto else (False, "")
    grid = request.grid

    # reference images pass whole beside every patch, recomputed by each: PipeFusion's gain shrinks with
    # them (about 1.3x at 2 stages for one reference as large as the output), which the latency model
    # does not count, so auto leaves it to be asked for
    references = bool(family.capabilities.references and request.images)

    def takes(layout) -> bool:
        try:
            check_family_layout(cfg, family, request, layout, meta)
            layout.check_patches(cfg.parallel, grid)
        except ValueError:
            return False
        return (request.experts is None and not references) or layout.pipefusion == 1

    layout = ParallelLayout.from_config(
        cfg.parallel,
        world_size,
        family.heads(cfg) or cfg.parallel.ulysses,  # None: no operator splits heads
        "sample",
        local_world_size(),
        # first_block needs every block on one stage: a depth of 1 keeps parallel.auto from PipeFusion
        depth=1 if cfg.sample.cache == "first_block" else len(transformer.blocks),
        guided=family.guidance.guided(request.guidance),
        slow_links=slow_links,
        tokens=grid[0] * grid[1] * grid[2],
        takes=takes,
    )
    if request.experts is not None and layout.pipefusion > 1:
        raise ValueError(
            "Wan 2.2's two experts do not run under PipeFusion yet "
            f"(parallel.pipefusion={layout.pipefusion}): use cfg, ulysses or ring"
        )
    return layout, layout.check_patches(cfg.parallel, grid), links


def check_family_layout(cfg, family, request, degrees, meta) -> None:
    """What the family's sampling refuses of the degrees `degrees` (the recipe's parallel section, or a
    layout parallel.auto weighs), by name: a degree it does not take, its patch pipeline's and its split's
    limits, its operators' (`meta()`: its transformer on the meta device)."""
    can = family.capabilities
    wrong = [n for n in DEGREES if (getattr(degrees, n) or 1) > 1 and n not in can.parallel]
    if wrong:
        asked = " ".join(f"parallel.{n}={getattr(degrees, n)}" for n in wrong)
        runs = ", ".join(("dp", *can.parallel))
        raise ValueError(can.refusal(wrong, asked, family.title, f"it samples under {runs}"))
    check_patch_pipeline(cfg, family, request, degrees, meta)
    family.check_split(cfg, request.height, request.width, degrees.ulysses, degrees.ring)
    check_sequence_layout(meta(), degrees.ulysses, degrees.ring, family.title)  # its operators


def check_patch_pipeline(cfg, family, request, degrees, meta) -> None:
    """What PipeFusion and the first-block cache through a transformer's patch pieces refuse (first_block
    under PipeFusion: configs/ refuses it): an operator PipeFusion does not run, an attention
    backend that cannot mask a split's or PipeFusion's padded keys, a first-block cache without the pieces.
    Reference images pass beside each patch, as the text (models/attention.py joint_beside)."""
    ranks, pipefusion = degrees.ulysses * degrees.ring, degrees.pipefusion or 1
    first_block = request.cache is not None and request.cache.method == "first_block"
    backend = cfg.model.attention_backend
    masks = family.capabilities.masks_through_kernel
    if masks and (ranks > 1 or pipefusion > 1) and backend not in MASKING_BACKENDS:
        raise ValueError(
            f"model.attention_backend={cfg.model.attention_backend} takes no mask, and a sequence split "
            "and PipeFusion's patches mask keys: use sdpa, math or auto with parallel.ulysses, ring or "
            "pipefusion"
        )
    transformer = meta()
    kinds = operator_kinds(transformer)
    # (its patch pieces too: a family that declares the cache without them is refused, not crashed)
    if first_block and not (family.capabilities.first_block and hasattr(transformer, "patch_blocks")):
        raise ValueError(family.capabilities.refusal("first_block", "sample.cache=first_block", family.title))
    if pipefusion == 1:
        return
    if kinds - KINDS:
        unknown = sorted(kinds - KINDS)
        raise ValueError(f"{family.title} has operators of kind {unknown}, which PipeFusion does not run yet")


def sampling_transformer(cfg, runtime, family, weights: Weights, loras=(), folder=None, group=None):
    """The family's transformer on the host, frozen, with its weights for this rank (under PipeFusion only
    its stage's blocks are allocated and filled; not for a second expert, `folder`): a full run's
    checkpoint; else model.pretrained's (`folder`'s) own, as its files hold them in the compute dtype
    (Family.load_transformer: memory-mapped, no copy) or, for float32_weights, filled row by row from its
    files or a tessera run's (EMA) weights; or random ones from train.seed (--random-weights, any family);
    a LoRA run's adapters, then the --lora files (`loras`: infer.py read_loras') merged in; under
    model.base_dtype=float8 the blocks' Linear weights quantized first and the adapters kept beside them,
    as training computes them (models/lora.py merge_deltas). NaN or inf is refused alike on every rank of
    `group`."""
    layout, groups = runtime.layout, runtime.sampling
    dtype = None  # float32_weights: float32, whatever the compute dtype
    if not family.loading.float32_weights:
        dtype = torch.bfloat16 if runtime.bf16(cfg.train.precision) else torch.float32
    stage = layout.pipefusion > 1 and folder is None
    select = (lambda model: keep_blocks(model, groups.stage, groups.stages)) if stage else None  # noqa: E731

    def meta():  # the transformer on the meta device: this stage's blocks under PipeFusion
        model = family.meta_transformer(cfg)
        return select(model) if stage else model

    checkpoint, record = (weights.checkpoint, weights.record) if folder is None else (None, None)
    deltas = []
    if record is not None:  # matched against the whole architecture: a stage merges its blocks' own
        adapters = checkpoint_adapters(checkpoint, record, family.meta_transformer(cfg), weights.use_ema)
        check_adapters_finite(adapters, checkpoint, weights.use_ema)
        deltas.append(factors_of(adapters))
    deltas += [update.factors(strength) for update, strength in loras]
    if checkpoint is not None and record is None:  # every weight from the run
        model = meta() if dtype is None else meta().to(dtype)
        model.to_empty(device="cpu")
        load_weights(checkpoint, model, use_ema=weights.use_ema)
        # NaN: refused by name (PipeFusion stages hold other blocks: their lists of tensors differ)
        check_checkpoint_finite(model, checkpoint, weights.use_ema, runtime.control_group, not stage)
    elif weights.random:  # every layer from train.seed, by name (alike on any stage); none zero (adaLN-Zero's
        model = meta() if dtype is None else meta().to(dtype)  # zeros would make the output 0 whatever the
        fill_unsharded(model, cfg.train.seed, None, False, stage, group)  # layout does), cast as filled
    elif not family.loading.float32_weights:  # the folder's tensors as they are (a whole-model name check)
        model = family.load_transformer(cfg, dtype, select)
    else:
        model = meta()
        # the main transformer's base run: its EMA weights, as training reads a base; --no-ema: the raw
        # weights of a second expert's run
        use_ema = weights.use_ema if folder is not None else True
        pretrained = open_pretrained(cfg, model, folder, use_ema)
        fill_unsharded(model, cfg.train.seed, pretrained, True, stage, group)
    model = model.eval().requires_grad_(False)
    if cfg.model.base_dtype == "float8":  # on the host: the GPU holds a byte a block weight
        quantize_blocks(model)
    for update in deltas:  # the run's own adapters first, then the files, as the families always merged
        merge_deltas(model, update, elsewhere=held_elsewhere(model))  # a stage: its blocks' only
    return model


def load_sampling(cfg, runtime, family, request, weights: Weights, loras, patches: int) -> tuple:
    """(the family's parts with its transformer for this rank, `denoise_with` walking the schedule across
    the layout, `decode` sharing the VAE's tiles across the replica or None) of models/sampler.py."""
    from models.util import reading_weights

    layout, groups = runtime.layout, runtime.sampling
    dtype = torch.bfloat16 if runtime.bf16(cfg.train.precision) else torch.float32
    with reading_weights(f"{family.title}'s parts (model.pretrained={cfg.model.pretrained})"):
        parts = family.load(cfg, runtime.device, dtype, transformer=False)
    if family.loading.texts_first:  # its text encoder gone before the transformer comes
        negative = request.negative_prompt if family.guidance.guided(request.guidance) else None
        mine = [request.prompts[i] for i in layout.replica_share(runtime.rank, len(request.prompts))]
        family.encode_first(parts, mine, negative, cfg.text_encoder.max_length)
    model = sampling_transformer(cfg, runtime, family, weights, loras, group=runtime.control_group)
    parts.transformer = model.to(runtime.device)
    parts.cache = request.cache
    if request.experts is not None:  # Wan 2.2 A14B: the low-noise expert waits on the host (14B each)
        folder, boundary, guidance_2 = request.experts
        low = sampling_transformer(cfg, runtime, family, weights, folder=folder)
        family.pair_experts(parts, apply_operators(low, runtime.sequence), boundary, guidance_2)
    if layout.pipefusion > 1:  # ulysses and ring, if any, inside each stage
        warmup, faults = cfg.parallel.pipefusion_warmup, runtime.faults
        denoise_with = PipeFusion(parts.transformer, groups, patches, warmup, faults).denoise
    else:
        parts.transformer = apply_operators(parts.transformer, runtime.sequence)
        denoise_with = family_denoiser(groups)
    decode = None
    if family.loading.tiled_vae:  # the replica's ranks share the tiles (early finishers wait on its gloo)
        vae, replica = parts.vae, runtime.sampling
        fence, tiles = replica.replica_control, (replica.replica_group, vae.tile_latent, vae.tile_overlap)
        decode = lambda z: parallel_vae.decode(vae, z.float(), *tiles, control_group=fence)  # noqa: E731
    return parts, denoise_with, decode


def family_batches(cfg, args, runtime, request, family, parts, denoise_with, decode=None):
    """sample_batch(batch, progress) -> (videos, {index in the batch: where NaN or inf was found}) sampled
    by models/sampler.py over the family's parts; sample_batch.sound: the last batch's (waveforms (B,
    channels, samples), rate) of a family that samples sound (LTX-2), else None; .full_calls: the
    first_block cache's calls that ran every block, summed over the samples."""

    def sample_batch(batch: list, progress) -> tuple:
        runtime.watchdog.sampling_progress(0, request.steps)  # each step has a deadline from here on
        sound = None if args.no_audio else []  # a family that samples sound: the batch's (waveforms, rate)
        sampling = request.sampling(batch, args.seed, cfg)
        done = checked(
            generate_images,
            family,
            parts,
            sampling,
            progress,
            denoise_with,
            device=runtime.device,  # not the model's: Wan 2.2's experts take turns on it
            decode=decode,
            sound=sound,
        )
        count_full_calls(sample_batch, request.cache, runtime.sampling, runtime.device, len(batch))
        sample_batch.sound = sound[0] if sound else None
        return done

    sample_batch.full_calls, sample_batch.sound = 0.0, None
    return sample_batch


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
