"""VAEs that map pixels (B, 3, T, H, W) in [-1, 1] to normalised latents (B, C, t, h, w) and back,
and the latent-shape arithmetic: which pixel sizes a VAE and a patch size can represent.

- `IdentityVAE`: pixel space (the demo).
- `DiffusersVAE` over `AutoencoderKL` (images; a video is encoded frame by frame) or
  `AutoencoderKLWan` (causal video VAE: frames = 1 + k * temporal stride).
Pretrained VAEs load from a local folder with diffusers' `from_pretrained`; nothing is downloaded.
"""

import math
import os
from pathlib import Path

import torch
import torch.nn as nn

from models.util import seeded

# Decode tiles (models/tiling.py), in latent pixels: the recipe's defaults (configs/schema.py VAEConfig).
# 32 / 8 is diffusers' AutoencoderKLWan tiling: Wan's 480 x 832 latent (60 x 104) becomes 3 x 4 = 12 tiles.
DEFAULT_TILE = 32
DEFAULT_OVERLAP = 8


class LatentSpace(nn.Module):
    """Shape arithmetic shared by every VAE."""

    latent_channels: int = 3
    temporal_stride: int = 1
    spatial_stride: int = 1
    causal: bool = False  # a causal video VAE keeps the first frame alone: frames = 1 + k * stride
    tile_latent: int = DEFAULT_TILE  # the decode tiles generate() uses (the recipe's: build_frozen)
    tile_overlap: int = DEFAULT_OVERLAP

    def latent_frames(self, frames: int) -> int:
        return 1 + (frames - 1) // self.temporal_stride if self.causal else frames // self.temporal_stride

    def valid_frames(self, frames: int) -> bool:
        if frames < 1:
            return False
        return (frames - 1) % self.temporal_stride == 0 if self.causal else frames % self.temporal_stride == 0

    def latent_shape(
        self, frames: int, height: int, width: int, patch_size=(1, 1, 1)
    ) -> tuple[int, int, int, int]:
        """(C, t, h, w) of the latent for a pixel video, or a ValueError naming what to ask for instead."""
        pt, ph, pw = patch_size
        problems = []
        frame_ok = [
            f
            for f in range(1, 4 * max(frames, 1) + 8 * self.temporal_stride * pt)
            if self.valid_frames(f) and self.latent_frames(f) % pt == 0
        ]
        if frames not in frame_ok:
            nearest = sorted(frame_ok, key=lambda f: (abs(f - frames), f))[:2]
            rule = f"1 + k*{self.temporal_stride}" if self.causal else f"a multiple of {self.temporal_stride}"
            problems.append(
                f"frames={frames} cannot be represented: the VAE needs {rule} frames and the latent "
                f"frame count must divide by the time patch {pt}; try --frames "
                f"{' or '.join(map(str, sorted(nearest)))}"
            )
        for name, size, p in (("height", height, ph), ("width", width, pw)):
            multiple = self.spatial_stride * p
            if size < multiple or size % multiple:
                lower, upper = max(multiple, size // multiple * multiple), (size // multiple + 1) * multiple
                options = sorted({lower, upper})
                problems.append(
                    f"{name}={size} must be a multiple of {multiple} (VAE stride {self.spatial_stride} x "
                    f"patch {p}); try {' or '.join(map(str, options))}"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return (
            self.latent_channels,
            self.latent_frames(frames),
            height // self.spatial_stride,
            width // self.spatial_stride,
        )


class IdentityVAE(LatentSpace):
    """Pixel space: the latent is the video itself."""

    def encode(self, x):
        return x

    def decode(self, z):
        return z


def latent_space(kind: str, config) -> LatentSpace:
    """The shape arithmetic of a VAE from its config alone (no weights are read)."""
    space = LatentSpace()
    if kind == "kl":
        space.latent_channels = config["latent_channels"]
        space.spatial_stride = 2 ** (len(config["block_out_channels"]) - 1)
    elif kind == "wan":
        space.latent_channels = config["z_dim"]
        # Wan2.2's 48-channel VAE folds 2 x 2 pixels into channels first (patch_size 2): stride 16
        # (computed from the architecture, which the encoder follows, not from scale_factor_spatial)
        space.spatial_stride = 2 ** len(config["temperal_downsample"]) * (config.get("patch_size") or 1)
        space.temporal_stride = 2 ** sum(bool(d) for d in config["temperal_downsample"])
        space.causal = True
    elif kind != "identity":
        raise ValueError(f"unknown VAE kind '{kind}'")
    return space


class DiffusersVAE(LatentSpace):
    """A frozen diffusers VAE with latent normalisation (z - mean) / std applied inside encode/decode."""

    def __init__(self, vae: nn.Module, kind: str):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        self.kind = kind
        cfg = vae.config
        space = latent_space(kind, cfg)
        self.latent_channels, self.spatial_stride = space.latent_channels, space.spatial_stride
        self.temporal_stride, self.causal = space.temporal_stride, space.causal
        if kind == "kl":
            mean = torch.full((cfg.latent_channels,), float(getattr(cfg, "shift_factor", None) or 0.0))
            std = torch.full((cfg.latent_channels,), 1.0 / float(cfg.scaling_factor))
        else:
            mean, std = torch.tensor(cfg.latents_mean), torch.tensor(cfg.latents_std)
        self.register_buffer("latents_mean", mean.view(1, -1, 1, 1, 1).float(), persistent=False)
        self.register_buffer("latents_std", std.view(1, -1, 1, 1, 1).float(), persistent=False)

    @torch.no_grad()
    def encode(self, x):
        x = x.to(self.vae.dtype)
        if self.kind == "kl":  # an image VAE: fold frames into the batch
            B, C, T, H, W = x.shape
            z = self.vae.encode(x.transpose(1, 2).reshape(B * T, C, H, W)).latent_dist.mode()
            z = z.view(B, T, *z.shape[1:]).transpose(1, 2)
        else:
            z = self.vae.encode(x).latent_dist.mode()
        return (z.float() - self.latents_mean) / self.latents_std

    @torch.no_grad()
    def decode(self, z):
        z = (z.float() * self.latents_std + self.latents_mean).to(self.vae.dtype)
        if self.kind == "kl":
            B, C, T, h, w = z.shape
            x = self.vae.decode(z.transpose(1, 2).reshape(B * T, C, h, w)).sample
            return x.view(B, T, *x.shape[1:]).transpose(1, 2).float()
        return self.vae.decode(z).sample.float()


def tiny_vae_module(kind: str, base_dim: int, latent_channels: int) -> nn.Module:
    """A small random diffusers VAE (about 0.2-0.5M parameters) for the demo and tests."""
    if kind == "kl":
        from diffusers import AutoencoderKL

        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=latent_channels,
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(base_dim,) * 3,
            layers_per_block=1,
            norm_num_groups=min(8, base_dim),
        )
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=latent_channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    )


def _pretrained_folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"vae.pretrained='{path}' is not a local folder; tessera never downloads weights: "
            f"save the VAE with save_pretrained() (or download it yourself) and point to that folder"
        )
    if (folder / "vae" / "config.json").is_file():  # a whole pipeline folder works too
        folder = folder / "vae"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"vae.pretrained='{path}' has no config.json; is it a diffusers VAE folder?")
    return folder


def load_pretrained_vae(kind: str, path: str) -> nn.Module:
    folder = _pretrained_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if kind == "kl":
        from diffusers import AutoencoderKL as cls
    else:
        from diffusers import AutoencoderKLWan as cls
    return cls.from_pretrained(folder, local_files_only=True)


def build_vae(vae_cfg) -> LatentSpace:
    if vae_cfg.kind == "identity":
        return IdentityVAE()
    if vae_cfg.pretrained:
        module = load_pretrained_vae(vae_cfg.kind, vae_cfg.pretrained)
    else:
        with seeded(vae_cfg.seed):
            module = tiny_vae_module(vae_cfg.kind, vae_cfg.tiny_base_dim, vae_cfg.tiny_latent_channels)
    return DiffusersVAE(module, vae_cfg.kind)


def vae_latent_space(vae_cfg) -> LatentSpace:
    """The recipe's VAE shape arithmetic without building the VAE: requests are checked first."""
    if vae_cfg.kind == "identity":
        return IdentityVAE()
    if vae_cfg.pretrained:
        folder = _pretrained_folder(vae_cfg.pretrained)
        import json

        with open(folder / "config.json") as f:
            return latent_space(vae_cfg.kind, json.load(f))
    if vae_cfg.kind == "kl":
        return latent_space(
            "kl", {"latent_channels": vae_cfg.tiny_latent_channels, "block_out_channels": [0] * 3}
        )
    return latent_space(
        "wan", {"z_dim": vae_cfg.tiny_latent_channels, "temperal_downsample": [False, True, True]}
    )


def num_tokens(latent_shape, patch_size) -> int:
    """Tokens after patchify of a latent (C, t, h, w)."""
    return math.prod(s // p for s, p in zip(latent_shape[1:], patch_size))
