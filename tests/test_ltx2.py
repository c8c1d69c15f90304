"""LTX-2's transformer (models/ltx2/) against diffusers' LTX2VideoTransformer3DModel, code no one here
wrote: a tiny random config (both rotary layouts), the same weights, a padded text, both streams' outputs;
image-to-video's per-token timesteps; the pipeline's STG and modality-isolation passes; refused options."""

import re

import pytest
import torch

from models.ltx2.transformer import LTX2Cond
from models.ltx2.weights import LTX2FormatError, build_transformer

# a diffusers config of a tiny transformer (weights.py reads it): video 2 heads x 16, audio 2 heads x 8
TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    audio_in_channels=12,  # 3 latent channels x 4 mel bins
    audio_out_channels=12,
    audio_num_attention_heads=2,
    audio_attention_head_dim=8,
    audio_cross_attention_dim=16,
    num_layers=2,
    caption_channels=24,
    perturbed_attn=True,  # STG's processor (no weights): diffusers ignores STG blocks without it
)
GRID, AUDIO = (3, 2, 3), (3, 5, 4)  # video latents T x H x W (non-square); audio C x L x M
FPS = 25.0


def tiny_pair(rope_type="interleaved"):
    """(diffusers' transformer, tessera's built from its config by weights.py) with the same random weights
    (every parameter, none left zero), float32."""
    from diffusers import LTX2VideoTransformer3DModel

    theirs = LTX2VideoTransformer3DModel(**TINY, rope_type=rope_type).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    ours = build_transformer(dict(theirs.config)).eval()
    state = {re.sub(r"^transformer_blocks\.", "blocks.", k): v for k, v in theirs.state_dict().items()}
    ours.load_state_dict(state, strict=True)  # models/names.py's default rename
    return theirs, ours


def inputs():
    """Latents, texts (7 tokens, the second sample's padded to 3 real) and sigmas for two samples."""
    video, audio = torch.randn(2, 8, *GRID), torch.randn(2, *AUDIO)
    text, audio_text = torch.randn(2, 7, 24), torch.randn(2, 7, 24)
    mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])  # the connectors' 0/1 mask, int64
    return video, audio, LTX2Cond(text, audio_text, mask, mask, fps=FPS), torch.tensor([0.75, 0.25])


def theirs_as_pipeline(theirs, video, audio, t, cond: LTX2Cond, video_t=None, **kwargs):
    """diffusers' outputs, called as LTX2Pipeline calls it (packed latents, its coords at the conditioning
    frame rate, timestep = sigma = 1000 sigma; LTX2ImageToVideoPipeline's per-token video timestep and
    audio_timestep when video_t is given), unpacked to the latents' layouts."""
    B, (T, H, W), L, M = video.shape[0], GRID, AUDIO[1], AUDIO[2]
    timestep = t * 1000
    video_coords = theirs.rope.prepare_video_coords(B, T, H, W, video.device, fps=cond.fps)
    audio_coords = theirs.audio_rope.prepare_audio_coords(B, L, audio.device)
    out, audio_out = theirs(
        hidden_states=video.flatten(2).transpose(1, 2),  # LTX2Pipeline._pack_latents at patch size 1
        audio_hidden_states=audio.transpose(1, 2).flatten(2),  # _pack_audio_latents: (B, L, C M)
        encoder_hidden_states=cond.text,
        audio_encoder_hidden_states=cond.audio_text,
        timestep=timestep if video_t is None else video_t * 1000,
        audio_timestep=kwargs.pop("audio_timestep", None if video_t is None else timestep),
        sigma=timestep,
        encoder_attention_mask=cond.text_mask,
        audio_encoder_attention_mask=cond.audio_text_mask,
        num_frames=T,
        height=H,
        width=W,
        fps=cond.fps,
        audio_num_frames=L,
        video_coords=video_coords,
        audio_coords=audio_coords,
        use_cross_timestep=cond.cross_timestep,
        return_dict=False,
        **kwargs,
    )
    return out.transpose(1, 2).unflatten(2, GRID), audio_out.unflatten(2, (-1, M)).transpose(1, 2)


def compare(got, want, what):
    """Both streams within 1e-5 of diffusers' on outputs of std > 0.3; prints the figures."""
    for name, g, w in zip(("video", "audio"), got, want):
        diff = float((g - w).abs().max())
        print(f"{what} {name}: max abs {diff:.2e}, output std {float(w.std()):.3f}")
        assert g.shape == w.shape and w.std() > 0.3
        assert diff <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_transformer_matches_diffusers(rope_type):
    """Text-to-video: both velocities at a 3 x 2 x 3 video grid and 5 audio frames, two samples at sigmas
    0.75 and 0.25, positions at 25 fps (the default 24 would move the output by ~0.02)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs, ours = tiny_pair(rope_type)
        video, audio, cond, t = inputs()
    want = theirs_as_pipeline(theirs, video, audio, t, cond)
    got = ours(video, audio, t, cond)
    assert got[0].shape == (2, 8, *GRID) and got[1].shape == (2, *AUDIO)
    compare(got, want, rope_type)


@torch.no_grad()
def test_bf16_matches_diffusers_bf16():
    """In bf16 (latents and texts in bf16, the sigma in float32 as the pipeline's scheduler gives it) both
    round alike: tessera's velocities are diffusers' bf16 ones within 1e-2 (0 when written), each ~0.08
    from diffusers' float32 ones."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs, ours = tiny_pair("split")
        video, audio, cond, t = inputs()
    reference = theirs_as_pipeline(theirs, video, audio, t, cond)
    bf16 = lambda x: x.to(torch.bfloat16)
    theirs, ours = bf16(theirs), bf16(ours)
    cond = LTX2Cond(bf16(cond.text), bf16(cond.audio_text), cond.text_mask, cond.audio_text_mask, fps=FPS)
    want = theirs_as_pipeline(theirs, bf16(video), bf16(audio), t, cond)
    got = ours(bf16(video), bf16(audio), t, cond)
    for name, g, w, r in zip(("video", "audio"), got, want, reference):
        diff, rounding = float((g.float() - w.float()).abs().max()), float((w.float() - r).abs().max())
        print(f"bf16 {name}: max abs {diff:.2e} from diffusers' bf16, which is {rounding:.3f} from float32")
        assert g.dtype == torch.bfloat16 and diff <= 1e-2 < rounding


@torch.no_grad()
@pytest.mark.parametrize("cross_timestep", [True, False])
def test_per_token_video_timestep(cross_timestep):
    """Image-to-video: the first latent frame given (video sigma 0 on its tokens), the audio at the
    sample's sigma; with use_cross_timestep (the pipeline's default) the a2v / v2a modulations read the
    sample's sigma, without it the video's per-token one."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        theirs, ours = tiny_pair("split")
        video, audio, cond, t = inputs()
    given = torch.zeros(GRID)
    given[0] = 1  # LTX2ImageToVideoPipeline's conditioning mask, packed
    video_t = t[:, None] * (1 - given.flatten())[None]
    cond.video_t, cond.cross_timestep = video_t, cross_timestep
    want = theirs_as_pipeline(theirs, video, audio, t, cond, video_t=video_t)
    compare(ours(video, audio, t, cond), want, f"per-token, cross_timestep={cross_timestep}")


@torch.no_grad()
@pytest.mark.parametrize("cross_timestep", [True, False])
def test_audio_sigma_of_its_own(cross_timestep):
    """Training's draws (docs/ltx2_training.md): the audio at sigmas 0.4 and 0.9 while the video is at 0.75
    and 0.25, told to diffusers as audio_timestep and audio_sigma; with use_cross_timestep each stream's
    audio-video modulations read the other's sigma, without it their own."""
    with torch.random.fork_rng():
        torch.manual_seed(3)
        theirs, ours = tiny_pair("split")
        video, audio, cond, t = inputs()
    cond.audio_t, cond.cross_timestep = torch.tensor([0.4, 0.9]), cross_timestep
    audio_sigma = cond.audio_t * 1000
    want = theirs_as_pipeline(
        theirs, video, audio, t, cond, audio_sigma=audio_sigma, audio_timestep=audio_sigma
    )
    got = ours(video, audio, t, cond)
    compare(got, want, f"audio sigma, cross_timestep={cross_timestep}")
    shared = ours(video, audio, t, LTX2Cond(**{**vars(cond), "audio_t": None}))
    assert float((shared[1] - got[1]).abs().max()) > 1e-2  # the audio's sigma does reach the audio


@torch.no_grad()
@pytest.mark.parametrize("guidance", ["stg", "stg_mask", "isolate"])
def test_guidance_passes(guidance):
    """The pipeline's extra passes: STG at block 1 on every sample (its call: no perturbation_mask) or on
    the second only, and modality guidance's pass without audio-video cross-attention."""
    with torch.random.fork_rng():
        torch.manual_seed(2)
        theirs, ours = tiny_pair()
        video, audio, cond, t = inputs()
    mask = torch.tensor([1.0, 0.0]) if guidance == "stg_mask" else None
    if guidance == "isolate":
        theirs_kwargs, ours_kwargs = dict(isolate_modalities=True), dict(isolate_modalities=True)
    else:
        theirs_kwargs = dict(spatio_temporal_guidance_blocks=[1], perturbation_mask=mask)
        ours_kwargs = dict(stg_blocks=[1], perturbation_mask=mask)
    want = theirs_as_pipeline(theirs, video, audio, t, cond, **theirs_kwargs)
    plain = ours(video, audio, t, cond)
    got = ours(video, audio, t, cond, **ours_kwargs)
    compare(got, want, guidance)
    assert float((plain[0] - got[0]).abs().max()) > 1e-2  # the pass does change the output


def test_operators_are_swappable():
    """Every token-mixing attention runs through an `inner_attention` with a kind, replaceable by
    assignment (parallel/'s contract: q, k, v (B, H, N, Dh) in, the same shape out)."""
    _, ours = tiny_pair()
    block = ours.blocks[0]
    kinds = {
        name: block.get_submodule(name).inner_attention.kind
        for name in (
            "attn1",
            "audio_attn1",
            "attn2",
            "audio_attn2",
            "audio_to_video_attn",
            "video_to_audio_attn",
        )
    }
    assert kinds == dict(
        attn1="self",
        audio_attn1="whole",
        attn2="cross",
        audio_attn2="cross",
        audio_to_video_attn="cross",
        video_to_audio_attn="whole_queries",
    )
    seen = []

    class Spy(torch.nn.Module):
        kind = "cross"

        def forward(self, q, k, v):
            seen.append((tuple(q.shape), tuple(k.shape)))
            return torch.zeros_like(q)

    block.audio_to_video_attn.inner_attention = Spy()
    video, audio, cond, t = inputs()
    with torch.no_grad():
        ours(video, audio, t, cond)
    assert seen == [((2, 2, 18, 8), (2, 2, 5, 8))]  # video queries at the audio's heads, audio keys


def test_weight_names_and_config():
    """diffusers' names, blocks renamed, are tessera's; every option this transformer does not run (LTX-2.3
    and 2.5's) is refused naming the key."""
    from diffusers import LTX2VideoTransformer3DModel

    theirs = LTX2VideoTransformer3DModel(**TINY)
    config = dict(theirs.config)
    ours = build_transformer(config)
    names = {re.sub(r"^transformer_blocks\.", "blocks.", k) for k in theirs.state_dict()}
    assert set(ours.state_dict()) == names
    assert build_transformer({**config, "rope_type": "split"}).blocks[0].attn1.split_rope
    refused = [
        ("gated_attn", True),
        ("audio_gated_attn", True),
        ("cross_attn_mod", True),
        ("audio_cross_attn_mod", True),
        ("use_prompt_embeddings", False),
        ("use_prompt_adaln_single", False),
        ("use_keyframes_abs_pos_embedding", True),
        ("ff_bias", False),
        ("audio_ff_bias", False),
        ("norm_elementwise_affine", True),
        ("activation_fn", "gelu"),
        ("qk_norm", "rms_norm"),
        ("patch_size", 2),
        ("patch_size_t", 2),
        ("audio_patch_size", 2),
        ("audio_patch_size_t", 2),
        ("rope_type", "yarn"),
        ("cross_attention_dim", 64),
        ("audio_cross_attention_dim", 32),
        ("some_new_option", 1),
    ]
    for key, value in refused:
        with pytest.raises(LTX2FormatError, match=rf"{key}={value!r}"):
            build_transformer({**config, key: value})
    with pytest.raises(LTX2FormatError, match="audio_num_attention_heads=4"):
        build_transformer({**config, "rope_type": "split", "audio_num_attention_heads": 4})
    with pytest.raises(LTX2FormatError, match="LTXVideoTransformer3DModel"):
        build_transformer({**config, "_class_name": "LTXVideoTransformer3DModel"})


def test_a_sequence_split_replaces_the_video_operators_only():
    """parallel/compute/operators.py apply_operators on LTX-2's transformer (a split of 2, no collective yet):
    the video self-attention becomes the DiT's Ulysses / ring attention and video-to-audio gathers the video's
    keys; the audio stream's self-attention, the text's and audio-to-video stay as they are."""
    from types import SimpleNamespace

    from parallel.compute.operators import GatheredKeysAttention, ShardedSelfAttention, apply_operators
    from parallel.compute.sequence import ShardedSequence

    _, ours = tiny_pair()
    apply_operators(ours, SimpleNamespace(sp_size=2))
    block = ours.blocks[0]
    kinds = {
        name: type(block.get_submodule(name).inner_attention) for name in ("attn1", "video_to_audio_attn")
    }
    assert kinds == {"attn1": ShardedSelfAttention, "video_to_audio_attn": GatheredKeysAttention}
    assert isinstance(ours.sequence, ShardedSequence)
    for name in ("audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn"):
        assert type(block.get_submodule(name).inner_attention).__module__ == "models.ltx2.transformer", name


def release_state(state: dict) -> dict:
    """diffusers' names -> the release's whole-model file (ltx-2-19b-dev.safetensors), written out here from
    Lightricks' module names: the transformer under model.diffusion_model., beside a text connector and the
    VAEs' and vocoder's tensors (which the transformer's reading leaves out)."""
    modules = [  # top-level modules the release names otherwise
        ("audio_proj_in", "audio_patchify_proj"), ("proj_in", "patchify_proj"),
        ("audio_time_embed.", "audio_adaln_single."), ("time_embed.", "adaln_single."),
        ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
        ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
        ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
        ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ]  # fmt: skip
    inside = [  # in each block
        ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
        ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
        ("norm_q", "q_norm"), ("norm_k", "k_norm"),
    ]  # fmt: skip
    out = {}
    for key, value in state.items():
        key = next((theirs + key[len(ours) :] for ours, theirs in modules if key.startswith(ours)), key)
        for ours, theirs in inside:
            key = key.replace(ours, theirs)
        out["model.diffusion_model." + key] = value
    others = (
        "model.diffusion_model.video_embeddings_connector.learnable_registers",
        "vae.per_channel_statistics.mean-of-means",
        "audio_vae.decoder.conv_in.weight",
        "vocoder.conv_pre.weight",
    )
    return out | {key: torch.zeros(2) for key in others}


def test_the_release_file_reads_as_diffusers_reads_it():
    """The transformer of the release's whole-model file: diffusers' converter
    (convert_ltx2_transformer_to_diffusers, on its transformer's keys) and tessera's reading give the
    diffusers state dict it was written from; the other parts' tensors are left out."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    from models.ltx2.weights import diffusers_from_release

    theirs, _ = tiny_pair()
    state = theirs.state_dict()
    release = release_state(state)
    assert set(release) - {"model.diffusion_model." + k for k in state}  # the other parts are there
    transformer = {k: v for k, v in release.items() if k.startswith("model.diffusion_model.")}
    assert convert_ltx2_transformer_to_diffusers(transformer).keys() == state.keys()
    assert diffusers_from_release(release) == state
    assert diffusers_from_release(state) == state  # diffusers' names stay


def test_the_release_file_is_read_by_name(tmp_path, monkeypatch):
    """Training's and sampling's readers take the release's file by name, not whole (it holds the VAEs and
    vocoder too: 43 GB on every rank): with safetensors' whole-file reading made to fail, FamilyWeights gives
    each rank's rows and load_transformer the model, both the diffusers state dict the file was written
    from."""
    from types import SimpleNamespace

    import safetensors.torch
    from safetensors.torch import save_file

    from models.families import family_named
    from models.family import FamilyWeights

    theirs, _ = tiny_pair()
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    file = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file({k: v.contiguous() for k, v in release_state(state).items()}, str(file))
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("read whole"))
    family = family_named("ltx2")
    want = family.names.to_tessera(state)
    cfg = SimpleNamespace(model=SimpleNamespace(pretrained=str(file)))
    read = FamilyWeights(family, cfg)
    read.check_parameters(want)
    assert all(torch.equal(read.read(n, 1, 2), w[1:2].float()) for n, w in want.items() if w.dim())
    with torch.device("meta"):
        meta = build_transformer(dict(theirs.config))
    monkeypatch.setattr(family, "meta_transformer", lambda cfg: meta)
    loaded = family.load_transformer(cfg, torch.float32)
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(loaded.state_dict()[n], w) for n, w in want.items())
