"""infer.py's tessera DiT (Wan): the DiT loaded with its weights for a layout (a checkpoint's,
model.pretrained's, or random ones; LoRAs merged in; under PipeFusion this rank's stage), Wan 2.2's second
expert, and each batch sampled with its image condition, the VAE decode shared by the replica and the step
cache's checks.
"""

from pathlib import Path

import torch

from models.flow import RectifiedFlow
from models.image_condition import image_inputs, sampling_condition
from models.lora import deltas_of, merge_deltas
from models.pipeline import generate_checked
from models.wan import second_expert
from parallel import vae as parallel_vae
from parallel.cache import count_full_calls
from parallel.checkpoint import load_weights
from parallel.checkpoint_files import resolve_checkpoint
from parallel.checkpoint_records import check_architecture
from parallel.components import build_frozen, build_model, fill_unsharded, open_pretrained
from parallel.finite import check_adapters_finite, check_checkpoint_finite
from parallel.lora import checkpoint_adapters, is_tessera_run, lora_of
from parallel.operators import apply_operators
from parallel.pipefusion_plan import held_elsewhere, keep_stage
from parallel.sampling import ParallelSampler


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
        model = apply_operators(model, runtime.sequence)
    model = model.to(runtime.device).eval()
    pair = None
    if experts is not None:  # Wan 2.2 A14B: the low-noise expert, built and filled as the first one
        folder, boundary, guidance_2 = experts
        low = build_model(cfg, text_encoder, vae, weights=False)
        fill_unsharded(low, cfg.train.seed, open_pretrained(cfg, low, folder, use_ema))
        # it waits on the host: the sampler keeps one expert on the device at a time (14B each)
        pair = (apply_operators(low, runtime.sequence).eval(), boundary, guidance_2)
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


def dit_batches(cfg, args, runtime, request, model, vae, text_encoder, sampler):
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

    sample_batch.full_calls, sample_batch.sound = 0.0, None  # tessera's DiT samples no sound
    return sample_batch


def image_condition(cfg, request, batch: list, vae, encoder, device):
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
