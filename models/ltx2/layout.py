"""Where a sampling's latents sit in the one flat tensor the generic loop carries (LTX2Layout): the packed
video, then the packed audio, as LTX2Pipeline packs them. A sampling records it (LTX2Steps.noise), and so
does a distillation's student (models/ltx2/training.py), whose samples are both streams."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LTX2Layout:
    """Where a sampling's latents sit in the flat (B, D) tensor: the packed video (N = T H W tokens of C,
    (t, h, w) order, channels fastest), then the packed audio (L frames of C_a M, channel-major), as the
    pipeline packs them."""

    grid: tuple  # (T, H, W) latents
    channels: int
    audio_frames: int  # L
    audio_channels: int
    mel_bins: int  # latent mel bins M
    given: bool = False  # image-to-video: the first latent frame is the given image's, kept as it is

    @property
    def video_size(self) -> int:
        return self.channels * math.prod(self.grid)

    @property
    def size(self) -> int:
        return self.video_size + self.audio_frames * self.audio_channels * self.mel_bins

    def split(self, x) -> tuple:
        """(B, D) -> video (B, C, T, H, W), audio (B, C_a, L, M) (views)."""
        video = x[:, : self.video_size].unflatten(1, (-1, self.channels)).transpose(1, 2)
        audio = x[:, self.video_size :].unflatten(1, (self.audio_frames, self.audio_channels, self.mel_bins))
        return video.unflatten(2, self.grid), audio.transpose(1, 2)

    def join(self, video, audio):
        """split's inverse: (B, C, T, H, W), (B, C_a, L, M) -> (B, D)."""
        packed = video.flatten(2).transpose(1, 2).flatten(1), audio.transpose(1, 2).flatten(1)
        return torch.cat(packed, dim=1)
