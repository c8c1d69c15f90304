"""Export a tessera checkpoint as diffusers/ComfyUI load it (EMA weights unless --no-ema; one process):

    python scripts/export.py --checkpoint RUN_DIR|checkpoints/|latest|step_N --output FOLDER [--pipeline]
    python scripts/export.py --checkpoint LORA_RUN --lora --format diffusers|comfyui --output FILE.safetensors
    python scripts/export.py --checkpoint LORA_RUN --lora --merge --output FOLDER [--pipeline]

A WanTransformer3DModel folder (or with --pipeline a WanPipeline folder: the recipe's Wan VAE, UMT5 and a
FlowMatchEulerDiscreteScheduler with its fixed shift; model.task=i2v/flf2v: a WanImageToVideoPipeline with
the recipe's CLIP image encoder, if it has one) that from_pretrained and model.pretrained read; the
DiT must have Wan's options. A LoRA run writes its adapters (diffusers/PEFT names for load_lora_weights, or
ComfyUI's with an alpha per module; fused q/k/v split exactly), or with --merge its base with them folded
in. The recipe is the run's config.yaml unless --config. Options: --no-ema, --max-shard-size 5GB.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from configs import load_config  # noqa: E402
from models.families import family_named  # noqa: E402
from models.family import FamilyWeights  # noqa: E402
from models.lora import deltas_of, merge_deltas  # noqa: E402
from models.lora_formats import (  # noqa: E402
    FORMATS,
    export_adapters,
    is_wan_named,
    safetensors_metadata,
)
from models.wan import diffusers_config_from_dit, diffusers_state_dict_from_tessera  # noqa: E402
from parallel.checkpoint import load_weights  # noqa: E402
from parallel.checkpoint_files import CheckpointError, resolve_checkpoint  # noqa: E402
from parallel.checkpoint_reading import read_metadata, read_trainer_state  # noqa: E402
from parallel.checkpoint_records import check_architecture  # noqa: E402
from parallel.components import fill_unsharded, open_pretrained  # noqa: E402
from parallel.lora import base_of_run, checkpoint_adapters, lora_of  # noqa: E402


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


def check_pipeline_recipe(cfg) -> None:
    """What a WanPipeline folder needs from the recipe, checked before any weight is read."""
    wrong = []
    if cfg.vae.kind != "wan" or not cfg.vae.pretrained:
        wrong.append(
            f"vae.kind=wan with vae.pretrained set (got kind {cfg.vae.kind}, pretrained {cfg.vae.pretrained})"
        )
    if cfg.text_encoder.kind != "umt5" or not cfg.text_encoder.pretrained:
        wrong.append(
            f"text_encoder.kind=umt5 with text_encoder.pretrained set (got kind {cfg.text_encoder.kind}, "
            f"pretrained {cfg.text_encoder.pretrained})"
        )
    if cfg.flow.shift_reference_tokens != 0:
        wrong.append(
            "a fixed shift, flow.shift_reference_tokens=0 (WanPipeline's scheduler does not scale it with "
            f"the token count; got {cfg.flow.shift_reference_tokens})"
        )
    if wrong:
        raise ValueError("--pipeline needs " + "; ".join(wrong))


def export(
    checkpoint: Path,
    output: Path,
    cfg,
    use_ema: bool = True,
    max_shard_size: str = "5GB",
    pipeline: bool = False,
    low_noise: Path | None = None,
) -> dict:
    """The checkpoint's DiT as a WanTransformer3DModel (or WanPipeline) folder; a LoRA run's adapters are
    folded into its base first (the --merge export). `low_noise`: Wan 2.2's low-noise expert's checkpoint
    (its run trained with model.expert=low), written as the pipeline's transformer_2 with the boundary."""
    if low_noise is not None:
        low_cfg = check_expert_runs(checkpoint, low_noise, cfg, pipeline)
    wan, config = exported_transformer(checkpoint, cfg, use_ema, pipeline)
    output.mkdir(parents=True, exist_ok=True)
    if not pipeline:
        wan.save_pretrained(output, max_shard_size=max_shard_size)
        return config
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    from models.text_encoder import load_pretrained_text_encoder
    from models.vae import load_pretrained_vae

    tokenizer, text_encoder = load_pretrained_text_encoder(cfg.text_encoder.kind, cfg.text_encoder.pretrained)
    parts = dict(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=wan,
        vae=load_pretrained_vae(cfg.vae.kind, cfg.vae.pretrained),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=cfg.flow.shift),
    )
    if low_noise is not None:  # as diffusers' A14B folders: transformer_2 below boundary_ratio
        parts.update(transformer_2=exported_transformer(low_noise, low_cfg, use_ema, pipeline)[0])
        parts.update(boundary_ratio=cfg.sample.boundary)
    if cfg.model.task in ("t2v", "ti2v"):  # TI2V as Wan-AI's release: a WanPipeline with expand_timesteps
        pipe = WanPipeline(**parts, **({"expand_timesteps": True} if cfg.model.task == "ti2v" else {}))
    else:  # Wan2.1 I2V / FLF2V with the CLIP encoder the recipe names; Wan2.2 I2V without one
        pipe = WanImageToVideoPipeline(**parts, **image_encoder_parts(cfg))
    pipe.save_pretrained(output, max_shard_size=max_shard_size)
    return config


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


def exported_transformer(checkpoint: Path, cfg, use_ema: bool, pipeline: bool):
    """(the checkpoint's DiT as a diffusers WanTransformer3DModel, its config)."""
    from diffusers import WanTransformer3DModel

    record, family = lora_of(checkpoint), family_named(cfg.model.family)
    if record is not None:
        architecture = read_trainer_state(checkpoint)["architecture"]
    else:
        dims = checkpoint_dims(checkpoint, "ema" if use_ema else "model")
        architecture = dict(zip(("in_channels", "text_dim"), dims))
    model = family.run_transformer(cfg, architecture)
    config = diffusers_config_from_dit(model.architecture())  # refuses a non-Wan DiT before reading weights
    if pipeline:
        check_pipeline_recipe(cfg)
    if cfg.model.rope_theta != 10000.0:
        raise ValueError(f"model.rope_theta={cfg.model.rope_theta}: Wan's rotary embedding uses 10000")
    if not cfg.model.qk_norm:
        raise ValueError("model.qk_norm=false: Wan normalises queries and keys")
    check_architecture(checkpoint, model.architecture())  # options without weights would export silently
    if record is not None:  # the base, then the adapters folded in
        base = OmegaConf.create(OmegaConf.to_container(cfg))  # the recipe, on the base it was trained on
        base.model.pretrained = base_of_run(checkpoint, record, cfg.model.pretrained)
        fill_unsharded(model, cfg.train.seed, open_pretrained(base, model))
        adapters = checkpoint_adapters(checkpoint, record, family.run_transformer(cfg, architecture), use_ema)
        merge_deltas(model, deltas_of(adapters))
    else:
        model.to_empty(device="cpu")
        load_weights(checkpoint, model, use_ema=use_ema)
    wan = WanTransformer3DModel(**config)
    state = diffusers_state_dict_from_tessera(model.state_dict(), wan.state_dict().keys())
    wan.load_state_dict(state, strict=True)
    return wan, config


def image_encoder_parts(cfg) -> dict:
    """A WanImageToVideoPipeline's image_encoder and image_processor: the recipe's CLIP, or none."""
    if not cfg.model.image_dim:
        return {}
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from models.image_condition import image_encoder_dirs, image_encoder_folder

    model_dir, processor_dir = image_encoder_dirs(image_encoder_folder(cfg))
    return dict(
        image_encoder=CLIPVisionModel.from_pretrained(model_dir, dtype=torch.float32),
        image_processor=CLIPImageProcessor.from_pretrained(processor_dir),
    )


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
    if fmt not in family.lora_formats:
        raise ValueError(
            f"--format {fmt}: {family.title}'s LoRAs are written in {', '.join(family.lora_formats)}"
        )
    if output.suffix != ".safetensors":
        raise ValueError(f"--output {output}: a LoRA is written as one .safetensors file")
    architecture = read_trainer_state(checkpoint).get("architecture", {})  # older runs: none recorded
    meta = lambda: family.run_transformer(cfg, architecture)  # noqa: E731
    adapters = checkpoint_adapters(checkpoint, record, meta(), use_ema)
    projections, _ = family.projections(meta())
    tensors = export_adapters(adapters, projections, fmt, family.lora_alphas)
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


def export_family(checkpoint: Path, output: Path, cfg, family, args) -> str:
    """A family's run (models/families.py): its LoRA as one file (--lora), or its transformer (a LoRA
    folded into its base with --merge) as a diffusers folder; --pipeline: model.pretrained's pipeline
    folder with it in. Returns what was written."""
    record, use_ema = lora_of(checkpoint), not args.no_ema
    if args.low_noise_expert:
        raise ValueError(f"--low-noise-expert pairs Wan 2.2's experts; {family.title} has one transformer")
    check_architecture(checkpoint, family.meta_transformer(cfg).architecture())
    if args.lora and not args.merge:
        return export_lora(checkpoint, output, cfg, args.format, use_ema)
    if args.merge and record is None:
        raise CheckpointError(f"--merge folds a LoRA into its base, and {checkpoint} is not a LoRA run's")
    if args.pipeline and not (Path(cfg.model.pretrained or "") / "model_index.json").is_file():
        raise ValueError(
            f"--pipeline copies model.pretrained's pipeline folder: {cfg.model.pretrained} is not one"
        )
    model = family.meta_transformer(cfg)
    if record is not None:  # the base, then the adapters folded in
        base = OmegaConf.create(OmegaConf.to_container(cfg))
        base.model.pretrained = base_of_run(checkpoint, record, cfg.model.pretrained)
        fill_unsharded(model, cfg.train.seed, FamilyWeights(family, base))
        merge_deltas(
            model, deltas_of(checkpoint_adapters(checkpoint, record, family.meta_transformer(cfg), use_ema))
        )
    else:
        model.to_empty(device="cpu")
        load_weights(checkpoint, model, use_ema=use_ema)
    import diffusers

    config = family.transformer_config(cfg)
    with torch.device("meta"):  # no second random copy of the weights on the host
        transformer = getattr(diffusers, config["_class_name"]).from_config(config)
    transformer.load_state_dict(family.to_diffusers(model.state_dict()), strict=True, assign=True)
    if not args.pipeline:
        transformer.save_pretrained(output, max_shard_size=args.max_shard_size)
        return f"{type(transformer).__name__} folder"
    pipe = diffusers.DiffusionPipeline.from_pretrained(cfg.model.pretrained, transformer=transformer)
    pipe.save_pretrained(output, max_shard_size=args.max_shard_size)
    return f"{type(pipe).__name__} folder (its other parts from {cfg.model.pretrained})"


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
    if not family.native:
        note = export_family(checkpoint, Path(args.output), cfg, family, args)
        print(f"[export] {checkpoint} ({weights} weights) -> {args.output}: {note}")
        return 0
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
    config = export(
        checkpoint,
        Path(args.output),
        cfg,
        use_ema=not args.no_ema,
        max_shard_size=args.max_shard_size,
        pipeline=args.pipeline,
        low_noise=low_noise_checkpoint(args.low_noise_expert),
    )
    kind = "WanPipeline" if args.pipeline else "WanTransformer3DModel"
    merged = ", the LoRA folded into its base" if lora_of(checkpoint) else ""
    print(
        f"[export] {checkpoint} ({weights} weights{merged}) -> {args.output}: {kind}, "
        f"{config['num_layers']} layers, {config['num_attention_heads']} heads "
        f"of {config['attention_head_dim']}"
    )
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
