"""tessera's DiT written out as diffusers' Wan folders (the DiT family's export hooks, scripts/export.py):
a WanTransformer3DModel, or a WanPipeline / WanImageToVideoPipeline assembled from the recipe's Wan VAE,
UMT5, CLIP image encoder and a FlowMatchEulerDiscreteScheduler with its fixed shift; Wan 2.2's second
expert as the pipeline's transformer_2 below its boundary."""

import torch

from models.dit.wan import WanFormatError, diffusers_config_from_dit, diffusers_state_dict_from_tessera


def check_wan_export(cfg, architecture: dict, pipeline: bool) -> None:
    """What a Wan folder needs of the DiT (`architecture`: DiT.architecture()) and, for a pipeline folder,
    of the recipe: checked before any weight is read."""
    diffusers_config_from_dit(architecture)  # a DiT without Wan's options: refused by name
    if pipeline:
        check_pipeline_recipe(cfg)
    if cfg.model.rope_theta != 10000.0:
        raise WanFormatError(f"model.rope_theta={cfg.model.rope_theta}: Wan's rotary embedding uses 10000")
    if not cfg.model.qk_norm:
        raise WanFormatError("model.qk_norm=false: Wan normalises queries and keys")


def check_pipeline_recipe(cfg) -> None:
    """What a WanPipeline folder needs from the recipe."""
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
        raise WanFormatError("--pipeline needs " + "; ".join(wrong))


def wan_transformer(model):
    """The filled DiT as a WanTransformer3DModel (every weight under diffusers' names, strictly)."""
    from diffusers import WanTransformer3DModel

    wan = WanTransformer3DModel(**diffusers_config_from_dit(model.architecture()))
    wan.load_state_dict(diffusers_state_dict_from_tessera(model.state_dict(), wan.state_dict().keys()))
    return wan


def wan_pipeline(cfg, transformer, second=None):
    """A Wan pipeline with `transformer` in, its other parts from the recipe; `second`: (Wan 2.2's
    low-noise expert, the boundary) as transformer_2 and boundary_ratio, as diffusers' A14B folders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    from models.text_encoder import load_pretrained_text_encoder
    from models.vae import load_pretrained_vae

    tokenizer, text_encoder = load_pretrained_text_encoder(cfg.text_encoder.kind, cfg.text_encoder.pretrained)
    parts = dict(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=load_pretrained_vae(cfg.vae.kind, cfg.vae.pretrained),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=cfg.flow.shift),
    )
    if second is not None:
        parts.update(transformer_2=second[0], boundary_ratio=second[1])
    if cfg.model.task in ("t2v", "ti2v"):  # TI2V as Wan-AI's release: a WanPipeline with expand_timesteps
        return WanPipeline(**parts, **({"expand_timesteps": True} if cfg.model.task == "ti2v" else {}))
    # Wan2.1 I2V / FLF2V with the CLIP encoder the recipe names; Wan2.2 I2V without one
    return WanImageToVideoPipeline(**parts, **image_encoder_parts(cfg))


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
