"""tessera's DiT loaded for the scripts that sample it through models/dit/pipeline.py
(scripts/bench_sampling.py, calibrate_cache.py, bench_cache.py, the PipeFusion tests): its frozen parts, its
transformer with its weights for a layout (parallel/drive/family_sampling.py sampling_transformer, as infer.py
loads every family), Wan 2.2's second expert, and the sampler that walks the schedule across the layout.
"""

from models.families import family_named
from parallel.build.components import build_frozen
from parallel.build.lora import lora_of
from parallel.checkpoints.checkpoint_records import check_architecture
from parallel.compute.operators import apply_operators
from parallel.compute.sampling import ParallelSampler
from parallel.drive.family_sampling import Weights, sampling_transformer


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
    """(the DiT with the checkpoint's weights (without a checkpoint, model.pretrained's, or with
    random_weights random ones from train.seed; a LoRA run's adapters and the `loras` merged in; under
    PipeFusion this rank's stage), the VAE, the text encoder, the sampler that runs it across the layout
    (None: models/sampler.py serial_denoise on this process)). `experts`: Wan 2.2's (low-noise folder,
    boundary, guidance_2)."""
    family, layout = family_named(cfg.model.family), runtime.layout
    text_encoder, vae = build_frozen(cfg, runtime.device)
    record = lora_of(checkpoint) if checkpoint is not None else None
    weights = Weights(checkpoint, record, use_ema, random_weights)
    if checkpoint is not None:  # a full run's or a LoRA run's: the recipe must build its architecture
        check_architecture(checkpoint, family.meta_transformer(cfg).architecture())
    model = sampling_transformer(cfg, runtime, family, weights, loras, group=runtime.control_group)
    if layout.pipefusion == 1:
        model = apply_operators(model, runtime.sequence)
    model = model.to(runtime.device).eval()
    pair = None
    if experts is not None:  # it waits on the host: the sampler keeps one expert on the device at a time
        folder, boundary, guidance_2 = experts
        low = sampling_transformer(cfg, runtime, family, weights, folder=folder)
        pair = (apply_operators(low, runtime.sequence).eval(), boundary, guidance_2)
    sampler = None
    if layout.cfg * layout.pipefusion > 1 or pair is not None:
        sampler = ParallelSampler(
            model, runtime.sampling, patches, cfg.parallel.pipefusion_warmup, runtime.faults, experts=pair
        )
    return model, vae, text_encoder, sampler
