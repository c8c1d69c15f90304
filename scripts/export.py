"""Export a tessera checkpoint as diffusers/ComfyUI load it (EMA weights unless --no-ema; one process):

    python scripts/export.py --checkpoint RUN_DIR|checkpoints/|latest|step_N --output FOLDER [--pipeline]
    python scripts/export.py --checkpoint LORA_RUN --lora --format diffusers|comfyui --output FILE.safetensors
    python scripts/export.py --checkpoint LORA_RUN --lora --merge --output FOLDER [--pipeline]

The run's transformer as its family's diffusers folder (models/family.py's export hooks): the DiT's a
WanTransformer3DModel (with Wan's options), or with --pipeline a Wan pipeline of the recipe's VAE, UMT5,
CLIP and a fixed-shift scheduler (--low-noise-expert: Wan 2.2's second expert); the others' their
transformer class, or model.pretrained's pipeline folder with it in. A LoRA run writes its adapters
(diffusers/PEFT names for load_lora_weights, or ComfyUI's with an alpha per module; fused q/k/v split
exactly), or with --merge its base with them folded in. The recipe: the run's config.yaml, or --config.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from configs import load_config  # noqa: E402
from models.families import family_named  # noqa: E402
from models.lora import factors_of, merge_deltas  # noqa: E402
from models.lora_formats import (  # noqa: E402
    FORMATS,
    export_adapters,
    is_wan_named,
    safetensors_metadata,
)
from parallel.build.components import fill_unsharded, open_pretrained  # noqa: E402
from parallel.build.lora import base_of_run, checkpoint_adapters, lora_of  # noqa: E402
from parallel.checkpoints.checkpoint import load_weights  # noqa: E402
from parallel.checkpoints.checkpoint_files import CheckpointError, resolve_checkpoint  # noqa: E402
from parallel.checkpoints.checkpoint_reading import read_metadata, read_trainer_state  # noqa: E402
from parallel.checkpoints.checkpoint_records import check_architecture  # noqa: E402


def checkpoint_dims(path: Path, prefix: str) -> tuple[int, int]:
    """(latent channels, text width) of the DiT in a checkpoint, from DCP's metadata alone (no text
    encoder or VAE is built)."""
    sizes = read_metadata(path).state_dict_metadata  # without running code (DCP's reader would)
    try:
        patch = sizes[f"{prefix}.x_embedder.proj.weight"].size  # (D, C, pt, ph, pw)
        text = sizes[f"{prefix}.y_embedder.0.weight"].size  # (D, text_dim)
    except KeyError as e:
        raise CheckpointError(f"{path} holds no tessera DiT weights ({e.args[0]} missing)") from None
    return patch[1], text[1]


def check_expert_runs(high: Path, low: Path, cfg, pipeline: bool):
    """The low-noise expert's recipe (its run's config.yaml), after checking that the two runs trained
    Wan 2.2's two experts with one boundary and that a pipeline folder is asked for."""
    if not pipeline:
        raise ValueError("--low-noise-expert pairs two experts in a pipeline folder: add --pipeline")
    low_recipe = low.parent.parent / "config.yaml"
    if not low_recipe.is_file():
        raise CheckpointError(f"no recipe: {low_recipe} does not exist beside the low-noise expert")
    low_cfg = load_config(low_recipe)
    roles = {"--checkpoint": (cfg, "high"), "--low-noise-expert": (low_cfg, "low")}
    for flag, (recipe, expert) in roles.items():
        if recipe.model.expert != expert:
            raise ValueError(
                f"{flag} names a run trained with model.expert={recipe.model.expert}; it must be the "
                f"{expert}-noise expert's run (model.expert={expert})"
            )
    if cfg.sample.boundary != low_cfg.sample.boundary:
        raise ValueError(
            f"the experts trained with other boundaries (sample.boundary {cfg.sample.boundary} and "
            f"{low_cfg.sample.boundary}): train both with the same recipe"
        )
    return low_cfg


def checkpoint_architecture(checkpoint: Path, use_ema: bool) -> dict:
    """What the run's transformer was built with (trainer_state.pt's record; a DiT's run from before it was
    recorded: its input channels and text width from DCP's metadata)."""
    architecture = read_trainer_state(checkpoint).get("architecture")
    if architecture is None:
        dims = checkpoint_dims(checkpoint, "ema" if use_ema else "model")
        architecture = dict(zip(("in_channels", "text_dim"), dims))
    return architecture


def trained_transformer(checkpoint: Path, cfg, use_ema: bool, pipeline: bool):
    """The run's transformer, filled on the host (a LoRA run's adapters folded into its base), after the
    family's export checks and the recipe's architecture against the checkpoint's, before any weight."""
    family, record = family_named(cfg.model.family), lora_of(checkpoint)
    architecture = checkpoint_architecture(checkpoint, use_ema)
    model = family.run_transformer(cfg, architecture)
    family.check_export(cfg, model, pipeline)
    check_architecture(checkpoint, model.architecture())  # options without weights would export silently
    if record is not None:  # the base, then the adapters folded in
        base = OmegaConf.create(OmegaConf.to_container(cfg))  # the recipe, on the base it was trained on
        base.model.pretrained = base_of_run(checkpoint, record, cfg.model.pretrained)
        fill_unsharded(model, cfg.train.seed, open_pretrained(base, model))
        adapters = checkpoint_adapters(checkpoint, record, family.run_transformer(cfg, architecture), use_ema)
        merge_deltas(model, factors_of(adapters))  # one layer's delta at a time
    else:
        model.to_empty(device="cpu")
        load_weights(checkpoint, model, use_ema=use_ema)
    return model


def export(checkpoint: Path, output: Path, cfg, use_ema=True, max_shard_size="5GB", pipeline=False,
           low_noise: Path | None = None) -> str:  # fmt: skip
    """The checkpoint's transformer as the family's diffusers folder (a LoRA run's adapters folded into its
    base: --merge), or with `pipeline` a whole pipeline folder. `low_noise`: Wan 2.2's low-noise expert's
    checkpoint (its run trained with model.expert=low), the pipeline's second expert. Returns what was
    written."""
    family = family_named(cfg.model.family)
    low_cfg = check_expert_runs(checkpoint, low_noise, cfg, pipeline) if low_noise is not None else None
    transformer = family.export_transformer(cfg, trained_transformer(checkpoint, cfg, use_ema, pipeline))
    output.mkdir(parents=True, exist_ok=True)
    folder = transformer
    if pipeline:
        second = None
        if low_noise is not None:
            low = trained_transformer(low_noise, low_cfg, use_ema, pipeline)
            second = family.export_transformer(low_cfg, low), cfg.sample.boundary
        folder = family.export_pipeline(cfg, transformer, second)
    folder.save_pretrained(output, max_shard_size=max_shard_size)
    config = transformer.config
    dims = [config.get(k) for k in ("num_layers", "num_attention_heads", "attention_head_dim")]
    shape = f", {dims[0]} layers, {dims[1]} heads of {dims[2]}" if None not in dims else ""
    return f"{type(folder).__name__} folder{shape}"


def export_lora(checkpoint: Path, output: Path, cfg, fmt: str, use_ema: bool = True) -> str:
    """A LoRA run's adapters as one .safetensors file in `fmt` (one of the family's lora_formats), on its
    transformer of the checkpoint's architecture (Family.run_transformer). Returns a note for the user:
    the format written, or why tessera's own names were used."""
    from safetensors.torch import save_file

    family = family_named(cfg.model.family)
    record = lora_of(checkpoint)
    if record is None:
        raise CheckpointError(
            f"{checkpoint} is a full fine-tuning's checkpoint, not a LoRA's: export it without --lora "
            "(a transformer folder)"
        )
    if fmt not in family.names.lora_formats:
        raise ValueError(
            f"--format {fmt}: {family.title}'s LoRAs are written in {', '.join(family.names.lora_formats)}"
        )
    if output.suffix != ".safetensors":
        raise ValueError(f"--output {output}: a LoRA is written as one .safetensors file")
    architecture = read_trainer_state(checkpoint).get("architecture", {})  # older runs: none recorded
    meta = lambda: family.run_transformer(cfg, architecture)  # noqa: E731
    check_architecture(checkpoint, meta().architecture())  # the adapters' names follow the recipe's model
    adapters = checkpoint_adapters(checkpoint, record, meta(), use_ema)
    projections, _ = family.projections(meta())
    names = family.names
    tensors = export_adapters(adapters, projections, fmt, names.lora_alphas, names.lora_release_names)
    output.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": "pt", "tessera_rank": record["rank"], "tessera_base": record["base"]["fingerprint"]}
    save_file(tensors, str(output), metadata=safetensors_metadata(info))
    if not is_wan_named(projections):
        return (
            "a LoRA in tessera's own names (tessera.<module>.lora_A/B.weight), because this DiT does not "
            "have Wan's architecture: infer.py --lora reads it, diffusers and ComfyUI do not"
        )
    count = f"{len(adapters)} adapted layers, {len(tensors)} tensors, rank {record['rank']}"
    return f"a LoRA in {fmt} names ({count})"


def low_noise_checkpoint(spec):
    if spec is None:
        return None
    checkpoint = resolve_checkpoint(str(spec), Path(spec))
    if checkpoint is None:
        raise CheckpointError(f"--low-noise-expert: no checkpoint at {spec}")
    return checkpoint


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="a run directory, its checkpoints/ folder, latest or a step_N"
    )
    p.add_argument("--output", required=True)
    p.add_argument("--config", default=None, help="the recipe (default: the run's config.yaml)")
    p.add_argument("--no-ema", action="store_true", help="export the raw weights instead of the EMA weights")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="a whole WanPipeline folder (VAE, text encoder, tokenizer, scheduler from the recipe)",
    )
    p.add_argument(
        "--low-noise-expert",
        default=None,
        help="Wan 2.2: the low-noise expert's run (model.expert=low), paired as the pipeline's transformer_2",
    )
    p.add_argument("--lora", action="store_true", help="a LoRA run's adapters as one .safetensors file")
    p.add_argument("--format", choices=FORMATS, default="diffusers", help="the LoRA's key names (--lora)")
    p.add_argument(
        "--merge", action="store_true", help="with --lora: the base with the adapters folded in, as a folder"
    )
    args = p.parse_args(argv)
    spec = Path(args.checkpoint)
    checkpoint = resolve_checkpoint(str(spec), spec)
    if checkpoint is None:
        raise CheckpointError(f"no checkpoint at {spec}")
    run_dir = checkpoint.parent.parent  # <run>/checkpoints/step_N
    recipe = Path(args.config) if args.config else run_dir / "config.yaml"
    if not recipe.is_file():
        raise CheckpointError(
            f"no recipe: {recipe} does not exist; pass --config with the recipe it was trained with"
        )
    cfg = load_config(recipe)
    weights = "raw" if args.no_ema else "EMA"
    family = family_named(cfg.model.family)
    if args.low_noise_expert and not family.capabilities.expert_pair:
        raise ValueError(f"--low-noise-expert pairs Wan 2.2's experts; {family.title} has one transformer")
    if args.low_noise_expert and args.lora and not args.merge:
        raise ValueError(
            "--low-noise-expert pairs two experts in a pipeline folder: drop --lora (or add --merge)"
        )
    if args.lora and not args.merge:
        note = export_lora(checkpoint, Path(args.output), cfg, args.format, use_ema=not args.no_ema)
        print(f"[export] {checkpoint} ({weights} adapters) -> {args.output}: {note}")
        return 0
    if args.merge and not lora_of(checkpoint):
        raise CheckpointError(f"--merge folds a LoRA into its base, and {checkpoint} is not a LoRA run's")
    note = export(
        checkpoint,
        Path(args.output),
        cfg,
        use_ema=not args.no_ema,
        max_shard_size=args.max_shard_size,
        pipeline=args.pipeline,
        low_noise=low_noise_checkpoint(args.low_noise_expert),
    )
    merged = ", the LoRA folded into its base" if lora_of(checkpoint) else ""
    print(f"[export] {checkpoint} ({weights} weights{merged}) -> {args.output}: {note}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (
        ValueError,
        CheckpointError,
        OSError,
    ) as e:  # bad input or a missing folder: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
