"""VAE and text-encoder wrappers, including the real from_pretrained paths on models saved here."""

import pytest
import torch
from omegaconf import OmegaConf

from configs.schema import TextEncoderConfig, VAEConfig
from models.text_encoder import build_text_encoder
from models.vae import IdentityVAE, build_vae, vae_latent_space


def vae_cfg(**kw):
    return OmegaConf.structured(VAEConfig(**kw))


def text_cfg(**kw):
    return OmegaConf.structured(TextEncoderConfig(**kw))


def test_identity_latent_shape_and_errors():
    vae = IdentityVAE()
    assert vae.latent_shape(8, 32, 32, (2, 4, 4)) == (3, 8, 32, 32)
    with pytest.raises(ValueError, match=r"frames=7 .* try --frames 6 or 8"):
        vae.latent_shape(7, 32, 32, (2, 4, 4))
    with pytest.raises(ValueError, match=r"height=30 must be a multiple of 4.*try 28 or 32"):
        vae.latent_shape(8, 30, 32, (2, 4, 4))


def test_causal_video_vae_frame_rule():
    space = vae_latent_space(vae_cfg(kind="wan"))
    assert (space.temporal_stride, space.spatial_stride, space.causal) == (4, 8, True)
    assert space.latent_shape(9, 32, 32) == (4, 3, 4, 4)
    with pytest.raises(ValueError, match=r"1 \+ k\*4 frames.*try --frames 21 or 25"):
        space.latent_shape(24, 32, 32)


@pytest.mark.parametrize("kind, frames", [("wan", 9), ("kl", 2)])
def test_tiny_vae_round_trip_shapes_and_from_pretrained(kind, frames, tmp_path):
    vae = build_vae(vae_cfg(kind=kind))
    x = torch.rand(1, 3, frames, 32, 32) * 2 - 1
    z = vae.encode(x)
    assert tuple(z.shape[1:]) == vae.latent_shape(frames, 32, 32)
    assert vae.decode(z).shape == x.shape
    # the same random VAE in every process: built from the seed alone
    assert torch.equal(build_vae(vae_cfg(kind=kind)).encode(x), z)
    # the real loading code, on a model saved locally
    vae.vae.save_pretrained(tmp_path / "vae")
    loaded = build_vae(vae_cfg(kind=kind, pretrained=str(tmp_path / "vae")))
    assert torch.allclose(loaded.encode(x), z, atol=1e-6)
    assert vae_latent_space(vae_cfg(kind=kind, pretrained=str(tmp_path / "vae"))).latent_shape(
        frames, 32, 32
    ) == tuple(z.shape[1:])


def test_missing_pretrained_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local folder; tessera never downloads"):
        build_vae(vae_cfg(kind="kl", pretrained=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        build_text_encoder(text_cfg(pretrained="google/t5-v1_1-xxl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_text_encoder(text_cfg(pretrained=str(tmp_path / "empty")))


def test_text_encoder_masks_and_caches(tmp_path):
    encoder = build_text_encoder(text_cfg(max_length=16))
    emb, mask = encoder(["a red square", "", "a red square"])
    assert emb.shape == (3, 16, encoder.dim) and mask.shape == (3, 16)
    assert mask[0].sum() == len("a red square") + 1  # bytes + end-of-sequence
    assert mask[1].sum() == 1
    assert torch.equal(emb[0], emb[2])
    assert len(encoder._cache) == 2
    # every process builds the same tiny random encoder from the seed
    assert torch.equal(build_text_encoder(text_cfg(max_length=16))(["a red square"])[0][0], emb[0])


def test_text_encoder_from_pretrained(tmp_path):
    encoder = build_text_encoder(text_cfg(max_length=16))
    encoder.model.save_pretrained(tmp_path / "t5")
    encoder.tokenizer.save_pretrained(tmp_path / "t5")
    loaded = build_text_encoder(text_cfg(max_length=16, pretrained=str(tmp_path / "t5")))
    prompts = ["a blue circle moving up", "x"]
    assert torch.allclose(loaded(prompts)[0], encoder(prompts)[0], atol=1e-6)
