"""HunyuanVideo 1.5's transformer (models/hunyuan_video15/) against diffusers'
HunyuanVideo15Transformer3DModel, code no one here wrote: a tiny random config, the same weights, padded
texts and glyph texts of other lengths, text-to-video (no image tokens here, diffusers' zero image masked
out) and image-to-video."""

import pytest
import torch

from models.hunyuan_video15.transformer import HunyuanVideo15Cond
from models.hunyuan_video15.weights import (
    HunyuanVideo15FormatError,
    build_transformer,
    diffusers_state_dict_from_tessera,
    tessera_state_dict_from_diffusers,
)

# a diffusers config of a tiny transformer (weights.py reads it)
TINY = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)


def tiny_pair():
    """(diffusers' transformer, tessera's built from its config by weights.py) with the same random weights,
    float32."""
    from diffusers import HunyuanVideo15Transformer3DModel

    theirs = HunyuanVideo15Transformer3DModel(**TINY).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    ours = build_transformer(dict(theirs.config)).eval()
    ours.load_state_dict(tessera_state_dict_from_diffusers(theirs.state_dict()), strict=True)
    return theirs, ours


@torch.no_grad()
@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_transformer_matches_diffusers(task):
    """The velocity of both at a 2 x 3 x 5 token grid (non-square), two samples at timesteps 750 and 250,
    Qwen texts of 7 tokens (one padded to 3 real), glyph texts of 5 (one padded to 2 real)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs, ours = tiny_pair()
        x = torch.randn(2, 9, 2, 3, 5)
        text, glyph = torch.randn(2, 7, 24), torch.randn(2, 5, 20)
        image = torch.randn(2, 3, 12) if task == "i2v" else torch.zeros(2, 3, 12)
    text_mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    glyph_mask = torch.tensor([[1, 1, 0, 0, 0], [1] * 5])
    t = torch.tensor([0.75, 0.25])
    want = theirs(
        hidden_states=x,
        timestep=t * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=image,
        return_dict=False,
    )[0]
    given = image if task == "i2v" else None  # text-to-video: diffusers' zeros are masked out
    cond = HunyuanVideo15Cond(text, text_mask.bool(), glyph, glyph_mask.bool(), given)
    got = ours(x, t, cond)
    diff = float((got - want).abs().max())
    print(f"{task}: max abs {diff:.2e}, output std {float(want.std()):.3f}")
    assert got.shape == want.shape == (2, 4, 2, 3, 5) and want.std() > 0.1
    assert diff <= 1e-5


def test_weight_names_and_config():
    """diffusers' names round-trip through tessera's; a config this transformer does not run is refused."""
    from diffusers import HunyuanVideo15Transformer3DModel

    theirs = HunyuanVideo15Transformer3DModel(**TINY)
    ours = build_transformer(dict(theirs.config))
    assert set(diffusers_state_dict_from_tessera(ours.state_dict())) == set(theirs.state_dict())
    assert any(k.startswith("blocks.1.") for k in ours.state_dict())
    for wrong, words in [(dict(use_meanflow=True), "use_meanflow"), (dict(qk_norm="layer_norm"), "qk_norm")]:
        with pytest.raises(HunyuanVideo15FormatError, match=words):
            build_transformer({**dict(theirs.config), **wrong})
