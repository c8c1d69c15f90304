"""models/ltx2/audio.py against code no one here wrote: transformers' numpy audio_utils for the log-mel,
diffusers' AutoencoderKLLTX2Audio called directly for the latents, tessera's LTX2Steps.decode_audio for the
inverse of their normalisation."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from models.ltx2.audio import encode_sound, latent_audio_frames, log_mel
from models.ltx2.family import LTX2, LTX2Layout, LTX2Parts

RATE, HOP, BINS = 16000, 160, 64  # the release's audio VAE config


def chirps(seconds: float = 0.7, rate: int = RATE) -> torch.Tensor:
    """(1, 2, samples): left a 100 Hz -> 6 kHz chirp, right two tones (440 Hz, 3 kHz); 0.1 s of silence in
    the middle so the 1e-5 floor of the log is reached."""
    t = np.arange(round(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * (100 * t + (6000 - 100) / (2 * seconds) * t**2))
    right = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)
    wave = np.stack([left, right])
    wave[:, round(0.3 * rate) : round(0.4 * rate)] = 0.0
    return torch.from_numpy(wave).float()[None]


def reference_mel(wave: torch.Tensor, rate: int = RATE, hop: int = HOP, bins: int = BINS) -> np.ndarray:
    """transformers' log-mel of (B, 2, samples): (B, 2, T, bins), float64."""
    filters = mel_filter_bank(
        num_frequency_bins=513,
        num_mel_filters=bins,
        min_frequency=0.0,
        max_frequency=rate / 2,
        sampling_rate=rate,
        norm="slaney",
        mel_scale="slaney",
    )
    window = window_function(1024, "hann")
    settings = dict(
        power=1.0, center=True, pad_mode="reflect", mel_floor=1e-5, log_mel="log", dtype=np.float64
    )
    mels = [
        [spectrogram(c, window, 1024, hop, mel_filters=filters, **settings) for c in clip]
        for clip in wave.double().numpy()
    ]
    return np.array(mels).transpose(0, 1, 3, 2)  # log(max(mel, 1e-5)), (B, 2, T, bins)


class Vocoder:
    """decode_audio's vocoder, reduced to what it reads: a dtype, an output rate, mel -> waveform."""

    dtype, config = torch.float32, SimpleNamespace(output_sampling_rate=RATE)

    def __call__(self, mel):
        return mel[:, :, 0]


@pytest.fixture(scope="module")
def audio_vae():
    """A tiny audio VAE at the release's mel settings (64 bins -> 16 latent bins of 2 channels), random
    weights, statistics that are not the identity."""
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(
        base_channels=32, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=2, mel_bins=BINS
    ).eval()
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(32) * 0.5)
        vae.latents_std.copy_(torch.rand(32) + 0.5)
    return vae


def test_log_mel_matches_transformers():
    wave = chirps()
    ours, theirs = log_mel(wave, RATE, HOP, BINS), reference_mel(wave)
    assert ours.dtype == torch.float32 and ours.shape == (1, 2, wave.shape[-1] // HOP + 1, BINS)
    assert theirs.min() == pytest.approx(np.log(1e-5))  # the silence reached the floor
    diff = np.abs(ours.double().numpy() - theirs)
    loud = theirs > np.log(1e-3)  # 100 x the floor and more
    print(f"log_mel max abs diff {diff.max():.3g}, {diff[loud].max():.3g} where mel > 1e-3")
    assert diff[loud].max() <= 1e-4  # a relative error of 1e-4 in the mel
    # near the floor a float32 STFT (theirs in torchaudio is float32 too) rounds a mel of 1e-5 to ~0.5%
    # (4e-3 on the environment of 2026-11; 5.4e-3 with numpy 2.4.6 and transformers 5.25.0)
    assert diff.max() <= 1e-2


def test_mono_is_its_duplicated_stereo():
    """Mono is its duplicated stereo; more channels are the loader's to mix down (refused here by name)."""
    wave = chirps()
    mono = wave[:, :1]
    assert torch.equal(log_mel(mono, RATE, HOP, BINS), log_mel(mono.repeat(1, 2, 1), RATE, HOP, BINS))
    assert not torch.equal(log_mel(wave, RATE, HOP, BINS)[:, 0], log_mel(wave, RATE, HOP, BINS)[:, 1])
    with pytest.raises(ValueError, match="mix_channels"):
        log_mel(torch.cat([wave, wave], dim=1), RATE, HOP, BINS)
    with pytest.raises(ValueError, match="batch, 1 or 2 channels, samples"):
        log_mel(wave[0], RATE, HOP, BINS)


def test_encode_sound_matches_the_vae_and_decode_audio_inverts_it(audio_vae):
    wave = torch.cat([chirps(), chirps().flip(-1)])  # two different clips
    ours = encode_sound(audio_vae, wave)
    with torch.no_grad():
        mel = torch.from_numpy(reference_mel(wave)).float()
        mode = audio_vae.encode(mel).latent_dist.mode()  # (B, C_a, L, M)
        own_mode = audio_vae.encode(log_mel(wave, RATE, HOP, BINS)).latent_dist.mode()
    batch, channels, frames, bins = mode.shape
    packed = mode.permute(0, 2, 1, 3).reshape(batch, frames, channels * bins)  # the pipeline's packing
    expected = ((packed - audio_vae.latents_mean) / audio_vae.latents_std).reshape(
        batch, frames, channels, bins
    )
    expected = expected.permute(0, 2, 1, 3)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    print(f"encode_sound max abs diff {diff:.3g} (latents std {expected.std():.3g})")
    assert diff <= 3e-4  # the float32 mels differ by up to 4e-3 near the floor (above); it carries through

    # tessera's sampling denormalises and decodes the packed latents: it must find the posterior's mode
    seen = []
    spy = SimpleNamespace(
        latents_mean=audio_vae.latents_mean,
        latents_std=audio_vae.latents_std,
        dtype=torch.float32,
        decode=lambda z, return_dict: seen.append(z) or (torch.zeros(1, 2, 8, BINS),),
    )
    layout = LTX2Layout(
        grid=(1, 1, 1), channels=1, audio_frames=frames, audio_channels=channels, mel_bins=bins
    )
    parts = LTX2Parts(None, None, None, None, audio_vae=spy, vocoder=Vocoder(), layout=layout)
    flat = layout.join(torch.zeros(batch, 1, 1, 1, 1), ours)
    LTX2().steps.decode_audio(parts, flat)
    back = torch.cat(seen)
    inverse = (back - own_mode).abs().max().item()  # the mode of log_mel's mel: the round trip alone
    print(
        f"decode_audio(encode_sound) vs mode max abs diff {inverse:.3g} (mode's max {mode.abs().max():.3g})"
    )
    assert inverse <= 1e-5 * mode.abs().max()


@pytest.mark.parametrize("frames, fps", [(9, 24), (17, 24), (121, 24), (25, 25)])
def test_latent_audio_frames_is_the_encoded_length(audio_vae, frames, fps):
    samples = round(frames / fps * RATE)
    encoded = encode_sound(audio_vae, torch.zeros(1, 2, samples)).shape[2]
    assert latent_audio_frames(frames, fps, RATE, HOP) == encoded


def test_latent_audio_frames_of_the_release():
    assert latent_audio_frames(121, 24, 16000, 160, 4) == 127  # round(80666.7) = 80667 samples, 505 mels
    assert latent_audio_frames(121, 24, 16000, 160, 4) != round(121 / 24 * 16000 / 160 / 4)  # sampling's 126
