"""tessera's DiT with the Wan options against diffusers' WanTransformer3DModel: code no one here wrote.

A tiny random diffusers model (every weight perturbed, so no zero-initialised layer hides a path) is
saved with save_pretrained, its safetensors read back, its keys mapped by models/dit/wan.py, and the two
forwards compared in float32. The same model under ulysses 2 and ring 2 is checked against the
one-process tessera forward in tests/sp_worker.py (WanDiT and WanI2V lines)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.dit.transformer import DiT, DiT_models, build_dit
from models.dit.wan import WanFormatError, dit_kwargs_from_diffusers_config, tessera_state_dict_from_diffusers
from models.layers import count_parameters

TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def saved_wan(tmp_path_factory):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("wan")
    model.save_pretrained(folder)
    return model.eval(), folder


def load_into_tessera(folder) -> DiT:
    config = json.loads((folder / "config.json").read_text())
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    model = DiT(**dit_kwargs_from_diffusers_config(config))
    model.load_state_dict(tessera_state_dict_from_diffusers(state), strict=True)
    return model.eval()


@pytest.mark.parametrize("frames, height, width", [(1, 8, 12), (3, 8, 8)], ids=["image", "video"])
def test_forward_equals_diffusers(saved_wan, frames, height, width):
    reference, folder = saved_wan
    model = load_into_tessera(folder)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, frames, height, width, generator=g)
    t = torch.rand(2, generator=g)
    y = torch.randn(2, 7, 16, generator=g)
    y_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    # diffusers is given what Wan's pipeline gives it: each prompt trimmed and zero-padded, no mask;
    # tessera gets the raw encoder output and the mask, and must zero the padding itself
    y_padded = y * y_mask.unsqueeze(-1)
    with torch.no_grad():
        expected = reference(x, t * 1000, y_padded, return_dict=False)[0]
        out = model(x, t, y, y_mask)
    assert out.shape == expected.shape
    assert relative_error(out, expected) <= 1e-5, relative_error(out, expected)
    # and the comparison can fail: one weight changed shows
    with torch.no_grad():
        model.blocks[1].scale_shift_table[0, 2, 0] += 0.5
        assert relative_error(model(x, t, y, y_mask), expected) > 1e-4


def test_model_size_auto_builds_dimensions_no_size_has(saved_wan):
    """A Wan folder whose depth, width and heads match no named size (a pruned or distilled variant; here
    2 heads of 12): model.size=auto builds its dimensions with Wan's options and reads its weights, and the
    forward is diffusers'."""
    from configs import load_config
    from models.dit.transformer import build_dit
    from models.dit.wan import WanWeights
    from parallel.build.components import fill_unsharded

    reference, folder = saved_wan
    cfg = load_config(
        Path(__file__).parents[1] / "configs" / "wan2.1-t2v-1.3b.yaml",
        ["model.size=auto", f"model.pretrained={folder}"],
    )
    assert (cfg.model.depth, cfg.model.hidden_size, cfg.model.num_heads, cfg.model.ffn_dim) == (2, 24, 2, 32)
    with torch.device("meta"):
        model = build_dit(cfg.model, in_channels=4, text_dim=16)
    fill_unsharded(model, 0, WanWeights(folder))
    g = torch.Generator().manual_seed(1)
    x, t, y = (
        torch.randn(1, 4, 1, 8, 12, generator=g),
        torch.rand(1, generator=g),
        torch.randn(1, 7, 16, generator=g),
    )
    with torch.no_grad():
        expected = reference(x, t * 1000, y, return_dict=False)[0]
        out = model.eval()(x, t, y, torch.ones(1, 7, dtype=torch.bool))
    assert relative_error(out, expected) <= 1e-5


def test_a_timestep_per_token_equals_diffusers(saved_wan):
    """Wan2.2 TI2V's expand_timesteps: t = 0 on the first frame's tokens and t elsewhere, as diffusers'
    WanTransformer3DModel takes a (B, N) timestep; it differs from one t for every token."""
    reference, folder = saved_wan
    model = load_into_tessera(folder)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 7, 16, generator=g)
    y_mask = torch.ones(2, 7, dtype=torch.bool)
    t = torch.rand(2, 1, generator=g).expand(2, 3 * 4 * 4).clone()
    t[:, :16] = 0  # the first latent frame's 4 x 4 tokens
    with torch.no_grad():
        expected = reference(x, t * 1000, y, return_dict=False)[0]
        out = model(x, t, y, y_mask)
        assert relative_error(out, expected) <= 1e-5, relative_error(out, expected)
        assert relative_error(model(x, t[:, -1], y, y_mask), expected) > 1e-3


def test_wan_sizes_match_diffusers_parameter_for_parameter():
    """The Wan2.1-1.3B size builds the same parameters, under the same shapes, as diffusers' config."""
    from diffusers import WanTransformer3DModel

    from configs import load_config

    config = dict(
        TINY_WAN,
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        ffn_dim=8960,
        num_layers=30,
    )
    with torch.device("meta"):
        reference = WanTransformer3DModel(**config)
        ours = build_dit(
            load_config(overrides=["model.size=Wan2.1-1.3B", "model.patch_size=[1,2,2]"]).model, 16, 4096
        )
    mapped = tessera_state_dict_from_diffusers(reference.state_dict())
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {
        k: tuple(v.shape) for k, v in ours.state_dict().items()
    }
    assert count_parameters(ours) == count_parameters(reference) == 1_418_996_800
    assert DiT_models["Wan2.1-14B"]["hidden_size"] == 5120 and DiT_models["Wan2.2-5B"]["ffn_dim"] == 14336


def test_recipe_options_override_the_size():
    from configs import load_config

    with torch.device("meta"):
        wan_zero = build_dit(
            load_config(overrides=["model.size=Wan2.1-1.3B", "model.adaln=zero"]).model, 16, 4096
        )
        default = build_dit(load_config(overrides=["model.size=DiT-S"]).model, 16, 4096)
    assert wan_zero.time_proj is None and hasattr(wan_zero.blocks[0], "adaLN_modulation")
    assert wan_zero.pooled_embedder is None and not wan_zero.text_mask  # the size's other options stay
    assert default.time_proj is None and default.pooled_embedder is not None and default.text_mask
    with pytest.raises(ValueError, match="model.adaln must be 'zero' or 'single', got 'sideways'"):
        build_dit(load_config(overrides=["model.adaln=sideways"]).model, 16, 4096)


@pytest.mark.parametrize("flf2v", [False, True], ids=["i2v", "flf2v"])
def test_image_to_video_forward_equals_diffusers(tmp_path, flf2v):
    """Wan2.1 I2V (image_dim, add_k_proj/add_v_proj, 4 + 4 extra input channels) and FLF2V (the two
    images' position embedding): a tiny random diffusers transformer, saved, read into tessera by its
    config and keys, and both forwards given the same CLIP features; then back to diffusers' keys."""
    from diffusers import WanTransformer3DModel

    from models.dit.wan import diffusers_config_from_dit, diffusers_state_dict_from_tessera

    image_tokens = 5
    config = dict(TINY_WAN, in_channels=12, out_channels=4, image_dim=20, added_kv_proj_dim=24)
    if flf2v:
        config["pos_embed_seq_len"] = 2 * image_tokens
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**config)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    reference.save_pretrained(tmp_path)
    kwargs = dit_kwargs_from_diffusers_config(json.loads((tmp_path / "config.json").read_text()))
    state = load_file(next(tmp_path.glob("*.safetensors")))
    assert kwargs["image_positions"] == flf2v
    model = DiT(**dict(kwargs, image_tokens=2 * image_tokens if flf2v else image_tokens))
    model.load_state_dict(tessera_state_dict_from_diffusers(state), strict=True)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 12, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    # diffusers takes the image's tokens off a context of exactly 512 text tokens (FIELD_NOTES)
    y, y_mask = torch.randn(2, 512, 16, generator=g), torch.ones(2, 512, dtype=torch.bool)
    image = torch.randn(4 if flf2v else 2, image_tokens, 20, generator=g)  # FLF2V: first and last, 2B rows
    with torch.no_grad():
        expected = reference.eval()(x, t * 1000, y, encoder_hidden_states_image=image, return_dict=False)[0]
        out = model.eval()(x, t, y, y_mask, image)
        assert relative_error(out, expected) <= 1e-5, relative_error(out, expected)
        # the image path counts: other features give another output
        assert relative_error(model(x, t, y, y_mask, torch.randn_like(image)), expected) > 1e-3
    with pytest.raises(ValueError, match="conditioned on an image"):
        model(x, t, y, y_mask)
    # and back: the config and the keys diffusers wrote
    exported = diffusers_config_from_dit(model.architecture())
    for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
        assert exported[key] == config.get(key), key
    back = diffusers_state_dict_from_tessera(model.state_dict(), state.keys())
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_unknown_or_unsupported_wan_weights_are_named():
    with pytest.raises(WanFormatError, match="condition_embedder.audio_embedder.norm1.weight"):
        tessera_state_dict_from_diffusers({"condition_embedder.audio_embedder.norm1.weight": torch.zeros(1)})
    with pytest.raises(WanFormatError, match="not blocks.0.attn1.to_v.weight"):
        tessera_state_dict_from_diffusers(
            {"blocks.0.attn1.to_q.weight": torch.zeros(1), "blocks.0.attn1.to_k.weight": torch.zeros(1)}
        )
    with pytest.raises(
        WanFormatError, match="added_kv_proj_dim=64: tessera expects added_kv_proj_dim = the width 24"
    ):
        dit_kwargs_from_diffusers_config(dict(TINY_WAN, image_dim=1280, added_kv_proj_dim=64))


def test_a_pipeline_folder_is_read_through_its_transformer_subfolder(saved_wan, tmp_path):
    import shutil

    from models.dit.wan import WanWeights

    _, folder = saved_wan
    shutil.copytree(folder, tmp_path / "pipeline" / "transformer")
    weights = WanWeights(tmp_path / "pipeline")
    assert weights.folder == tmp_path / "pipeline" / "transformer"
    assert weights.dit_kwargs == WanWeights(folder).dit_kwargs
    (tmp_path / "vace").mkdir()
    (tmp_path / "vace" / "config.json").write_text(json.dumps({"_class_name": "WanVACETransformer3DModel"}))
    with pytest.raises(WanFormatError, match="describes a WanVACETransformer3DModel"):
        WanWeights(tmp_path / "vace")


def original_name(key: str) -> str:
    """diffusers -> the original Wan layout, written out here from Wan's own module names."""
    for old, new in [
        ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
        ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
        ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
        ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
        ("attn2.add_k_proj", "cross_attn.k_img"),
        ("attn2.add_v_proj", "cross_attn.v_img"),
        ("attn2.norm_added_k", "cross_attn.norm_k_img"),
        ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
        ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
        ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
        ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
        ("condition_embedder.time_proj", "time_projection.1"),
        ("proj_out", "head.head"),
        ("attn1.to_out.0", "self_attn.o"),
        ("attn2.to_out.0", "cross_attn.o"),
        ("attn1.to_", "self_attn."),
        ("attn2.to_", "cross_attn."),
        ("attn1.", "self_attn."),
        ("attn2.", "cross_attn."),
        ("norm2", "norm3"),
        ("ffn.net.0.proj", "ffn.0"),
        ("ffn.net.2", "ffn.2"),
    ]:
        key = key.replace(old, new)
    key = "head.modulation" if key == "scale_shift_table" else key.replace("scale_shift_table", "modulation")
    return "model.diffusion_model." + key


@pytest.mark.parametrize("model_type", ["t2v", "i2v", "i2v-2.2", "ti2v"])
def test_the_original_wan_layout_reads_as_the_diffusers_one(saved_wan, tmp_path, model_type):
    """A folder in Wan-AI's own layout (its config.json fields and key names, as diffusers' converter
    maps them: img_emb, k_img, v_img, norm_k_img for image-to-video) gives the same weights and
    architecture. Written here from a diffusers folder: no real original checkpoint is available
    offline. Wan's I2V config implies 16 output channels; whether it reads CLIP features (Wan2.1: img_emb)
    or not (Wan2.2, the same model_type) comes from the weights."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from models.dit.wan import WanWeights

    _, folder = saved_wan
    in_dim = 4
    if model_type not in ("t2v", "ti2v"):  # Wan2.2 TI2V: t2v's layout, no out_dim (as many out as in)
        in_dim, folder = 12, tmp_path / "i2v"
        torch.manual_seed(0)
        image_config = dict(in_channels=in_dim, out_channels=16)
        if model_type == "i2v":  # Wan2.1's CLIP conditioning
            image_config.update(image_dim=1280, added_kv_proj_dim=24)
        WanTransformer3DModel(**dict(TINY_WAN, **image_config)).save_pretrained(folder)
        model_type = "i2v"
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    (tmp_path / "orig").mkdir()
    save_file(
        {original_name(k): v.contiguous() for k, v in state.items()}, tmp_path / "orig" / "model.safetensors"
    )
    (tmp_path / "orig" / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "WanModel",
                "model_type": model_type,
                "dim": 24,
                "ffn_dim": 32,
                "freq_dim": 256,
                "in_dim": in_dim,
                **({"out_dim": 4} if model_type == "t2v" else {}),
                "num_heads": 2,
                "num_layers": 2,
                "eps": 1e-6,
                "text_len": 512,
            }
        )
    )
    original, diffusers = WanWeights(tmp_path / "orig"), WanWeights(folder)
    assert original.original and original.dit_kwargs == diffusers.dit_kwargs
    assert original.sources.keys() == diffusers.sources.keys()
    for name in diffusers.sources:
        rows = diffusers.shape(name)[0]
        assert torch.equal(original.read(name, 0, rows), diffusers.read(name, 0, rows)), name


def test_a_single_file_reads_as_its_folder(saved_wan, tmp_path):
    """One .safetensors file in Wan-AI's names under ComfyUI's prefix (diffusers' from_single_file reads it
    as the model it was written from) or in diffusers' names: the folder's weights and architecture, the
    config from the shapes; the heads, which no shape says, from the caller, else Wan's width of 128 a
    head; a file that is not Wan's is named."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from models.dit.wan import WanWeights

    model, folder = saved_wan
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file({original_name(k): v for k, v in state.items()}, tmp_path / "original.safetensors")
    save_file(state, tmp_path / "diffusers.safetensors")
    theirs = WanTransformer3DModel.from_single_file(tmp_path / "original.safetensors", config=str(folder))
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in state.items())
    want = WanWeights(folder)
    for kind, original in (("original", True), ("diffusers", False)):
        found = WanWeights(tmp_path / f"{kind}.safetensors", heads=TINY_WAN["num_attention_heads"])
        assert found.original is original and found.dit_kwargs == want.dit_kwargs, kind
        for name in want.sources:
            rows = want.shape(name)[0]
            assert torch.equal(found.read(name, 0, rows), want.read(name, 0, rows)), (kind, name)
    with pytest.raises(WanFormatError, match="width 24 is not Wan's heads of 128.*set model.num_heads"):
        WanWeights(tmp_path / "original.safetensors")
    with pytest.raises(WanFormatError, match="missing.safetensors: no such file"):
        WanWeights(tmp_path / "missing.safetensors")
    save_file(state | {"scaled_fp8": torch.zeros(1)}, tmp_path / "scaled.safetensors")
    with pytest.raises(WanFormatError, match="scaled float8 file.*use the release's fp16 or bf16 file"):
        WanWeights(tmp_path / "scaled.safetensors")
    save_file({"x.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(WanFormatError, match="not a Wan transformer file: it has no patch_embedding.weight"):
        WanWeights(tmp_path / "other.safetensors")


@pytest.mark.parametrize("release", ["t2v-1.3b", "i2v-14b", "flf2v-14b", "ti2v-5b"])
def test_the_releases_configs_from_their_shapes(release):
    """Each release's architecture (diffusers' configs of Wan-AI's folders), built on the meta device and
    named as its single file is: the config read off the shapes, the heads at Wan's width of 128 a head,
    CLIP's features and FLF2V's positions included."""
    from diffusers import WanTransformer3DModel

    from models.dit.wan import diffusers_config_from_shapes, diffusers_name_from_original

    base = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256,
                qk_norm="rms_norm_across_heads", cross_attn_norm=True)  # fmt: skip
    wide = dict(num_attention_heads=40, in_channels=36, out_channels=16, ffn_dim=13824, num_layers=40)
    clip = dict(image_dim=1280, added_kv_proj_dim=5120)
    config = base | {
        "t2v-1.3b": dict(num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960,
                         num_layers=30),
        "i2v-14b": wide | clip,
        "flf2v-14b": wide | clip | dict(pos_embed_seq_len=514),
        "ti2v-5b": dict(num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336,
                        num_layers=30),
    }[release]  # fmt: skip
    with torch.device("meta"):
        state = WanTransformer3DModel(**config).state_dict()
    shapes = {diffusers_name_from_original(original_name(k)): tuple(v.shape) for k, v in state.items()}
    found = diffusers_config_from_shapes(shapes, release)
    assert found | {"patch_size": tuple(found["patch_size"])} == config
