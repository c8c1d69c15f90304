"""LTX-2's audio front end for training: a clip's waveform -> the normalised audio latents its transformer
learns, as Lightricks' trainer makes them (ltx-trainer process_videos.py _encode_audio, ltx-core audio_vae
AudioProcessor and AudioEncoder, commit 400fd31): stereo; log-mel of |STFT| (Hann, center, reflect), Slaney
mel bins from 0 to sample_rate / 2; the audio VAE's posterior mode, normalised per packed C_a M entry.
Differences from that code (theirs -> here): the mel in the VAE's dtype (float32 in their trainer) ->
always float32; their 5.1 / 7.1 downmix and other layouts' mean -> the loader's (data/media.py
mix_channels); the clip cut to int(seconds x source rate) samples, then resampled -> data/media.py
read_audio's round(seconds x rate) (at most a sample apart).
"""

import torch
from diffusers.models.autoencoders.autoencoder_mmaudio import mel_filterbank


def stereo(waveform):
    """(B, 1 or 2, samples) -> (B, 2, samples): mono duplicated. The loader mixes a clip's other layouts
    down to the family's two channels first, as Lightricks' trainer does (data/media.py mix_channels)."""
    if waveform.ndim != 3 or waveform.shape[1] not in (1, 2):
        raise ValueError(
            f"a waveform is (batch, 1 or 2 channels, samples); got {tuple(waveform.shape)} (data/media.py "
            "mix_channels mixes other layouts down to stereo)"
        )
    return waveform.expand(-1, 2, -1)  # mono: the same channel twice (a view; stereo: itself)


def log_mel(waveform, sample_rate: int, hop: int, mel_bins: int, n_fft: int = 1024):
    """(B, channels, samples) float in [-1, 1] at `sample_rate` -> (B, 2, T_mel, mel_bins) float32, T_mel =
    samples // hop + 1: log(max(mel, 1e-5)) of the magnitude STFT (n_fft window and FFT, Hann, centred with
    reflect padding) through Slaney-normalised Slaney mel filters over 0 to sample_rate / 2."""
    wave = stereo(waveform).float()
    batch, channels, samples = wave.shape
    window = torch.hann_window(n_fft, device=wave.device)  # periodic, as torch.hann_window gives theirs
    spec = torch.stft(
        wave.reshape(batch * channels, samples),
        n_fft,
        hop_length=hop,
        win_length=n_fft,
        window=window,
        center=True,
        pad_mode="reflect",
        return_complex=True,
    ).abs()  # power 1: the magnitude, (B 2, n_fft // 2 + 1, T_mel)
    filters = mel_filterbank(sample_rate, n_fft, mel_bins, 0.0, sample_rate / 2).to(wave.device)
    mel = torch.einsum("mf,nft->ntm", filters, spec)
    return torch.log(mel.clamp(min=1e-5)).reshape(batch, channels, -1, mel_bins)


@torch.no_grad()
def encode_sound(audio_vae, waveform):
    """(B, channels, samples) float at the VAE's sample rate -> the normalised latents (B, C_a, L, M)
    float32, in LTX2Layout.split's audio layout: the posterior's mode, normalised per entry of the packed
    (L, C_a M) channel-major row, (x - latents_mean) / latents_std, which LTX2Steps.decode_audio inverts."""
    config = audio_vae.config
    device = audio_vae.latents_mean.device
    # n_fft: the diffusers config does not carry it; every LTX-2 release uses Lightricks' default 1024
    mel = log_mel(waveform.to(device), config.sample_rate, config.mel_hop_length, config.mel_bins)
    mode = audio_vae.encode(mel.to(audio_vae.dtype)).latent_dist.mode()  # (B, C_a, L, M)
    packed = mode.float().transpose(1, 2).flatten(2)  # (B, L, C_a M): the statistics' order
    mean, std = (s.to(device, torch.float32) for s in (audio_vae.latents_mean, audio_vae.latents_std))
    normalised = (packed - mean) / std
    return normalised.unflatten(2, (mode.shape[1], mode.shape[3])).transpose(1, 2).contiguous()


def latent_audio_frames(frames: int, fps: float, sample_rate: int, hop: int, compression: int = 4) -> int:
    """Audio latent frames L of a clip of `frames` video frames at `fps`: its round(frames / fps x
    sample_rate) samples (data/media.py read_audio's count) give samples // hop + 1 mel frames (a centred
    STFT of even n_fft), which the VAE's causal time axis turns into (T_mel - 1) // compression + 1."""
    samples = round(frames / fps * sample_rate)
    mel_frames = samples // hop + 1
    return (mel_frames - 1) // compression + 1
