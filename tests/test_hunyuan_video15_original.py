"""HunyuanVideo 1.5's transformer from one file in the original release's names (models/hunyuan_video15/
weights.py diffusers_from_original) against diffusers' own conversion script, code no one here wrote:
tests/fixtures/hunyuan_video15_original_tiny.safetensors is a tiny transformer in the original names that
scripts/convert_hunyuan_video1_5_to_diffusers.py converts to the diffusers weights `diffusers_weights`
draws (tests/fixtures/README.md says how it was made and checked)."""

import hashlib
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.hunyuan_video15.family import HunyuanVideo15
from models.hunyuan_video15.weights import shapes_config
from tests.conftest import ROOT
from tests.test_hunyuan_video15 import NEGATIVE, PROMPTS, TINY, infer_args, tiny_pipeline

FIXTURE = ROOT / "tests" / "fixtures" / "hunyuan_video15_original_tiny.safetensors"
# the fixture's diffusers config: 54 blocks and 2 refiner blocks, as the script's loops have it, 8 wide
CONFIG = dict(
    TINY,
    num_attention_heads=1,
    attention_head_dim=8,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=1.0,
    text_embed_2_dim=4,
    rope_axes_dim=(2, 2, 4),
)
# digests (`digest`) of what the script converted (the fixture and LEFT_OUT) and of what it gave
ORIGINAL_DIGEST = "0ef543298980f0e643ca68bb8463ba8f6a3f70ffe125cdfdaa934ba6865bc445"
CONVERTED_DIGEST = "f51f707502ff9f1198645f7a3608970aa3352928ec94180e540745d1021490fa"
# not stored (8 MiB: diffusers fixes the ByT5 projection's width at 2048): the script renames it to
# context_embedder_2.linear_2.weight, which `diffusers_weights` draws
LEFT_OUT = ("byt5_in.fc2.weight", "context_embedder_2.linear_2.weight")


def digest(state: dict) -> str:
    """sha256 of a state dict: each name, dtype, shape and bytes, in the names' order."""
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        h.update(tensor.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def diffusers_weights() -> dict:
    """The fixture's transformer in diffusers' names, bf16: diffusers' parameters in sorted order, each
    drawn N(0, 0.2^2) from one generator seeded 0."""
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        shapes = HunyuanVideo15Transformer3DModel(**CONFIG).state_dict()
    generator = torch.Generator().manual_seed(0)
    draw = lambda shape: torch.randn(shape, generator=generator) * 0.2  # noqa: E731
    return {name: draw(shapes[name].shape).to(torch.bfloat16) for name in sorted(shapes)}


@pytest.fixture(scope="module")
def weights():
    """(the original file's state dict, the diffusers weights the script made of it), both checked against
    the digests the fixture was made with."""
    theirs = diffusers_weights()
    original = {**load_file(FIXTURE), LEFT_OUT[0]: theirs[LEFT_OUT[1]]}
    assert digest(original) == ORIGINAL_DIGEST and digest(theirs) == CONVERTED_DIGEST
    return original, theirs


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    wrong = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not wrong, wrong[:5]


def test_from_original_matches_the_script(weights):
    """from_original of the original file gives the diffusers weights the script gives, every key bit for
    bit; so with ComfyUI's prefixes, and a file already in diffusers' names comes back as it is."""
    original, theirs = weights
    family = HunyuanVideo15()
    assert_same(family.names.from_original(dict(original)), theirs)
    for prefix in ("model.diffusion_model.", "diffusion_model."):
        assert_same(family.names.from_original({prefix + k: v for k, v in original.items()}), theirs)
        assert_same(family.names.from_original({prefix + k: v for k, v in theirs.items()}), theirs)


def test_config_of_file(weights):
    """The config from the file's shapes: the fixture's but the rope's split of a head of 8, which no shape
    holds (refused, asking for a folder's transformer/config.json); heads of 128 take the release's."""
    from diffusers import HunyuanVideo15Transformer3DModel

    original, _ = weights
    shapes = {k: tuple(v.shape) for k, v in original.items()}
    got = shapes_config(shapes)
    fields = set(CONFIG) - {"rope_axes_dim"}
    assert {k: got[k] for k in fields} == {k: CONFIG[k] for k in fields}
    assert got["rope_axes_dim"] is None and not got["use_meanflow"] and got["qk_norm"] == "rms_norm"
    with pytest.raises(ValueError, match="transformer/config.json describes it"):
        HunyuanVideo15().config_of_file(shapes)
    with torch.device("meta"):
        release = HunyuanVideo15Transformer3DModel()  # diffusers' defaults: the 480p and 720p releases'
    got = HunyuanVideo15().config_of_file({k: tuple(v.shape) for k, v in release.state_dict().items()})
    read = sorted(set(got) - {"_class_name", "target_size"})
    assert len(read) == 15 and got["target_size"] is None and got["rope_axes_dim"] == (16, 56, 56)
    assert {k: got[k] for k in read} == {k: release.config[k] for k in read}


@pytest.fixture(scope="module")
def folder(weights, tmp_path_factory):
    """A tiny pipeline folder whose transformer holds the script's diffusers weights (float32)."""
    folder = tmp_path_factory.mktemp("hunyuan_video15_original") / "pipeline"
    with torch.random.fork_rng():
        pipe = tiny_pipeline(config=CONFIG)
    pipe.transformer.load_state_dict({k: v.float() for k, v in weights[1].items()}, strict=True)
    pipe.save_pretrained(folder)
    return folder


@torch.no_grad()
def test_infer_samples_the_original_file(weights, folder, tmp_path):
    """infer.py with model.pretrained=the original file under ComfyUI's prefix (the VAE, text encoders and
    transformer config from the folder in vae.pretrained and text_encoder.pretrained) samples the video
    it samples with the folder's own transformer: a prompt with glyph texts, a negative prompt, 2 steps,
    guidance 4."""
    import infer
    from tests.conftest import run_main

    file = tmp_path / "original.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in weights[0].items()}, str(file))
    videos = []
    for pretrained in (folder, file):
        argv = infer_args(folder, tmp_path, "--prompt", PROMPTS[0], "--negative-prompt", NEGATIVE)
        argv += ["--steps", "2", "--guidance", "4", "--seed", "5", f"model.pretrained={pretrained}"]
        assert run_main(infer, [*argv, "--output", str(tmp_path / f"{pretrained.stem}.npy")]) == 0
        videos.append(np.load(tmp_path / f"{pretrained.stem}.npy"))
    print(f"video std {videos[0].std():.3f}, max abs difference {np.abs(videos[0] - videos[1]).max():.1e}")
    assert videos[0].shape == (5, 24, 40, 3) and videos[0].std() > 0.01
    # the same weights (bit for bit above); a tensor's byte offset can change a CPU kernel's summation order
    # (tests/test_families.py test_single_file): 0.0 here, float32 rounding allowed
    assert np.abs(videos[0] - videos[1]).max() <= 1e-5


def test_refusals(weights, folder, tmp_path, capsys):
    """infer.py refuses by name, in one error line: a file of another model (HunyuanVideo 1.0's original
    names: fused qkv, single-stream blocks), a key set without the last block, a scaled-fp8 file; without a
    folder's transformer/config.json, the file (a head of 8: its rope's split is in no shape) and one
    without its patch embedding."""
    import infer
    from tests.conftest import run_main

    original = weights[0]
    other = {
        "double_blocks.0.img_attn_qkv.weight": torch.zeros(24, 8),
        "single_blocks.0.linear1.weight": torch.zeros(8, 8),
    }
    other.update({k: v for k, v in original.items() if k.startswith(("img_in.", "txt_in.", "final_layer."))})
    scaled = {**original, "double_blocks.0.img_attn_q.scale_weight": torch.ones(1)}
    cases = [
        (
            other,
            folder,
            "not an original HunyuanVideo 1.5 transformer's: ['double_blocks.0.img_attn_qkv.weight'",
        ),
        (
            {k: v for k, v in original.items() if not k.startswith("double_blocks.53.")},
            folder,
            "parameters without a weight ['blocks.53.",
        ),
        (scaled, folder, "a scaled-fp8 single file (double_blocks.0.img_attn_q.scale_weight, ...)"),
        (original, tmp_path / "parts", "needs a pipeline folder whose transformer/config.json describes it"),
        (
            {k: v for k, v in original.items() if not k.startswith("img_in.")},
            tmp_path / "parts",
            "is not a HunyuanVideo 1.5 transformer file: it has no img_in.proj.weight",
        ),
    ]
    shutil.copytree(folder, tmp_path / "parts", ignore=shutil.ignore_patterns("transformer"))
    for i, (state, parts, expected) in enumerate(cases):
        file = tmp_path / f"file{i}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(file))
        argv = infer_args(parts, tmp_path, "--prompt", PROMPTS[1], "--steps", "1", f"model.pretrained={file}")
        assert run_main(infer, argv) != 0
        err = capsys.readouterr().err
        assert expected in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()


def test_image_size_of_a_file_without_config():
    """--image without --height and --width: a config from the shapes has no target size (the 480p and 720p
    releases differ in it alone), so the size is asked for rather than guessed."""
    family = HunyuanVideo15()
    shapes = {k: tuple(v.shape) for k, v in load_file(FIXTURE).items()}
    family.transformer_config = lambda cfg: shapes_config(shapes)
    cfg = SimpleNamespace(model=SimpleNamespace(pretrained="transformer.safetensors"))
    with pytest.raises(ValueError, match="give --height and --width"):
        family.image_size(cfg, None)


def test_training_reads_the_original_file(weights, tmp_path):
    """What train.py reads the weights through (models/family.py FamilyWeights, each rank its rows) gives
    the script's weights under tessera's names, float32."""
    from models.family import FamilyWeights

    file = tmp_path / "original.safetensors"
    save_file({f"diffusion_model.{k}": v.contiguous() for k, v in weights[0].items()}, str(file))
    family = HunyuanVideo15()
    read = FamilyWeights(family, SimpleNamespace(model=SimpleNamespace(pretrained=str(file))))
    want = family.names.to_tessera(weights[1])
    read.check_parameters(want)
    assert all(torch.equal(read.read(name, 0, len(w)), w.float()) for name, w in want.items())
