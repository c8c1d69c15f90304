"""The components a recipe names, built for this process: the frozen text encoder and VAE, and the DiT
(on the meta device, or with its weights), with model.pretrained checked against the recipe first.
Shared by train.py, infer.py and the scripts; the weights are filled by parallel/build/init.py.
"""

import warnings
from pathlib import Path

import torch

from models.dit.family import frozen_parts
from models.dit.transformer import DiT, build_dit
from models.dit.wan import check_wan_folder, second_expert
from models.families import family_named
from models.lora import adapted_modules, is_adapter
from models.lora_formats import LoRAFormatError, match_lora, read_file, starting_adapters
from models.text_encoder import TextEncoder
from models.vae import LatentSpace
from models.weight_files import LazyWeights
from parallel.build.init import copy_shards, materialize
from parallel.build.lora import (
    AdapterEMA,
    LoRAState,
    check_resume_base,
    describe_base,
    insert_adapters,
    is_tessera_run,
)
from parallel.checkpoints.checkpoint import TrainingState, load_base_weights, load_weights
from parallel.checkpoints.checkpoint_files import resolve_checkpoint
from parallel.checkpoints.checkpoint_reading import check_checkpoint_files
from parallel.checkpoints.checkpoint_records import check_architecture
from parallel.compute.fsdp import parallelize_dit, param_device
from parallel.compute.operators import apply_operators
from parallel.lifecycle.finite import check_pretrained_finite


def build_frozen(cfg, device) -> tuple[TextEncoder, LatentSpace]:
    """The text encoder and the VAE (frozen, on `device`); the VAE carries the recipe's decode tiles."""
    return frozen_parts(cfg, device)


def build_model(cfg, text_encoder: TextEncoder, vae: LatentSpace, weights: bool = True) -> DiT:
    """The DiT of the recipe, built on the meta device. weights=True: on the host, with model.pretrained's
    weights if set (checked against the recipe), else with weights fixed by train.seed alone (every rank
    and every run builds the same ones). weights=False: none yet; train.py shards it first, then
    parallel/build/init.py fills each rank's shard (a checkpoint load overwrites every weight)."""
    with torch.device("meta"):
        model = build_dit(cfg.model, in_channels=vae.latent_channels, text_dim=text_encoder.dim)
    if not model.text_mask and cfg.text_encoder.max_length != 512:
        warnings.warn(
            f"text_encoder.max_length={cfg.text_encoder.max_length} with unmasked text (model.text_mask "
            "false, as Wan): padding is attended, so the model sees other inputs than Wan's 512-token "
            "padding; set text_encoder.max_length=512 to match Wan",
            stacklevel=2,
        )
    if weights:
        fill_unsharded(model, cfg.train.seed, open_pretrained(cfg, model))
    return model


def meta_transformer(cfg):
    """The recipe's transformer on the meta device, before start-up: tessera's DiT or the family's."""
    return family_named(cfg.model.family).meta_transformer(cfg)


def check_adapters(cfg, fresh: bool = True) -> dict | None:
    """A LoRA recipe tried on a meta-device DiT before init_runtime: lora.targets that match no layer and a
    rank too large are refused here, and lora.init_from is read and matched (a key that fits no layer, or
    an adapter with no counterpart in this run, is an error naming them). Returns the adapters' starting
    tensors {name: whole float32} from lora.init_from, or None (also when not `fresh`: a resume)."""
    family = family_named(cfg.model.family)
    model = meta_transformer(cfg)
    insert_adapters(model, cfg.lora, torch.float32, keep=lambda name: family.trains_parameter(cfg, name))
    if not (cfg.lora.init_from and fresh):
        return None
    projections, linears = family.projections(model)
    try:
        tensors, config = read_file(cfg.lora.init_from)
    except LoRAFormatError as e:
        raise LoRAFormatError(f"lora.init_from: {e}") from None
    update = match_lora(tensors, projections, linears, f"lora.init_from={cfg.lora.init_from}", config)
    return starting_adapters(update, adapted_modules(model), cfg.lora.seed)


def check_lora_start(cfg, checkpoint) -> tuple:
    """(the LoRA base, lora.init_from's starting adapters) of a run, checked before init_runtime: a
    checkpoint of another kind, rank or base is refused (parallel.build.lora.check_resume_base, full runs
    too), a tessera base's `latest` is read once (Base.source, the step open_pretrained reads: a base still
    training may write another first), and the recipe's adapters are tried on a meta model (check_adapters;
    a resume takes its adapters from the checkpoint and never reads lora.init_from). (None, None) for a
    full run."""
    base = describe_base(cfg.model.pretrained) if cfg.lora.rank else None
    if cfg.model.base_dtype == "float8" and base is not None and is_tessera_run(base.path):
        raise ValueError(
            f"model.base_dtype=float8 quantizes the base as it reads a diffusers folder's weights; "
            f"model.pretrained={cfg.model.pretrained} is a tessera run, whose checkpoint is read whole: "
            "export it first (python scripts/export.py --checkpoint RUN --output FOLDER) and name the "
            "folder, or set model.base_dtype=auto"
        )
    if checkpoint is not None:
        check_resume_base(checkpoint, cfg.lora, base)
    adapter_start = check_adapters(cfg, fresh=checkpoint is None) if cfg.lora.rank else None
    return base, adapter_start


def fill_unsharded(
    model: DiT, seed: int, pretrained, zero_init: bool = True, partial: bool = False, group=None
) -> None:
    """Allocate an unsharded model on the host and fill it from `pretrained` (open_pretrained's answer)
    or from `seed`. Pretrained weights with NaN or inf are refused by file and tensor; `group`: the ranks
    that decide it together (every one calls this: PipeFusion stages hold different blocks)."""
    if pretrained is not None and pretrained.checkpoint is not None:  # a tessera run's: DCP reads it
        model.to_empty(device="cpu")
        load_weights(
            pretrained.checkpoint, model, use_ema=pretrained.use_ema, select=lambda key: not is_adapter(key)
        )
    else:
        materialize(model, "cpu", seed, pretrained, zero_init=zero_init, partial=partial)
    if pretrained is not None:
        select = lambda key: not is_adapter(key)  # noqa: E731
        check_pretrained_finite(model, pretrained, group, select, aligned=not partial)


class TesseraWeights(LazyWeights):
    """model.pretrained naming a tessera run: the EMA weights of `step` (its latest checkpoint), or the raw
    ones (infer.py --no-ema pairing a trained second expert), read through DCP (`checkpoint`)."""

    def __init__(self, step: Path, use_ema: bool = True):
        self.step, self.use_ema = Path(step), use_ema
        self.folder = self.checkpoint = self.step

    def where(self, name: str) -> str:
        kind = "EMA" if self.use_ema else "raw"
        return f"model.pretrained={self.step.parent.parent} ({self.step}, {kind} weights): tensor '{name}'"


def check_pretrained(pretrained: str) -> None:
    """Read model.pretrained's headers and checksums (a few KB a file), so that a missing, truncated or
    damaged file is an error naming it before any process group exists."""
    if is_tessera_run(pretrained):
        check_checkpoint_files(describe_base(pretrained).source)  # a LoRA run is refused by name
    else:
        check_wan_folder(pretrained)


def check_weights_source(cfg, family, reads_weights: bool) -> None:
    """model.pretrained's files checked before any process group, where this start reads them
    (`reads_weights`: a fresh start's, a LoRA's base or a distillation's teacher; a full resume, or a full
    run sampled, reads its own checkpoint alone): a tessera run's checkpoint, else the family's folder
    (Family.check_pretrained; read on every start where its frozen parts come from it)."""
    pretrained = cfg.model.pretrained
    # a family whose frozen parts are model.pretrained's needs a pipeline folder: its check refuses a run
    if pretrained and is_tessera_run(pretrained) and not family.loading.from_pretrained:
        if reads_weights:
            check_checkpoint_files(describe_base(pretrained).source)  # a LoRA run is refused by name
    elif reads_weights or family.loading.from_pretrained:
        family.check_pretrained(cfg)


def open_pretrained(cfg, model: DiT, folder=None, use_ema: bool = True, base=None):
    """model.pretrained (or `folder`: Wan 2.2's second expert, a LoRA base's step) as the family's weights
    (Family.open_weights) or a tessera run's (TesseraWeights; `base`: a LoRA run's parallel.build.lora.Base,
    whose step was resolved once, at start-up: a base still training may write another), after checking
    that the recipe builds the same architecture (a disagreement names the keys and the fix); None without
    model.pretrained."""
    pretrained = cfg.model.pretrained if folder is None else folder
    if not pretrained:
        return None
    if is_tessera_run(pretrained):
        step = base.source if base is not None else resolve_checkpoint(str(pretrained), Path(pretrained))
        check_architecture(step, model.architecture())
        return TesseraWeights(step, use_ema)
    return family_named(cfg.model.family).open_weights(cfg, model, pretrained)


def meta_model_builder(cfg, groups, dtype):
    """meta_model(adapters=False) -> (the recipe's model on the meta device, sequence parallel over
    `groups`; the modules given adapters): the family's transformer with its operators."""
    family = family_named(cfg.model.family)

    def meta_model(adapters: bool = False):
        model = family.meta_transformer(cfg)
        trained = lambda name: family.trains_parameter(cfg, name)  # noqa: E731
        critic = cfg.train.objective == "dmd"  # a distillation's critic: a second adapter on each layer
        names = (
            insert_adapters(model, cfg.lora, dtype, cfg.model.base_dtype, trained, critic) if adapters else []
        )
        for name, p in model.named_parameters():  # LTX-2 with data.audio=false: its audio stays as loaded
            if not trained(name):
                p.requires_grad_(False)
        return apply_operators(model, groups), names

    return meta_model


def fill_sharded(
    runtime,
    model: DiT,
    seed: int,
    pretrained,
    adapter_seed: int = 0,
    cpu_offload: bool = False,
    adapter_start: dict | None = None,
) -> None:
    """Allocate a sharded model on this rank's device (the CPU under cpu_offload) and fill its shards:
    from `pretrained` (Wan weights read row by row, or a tessera run's checkpoint resharded by DCP) or
    from `seed`; adapters from `adapter_start` (lora.init_from) where it has them, else `adapter_seed`.
    Pretrained weights with NaN or inf are refused by file and tensor, alike on every rank."""
    checkpoint = pretrained.checkpoint if pretrained is not None else None
    rows = pretrained if checkpoint is None else None  # read row by row, each rank its shard
    device = param_device(runtime.device, cpu_offload)
    materialize(model, device, seed, rows, adapter_seed=adapter_seed, adapter_start=adapter_start)
    if checkpoint is not None:  # a tessera run's: DCP reads it resharded
        load_base_weights(runtime, checkpoint, model)
    if pretrained is not None:  # each rank its shards, one verdict for all (the adapters: read_file)
        select = lambda key: not is_adapter(key)  # noqa: E731
        check_pretrained_finite(model, pretrained, runtime.control_group, select)


def build_ema(cfg, runtime, model, optimizer, meta_model, lora: bool, distiller=None):
    """The EMA, starting as the model, and what a checkpoint saves: for a LoRA, the adapters' EMA and
    LoRAState (with a distillation's critic optimizer); else a second model (`meta_model()`: one on the meta
    device, sequence parallel) sharded like the model, and TrainingState (with a distillation's full critic).
    `distiller`: parallel/drive/distill.py's Distiller, or None."""
    if lora:
        ema = AdapterEMA(model)
        return ema, LoRAState(model, ema, optimizer, distiller.critic if distiller is not None else None)
    offload = cfg.train.cpu_offload
    ema = parallelize_dit(meta_model().requires_grad_(False), runtime.fsdp_mesh, cpu_offload=offload)
    copy_shards(ema, model, param_device(runtime.device, offload))
    critic = None
    if distiller is not None:
        critic = (distiller.critic_model, distiller.critic)
    return ema, TrainingState(model, ema, optimizer, critic)


def build_copies(cfg, runtime, model, meta_model, dtype, resuming: bool) -> tuple:
    """A distillation's full copies (lora.rank=0): (the critic, trained, and the teacher, frozen), each a
    model sharded as the generator `model` and computed as it is (`dtype`). Both start as model.pretrained:
    copied from the generator's fresh shards, shard by shard; on a resume the teacher is read from
    model.pretrained again (its fingerprint checked against the run's: parallel/drive/distill.py) and the
    critic comes from the checkpoint."""
    tc = cfg.train
    device = param_device(runtime.device, tc.cpu_offload)
    fp8 = tc.fp8_min_features if tc.fp8 else None
    critic = parallelize_dit(
        meta_model(), runtime.fsdp_mesh, dtype, tc.activation_checkpointing, tc.compile, tc.cpu_offload,
        tc.checkpoint_policy, fp8,
    )  # fmt: skip
    # stored in the compute dtype: FSDP2 gathers it so anyway, and it never steps (half its bytes in bf16);
    # no backward runs through it, so nothing to checkpoint
    teacher = meta_model().requires_grad_(False).to(dtype)
    teacher = parallelize_dit(
        teacher, runtime.fsdp_mesh, dtype, False, tc.compile, tc.cpu_offload, "all", fp8
    )
    if resuming:
        critic.to_empty(device=device)  # load_checkpoint fills it
        fill_sharded(runtime, teacher, tc.seed, open_pretrained(cfg, teacher), cpu_offload=tc.cpu_offload)
    else:
        copy_shards(critic, model, device)
        copy_shards(teacher, model, device)
    return critic, teacher


def expert_recipe(cfg):
    """Wan 2.2 A14B expert training (model.expert=high|low): the recipe with the experts' boundary in
    sample.boundary (model.pretrained's boundary_ratio unless set) and, for the low-noise expert, its
    weights (model.pretrained_2, else model.pretrained's transformer_2/) in model.pretrained; each missing
    piece refused by name. The two experts train as two runs of one recipe; infer.py pairs them."""
    if cfg.model.expert == "none":
        return cfg
    import copy

    folder, boundary = second_expert(cfg.model.pretrained, cfg.model.pretrained_2)
    boundary = cfg.sample.boundary if cfg.sample.boundary is not None else boundary
    if boundary is None or not 0 < boundary < 1:
        raise ValueError(
            f"model.expert={cfg.model.expert} trains on the noise levels of one of Wan 2.2's experts: set "
            f"sample.boundary where they switch (0.875 for T2V-A14B, 0.9 for I2V-A14B), got {boundary}"
        )
    cfg = copy.deepcopy(cfg)  # keeps the schema's types
    cfg.sample.boundary = boundary
    pipeline = cfg.model.pretrained and (Path(cfg.model.pretrained) / "model_index.json").is_file()
    if cfg.model.expert == "low" and (folder is not None or pipeline):  # else model.pretrained is the expert
        if folder is None:
            raise ValueError(
                "model.expert=low trains Wan 2.2's low-noise expert: model.pretrained has no transformer_2/; "
                "name the expert's folder in model.pretrained_2"
            )
        cfg.model.pretrained = folder
    cfg.model.pretrained_2 = None
    return cfg
