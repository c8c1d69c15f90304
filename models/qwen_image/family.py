"""Qwen-Image as a tessera family (models/family.py): a diffusers QwenImagePipeline folder's transformer,
Qwen2.5-VL text encoder and VAE; the prompt in the pipeline's template, unpadded; the scheduler's
resolution-dependent shift with Euler steps; true CFG with the per-token norm rescale.
"""

import torch

from models.family import Components, Family, config_of, part_folder, read_json
from models.guidance import Guidance
from models.loop import Schedule, euler, sigmas
from models.names import Names
from models.qwen_image.sampling import denormalize_latents, image_tokens, normalize_latents, true_cfg
from models.qwen_image.text import encode_prompt
from models.qwen_image.transformer import QwenImageCond
from models.qwen_image.weights import (
    PIPELINE_CLASS,
    TRANSFORMER_CLASS,
    build_transformer,
    diffusers_state_dict_from_original,
)
from models.steps import Steps, seeded_noise

# Qwen/Qwen-Image's scheduler/scheduler_config.json, for a transformer folder without one beside it
RELEASE_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


class TrueCFG(Guidance):
    def guide(self, v_cond, v_uncond, scale: float, parts=None):
        return true_cfg(v_cond, v_uncond, scale)  # rescaled to the conditional velocity's norm


class QwenImageSteps(Steps):
    """Its pipeline's packed noise, shifted schedule and decoding."""

    def noise(self, parts: Components, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """What the pipeline draws from a generator seeded with seed, one image each, in the model's dtype:
        (C, 1, h, w) holds the numbers of its (1, 1, C, h, w) in the same order."""
        scale = 2 ** len(parts.vae.temperal_downsample)
        shape = (parts.transformer.in_channels, 1, height // scale, width // scale)
        return seeded_noise(seeds, shape, parts.transformer.img_in.weight.dtype)

    def schedule(self, parts: Components, steps: int, latents: torch.Tensor) -> Schedule:
        levels = sigmas(steps, image_tokens(*latents.shape[-2:]), parts.scheduler_config).to(latents.device)
        return Schedule(levels, levels[:-1], euler(levels))

    def decode(self, parts: Components, latents) -> torch.Tensor:
        z = denormalize_latents(latents.to(parts.vae.dtype), parts.vae.config)
        return parts.vae.decode(z, return_dict=False)[0]  # (B, 3, 1, H, W)


class QwenImage(Family):
    name, title = "qwen_image", "Qwen-Image"
    steps = QwenImageSteps()
    pipeline_classes, transformer_classes = (PIPELINE_CLASS,), (TRANSFORMER_CLASS,)
    # every degree: one of ulysses and ring (joint attention)
    vae_class, max_length = "AutoencoderKLQwenImage", 512
    lora_targets = ("blocks.*.attn.*", "blocks.*.img_mlp.*", "blocks.*.txt_mlp.*")
    conditioning = QwenImageCond
    guidance = TrueCFG()
    # ComfyUI's LoRA keys: diffusers' under diffusion_model.; its single files: that prefix dropped, fp8
    # files refused
    # its single file (ComfyUI's prefix dropped, nothing fused) read by name, each rank its own rows
    names = Names(
        from_original=diffusers_state_dict_from_original,
        renames_only=True,
        lora_formats=("diffusers", "comfyui"),
    )

    def widths(self, cfg) -> list:
        t, vae, text = self.transformer_config(cfg), config_of(cfg, "vae"), config_of(cfg, "text_encoder")
        latent = vae.get("z_dim") and vae["z_dim"] * 4
        return [("in_channels", t.get("in_channels"), "the VAE's z_dim x 4 (packed 2 x 2)", latent),
                ("joint_attention_dim", t.get("joint_attention_dim"), "the text encoder's hidden_size",
                 text.get("hidden_size"))]  # fmt: skip

    def vae_scale(self, cfg) -> int:
        config = read_json(part_folder(cfg, "vae") / "config.json")
        return 2 ** len(config.get("temperal_downsample", [False, True, True]))  # the pipeline's rule

    def check_scheduler(self, config: dict) -> None:
        self.refuse_scheduler(config, [])
        sigmas(2, 16, config)  # a setting the schedule does not reproduce is refused by name

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        self.check_image_size(frames, height, width, 2 * self.vae_scale(cfg))  # the VAE's stride, then 2 x 2

    def build(self, config: dict, cfg):
        return build_transformer(config, cfg.model.attention_backend)

    def config_of_file(self, shapes: dict) -> dict:
        """The release's layout read from the shapes: heads of 128 split 16 / 56 / 56 for the 3-axis rope."""
        shapes = self.names.from_original(shapes)
        needed = (
            "transformer_blocks.0.attn.norm_q.weight",
            "img_in.weight",
            "txt_in.weight",
            "proj_out.weight",
        )
        missing = [key for key in needed if key not in shapes]
        if missing:
            raise ValueError(f"model.pretrained is not a Qwen-Image transformer file: it has no {missing[0]}")
        head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
        if head != 128:
            return super().config_of_file(shapes)  # the rope's split of another head size is not in the file
        hidden = shapes["img_in.weight"][0]
        depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("transformer_blocks."))
        return dict(
            _class_name=TRANSFORMER_CLASS,
            patch_size=2,
            in_channels=shapes["img_in.weight"][1],
            out_channels=shapes["proj_out.weight"][0] // 4,
            num_layers=depth,
            attention_head_dim=head,
            num_attention_heads=hidden // head,
            joint_attention_dim=shapes["txt_in.weight"][1],
            axes_dims_rope=(16, 56, 56),
        )

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> Components:
        from diffusers import AutoencoderKLQwenImage
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        transformer = self.load_transformer(cfg, dtype, keep) if transformer else None
        encoder = None
        if texts:
            folder = part_folder(cfg, "text_encoder")
            encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, torch_dtype=dtype)
        vae = AutoencoderKLQwenImage.from_pretrained(part_folder(cfg, "vae"), torch_dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(part_folder(cfg, "tokenizer"))
        scheduler = read_json(part_folder(cfg, "scheduler") / "scheduler_config.json")
        encoder, vae = (m and m.eval().to(device).requires_grad_(False) for m in (encoder, vae))
        transformer = transformer and transformer.to(device)  # load_transformer's: frozen already
        return Components(transformer, tokenizer, encoder, vae, scheduler or RELEASE_SCHEDULER)

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """diffusers' train_dreambooth_lora_qwen_image.py: (z - latents_mean) / latents_std."""
        z = parts.vae.encode(images.to(parts.vae.dtype)).latent_dist.mode()
        return normalize_latents(z.float(), parts.vae.config)

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        return QwenImageCond(*encode_prompt(prompts, parts.tokenizer, parts.text_encoder, max_length))
