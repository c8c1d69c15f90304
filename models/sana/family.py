"""Sana as a tessera family (models/family.py): a diffusers SanaPipeline folder's transformer, Gemma-2
text encoder and DC-AE; the prompt with the complex human instruction, padded to
text_encoder.max_length (the pipeline's max_sequence_length); DPM-Solver++ over flow sigmas; classic
classifier-free guidance.
"""

import torch

from models.family import Components, Family, config_of, part_folder, read_json
from models.loop import Schedule
from models.names import Names
from models.sana.sampling import RELEASE_SCHEDULER, denormalize_latents, dpm_solver_step, flow_schedule
from models.sana.text import COMPLEX_HUMAN_INSTRUCTION, encode_text
from models.sana.transformer import SanaConditioning
from models.sana.weights import SanaFormatError, build_sana, diffusers_from_original
from models.steps import Steps, seeded_noise


def from_original(state: dict) -> dict:
    """NVlabs' names (fused qkv and kv, split as diffusers' are), or diffusers' already (any prefix of
    ComfyUI's dropped)."""
    bare = {key.removeprefix("model.diffusion_model."): value for key, value in state.items()}
    if any(key.startswith(("transformer_blocks.", "caption_projection.")) for key in bare):
        return bare
    return diffusers_from_original(state)


def dpm_solver(sigmas):
    def step(x, v, i, previous):
        return dpm_solver_step(x, v.float(), sigmas, i, previous)

    return step


class SanaSteps(Steps):
    """Its pipeline's noise, DPM-Solver schedule, float32 guidance and decoding."""

    def noise(self, parts: Components, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """What the pipeline draws from a generator seeded with seed, one image each (C, 1, h, w)."""
        scale = 2 ** (len(parts.vae.config.encoder_block_out_channels) - 1)
        shape = (parts.transformer.in_channels, 1, height // scale, width // scale)
        return seeded_noise(seeds, shape)

    def schedule(self, parts: Components, steps: int, latents: torch.Tensor) -> Schedule:
        config = parts.scheduler_config
        found = flow_schedule(steps, config["flow_shift"], config["num_train_timesteps"])
        levels = found.sigmas.to(latents.device)
        return Schedule(levels, found.timesteps.to(latents.device), dpm_solver(levels))

    def prediction(self, v):
        return v.float()  # the pipeline guides in float32

    def decode(self, parts: Components, latents) -> torch.Tensor:
        z = denormalize_latents(latents[:, :, 0].to(parts.vae.dtype), parts.vae.config.scaling_factor)
        return parts.vae.decode(z).sample.unsqueeze(2)  # (B, 3, 1, H, W)


class Sana(Family):
    name, title = "sana", "Sana"
    steps = SanaSteps()
    pipeline_classes, transformer_classes = ("SanaPipeline",), ("SanaTransformer2DModel",)
    # every degree: exact under any sequence split
    vae_class, max_length = "AutoencoderDC", 300
    lora_targets = ("blocks.*.attn1.*", "blocks.*.attn2.*")  # its feed-forward is convolutions
    conditioning = SanaConditioning
    names = Names(from_original=from_original)

    def widths(self, cfg) -> list:
        t, vae, text = self.transformer_config(cfg), config_of(cfg, "vae"), config_of(cfg, "text_encoder")
        latent, hidden = vae.get("latent_channels"), text.get("hidden_size")
        return [
            ("in_channels", t.get("in_channels"), "the DC-AE's latent_channels", latent),
            ("caption_channels", t.get("caption_channels"), "the text encoder's hidden_size", hidden),
        ]

    def vae_scale(self, cfg) -> int:
        config = read_json(part_folder(cfg, "vae") / "config.json")
        return 2 ** (len(config.get("encoder_block_out_channels", [0] * 6)) - 1)  # the pipeline's rule

    def check_scheduler(self, config: dict) -> None:
        """The folder's scheduler must be the release's (DPM-Solver++(2M) over flow sigmas); its flow_shift
        and num_train_timesteps may differ (the 4K model shifts by 6)."""
        fixed = {k: v for k, v in RELEASE_SCHEDULER.items() if k not in ("flow_shift", "num_train_timesteps")}
        fixed.update(_class_name="DPMSolverMultistepScheduler", use_karras_sigmas=False, variance_type=None)
        differ = [f"{k}={config.get(k)!r}" for k, v in fixed.items() if config and config.get(k, v) != v]
        if config and "use_flow_sigmas" not in config or differ:
            raise SanaFormatError(
                "tessera samples Sana with the release's scheduler (DPM-Solver++(2M) over flow sigmas); the "
                f"folder's scheduler_config.json has {', '.join(differ) or 'no use_flow_sigmas'}"
            )

    def heads(self, cfg):
        return None  # linear attention sums over tokens: Ulysses splits tokens, never heads

    def check_split(self, cfg, height: int, width: int, ulysses: int, ring: int) -> None:
        scale, ranks = self.vae_scale(cfg), ulysses * ring
        h, w = height // scale, width // scale
        if ranks > 1 and -(-h * w // ranks) < w + 1:  # HaloGridConv: neighbours from adjacent ranks only
            raise ValueError(
                f"Sana at {height} x {width} has {h} x {w} tokens: over {ranks} sequence-parallel ranks each "
                f"holds fewer than a row and one ({w + 1}) for its convolution; use fewer ranks or a larger "
                "size"
            )

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        self.check_image_size(frames, height, width, self.vae_scale(cfg), " (its DC-AE's stride)")

    def build(self, config: dict, cfg):
        return build_sana(config)

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> Components:
        from diffusers import AutoencoderDC
        from transformers import AutoModel, AutoTokenizer

        transformer = self.load_transformer(cfg, dtype, keep) if transformer else None
        encoder = (
            AutoModel.from_pretrained(part_folder(cfg, "text_encoder"), torch_dtype=dtype) if texts else None
        )
        vae = AutoencoderDC.from_pretrained(part_folder(cfg, "vae"), torch_dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(part_folder(cfg, "tokenizer"))
        scheduler = read_json(part_folder(cfg, "scheduler") / "scheduler_config.json")
        scheduler = {**RELEASE_SCHEDULER, **scheduler}  # checked in check_pretrained
        encoder, vae = (m and m.eval().to(device).requires_grad_(False) for m in (encoder, vae))
        transformer = transformer and transformer.to(device)  # load_transformer's: frozen already
        return Components(transformer, tokenizer, encoder, vae, scheduler)

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """diffusers' train_dreambooth_lora_sana.py: the DC-AE's latent times its scaling_factor."""
        z = parts.vae.encode(images[:, :, 0].to(parts.vae.dtype)).latent
        return (z.float() * parts.vae.config.scaling_factor).unsqueeze(2)

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        instruction = None if negative else COMPLEX_HUMAN_INSTRUCTION  # the pipeline's formatting
        text = encode_text(parts.tokenizer, parts.text_encoder, prompts, max_length, instruction)
        return SanaConditioning(*text)

    def load_conditioning(self, stored: list, max_length: int):
        """The pipeline pads every prompt to max_length, with a 0/1 mask of its tokens. The padded keys are
        masked (a -10000 bias: a weight of exactly 0), so their values (zeros here, Gemma-2's output
        there) change nothing."""
        text = stored[0]["text"].new_zeros(len(stored), max_length, stored[0]["text"].shape[-1])
        mask = torch.zeros(len(stored), max_length, dtype=torch.int64)
        for i, s in enumerate(stored):
            text[i, : len(s["text"])], mask[i, : len(s["text"])] = s["text"], 1
        return SanaConditioning(text, mask)
