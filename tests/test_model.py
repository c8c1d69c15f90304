import importlib.util
from pathlib import Path

import pytest
import torch

from models.attention import ATTENTION_BACKENDS, AttentionBackendUnavailable, MathAttention, make_attention
from models.dit.transformer import DiT, DiT_models, RotaryEmbedding3D, absolute_position_embedding
from models.layers import apply_rope
from models.util import seeded

ROOT = Path(__file__).resolve().parents[1]


def tiny_dit(**kw):
    args = dict(in_channels=3, text_dim=16, depth=2, hidden_size=32, num_heads=4, patch_size=(1, 2, 2))
    args.update(kw)
    with seeded(0):
        return DiT(**args)


def text(batch=2, length=5, dim=16):
    y = torch.randn(batch, length, dim)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, 3:] = False
    return y, mask


@pytest.mark.parametrize(
    "shape, patch",
    [
        ((2, 3, 1, 16, 16), (1, 2, 2)),  # image
        ((2, 3, 5, 8, 12), (1, 2, 2)),  # video, odd frame count, landscape
        ((2, 3, 4, 12, 8), (2, 4, 4)),  # temporal patches, portrait
    ],
)
def test_output_shape_matches_input(shape, patch):
    model = tiny_dit(patch_size=patch)
    out = model(torch.randn(shape), torch.rand(shape[0]), *text())
    assert out.shape == shape


def test_indivisible_latent_is_refused():
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        tiny_dit(patch_size=(2, 2, 2))(torch.randn(1, 3, 3, 8, 8), torch.rand(1), *text(1))


def test_padded_text_tokens_are_ignored():
    model = tiny_dit()
    with torch.no_grad():  # the zero-initialised layers (adaLN-Zero, final layer) would hide the text path
        for p in model.parameters():
            p.normal_(0, 0.2)
    x, t = torch.randn(1, 3, 2, 8, 8), torch.rand(1)
    y = torch.randn(1, 6, 16)
    mask = torch.tensor([[True, True, True, False, False, False]])
    y2 = y.clone()
    y2[:, 3:] = 100.0  # garbage in the padding
    assert torch.allclose(model(x, t, y, mask), model(x, t, y2, mask), atol=1e-6)
    assert not torch.allclose(model(x, t, y, mask), model(x, t, y2, torch.ones_like(mask)), atol=1e-3)


def test_rope_relative_positions():
    """q.k after rotary embedding depends only on the offset between positions, on every axis."""
    rope = RotaryEmbedding3D(head_dim=24)
    angles = rope((3, 4, 5), "cpu").view(3, 4, 5, -1, 2)
    q, k = torch.randn(1, 1, 1, 24), torch.randn(1, 1, 1, 24)

    def score(p1, p2):
        return (
            (apply_rope(q, angles[p1].view(1, -1, 2)) * apply_rope(k, angles[p2].view(1, -1, 2))).sum().item()
        )

    assert score((0, 0, 0), (1, 2, 1)) == pytest.approx(score((1, 1, 2), (2, 3, 3)), abs=1e-5)
    assert score((0, 0, 0), (1, 2, 1)) != pytest.approx(score((0, 0, 0), (1, 1, 2)), abs=1e-3)


def test_absolute_positions_mean_the_same_place_in_every_bucket():
    """Space is counted from the grid's centre and time from the first frame: the centre token of a 4x5x7
    grid and of a 2x9x3 grid get the same features, so do two first-frame tokens one row above the centre,
    and every token of a grid gets its own. The option adds no parameter (checkpoints stay compatible)."""
    a = absolute_position_embedding((4, 5, 7), 48, "cpu").view(4, 5, 7, 48)
    b = absolute_position_embedding((2, 9, 3), 48, "cpu").view(2, 9, 3, 48)
    assert torch.equal(a[1, 2, 3], b[1, 4, 1]) and torch.equal(a[0, 1, 3], b[0, 3, 1])
    assert not torch.allclose(a[1, 2, 3], a[2, 2, 3]) and not torch.allclose(a[1, 2, 3], a[1, 2, 4])
    assert torch.cdist(a.view(-1, 48), a.view(-1, 48)).add(torch.eye(140) * 9).min() > 0.1
    x, t = torch.randn(2, 3, 2, 8, 8), torch.rand(2)
    y, mask = text()
    plain, placed = tiny_dit(), tiny_dit(absolute_positions=True)
    assert plain.state_dict().keys() == placed.state_dict().keys()
    for p in placed.parameters():  # adaLN-Zero starts as the identity: make every path count
        torch.nn.init.normal_(p, std=0.2)
    plain.load_state_dict(placed.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(x, t, y, mask), placed(x, t, y, mask), atol=1e-3)


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_attention_backends_agree_with_the_reference(backend):
    try:
        op = make_attention(backend)
    except AttentionBackendUnavailable:
        pytest.skip(f"{backend} is not installed")
    device, dtype = "cpu", torch.float32
    if backend == "flash":
        if not torch.cuda.is_available():
            pytest.skip("flash-attn needs CUDA")
        device, dtype = "cuda", torch.bfloat16
    q, k, v = (torch.randn(2, 4, 37, 16, device=device, dtype=dtype) for _ in range(3))
    # the reference, written out here in float64
    weights = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 4.0, dim=-1)
    expected = (weights @ v.double()).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(op(q, k, v).float(), expected, atol=tolerance)


def test_auto_attention_measures_once_per_shape_and_runs_what_it_chose(monkeypatch, capsys):
    """model.attention_backend=auto: the first call of a shape times every candidate that runs it and
    agrees with the math kernel, and runs the fastest; later calls of that shape measure nothing and give
    that kernel's output exactly; a masked call weighs only kernels that take a mask; the choice is said
    once. In a checkpointed block the measurement leaves the recompute alone: gradients as SDPA's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import models.attention as attention

    monkeypatch.setattr(attention, "CHOSEN", {})
    timed, measure = [], attention._time

    def counted(call, args, backward):
        timed.append(call)
        return measure(call, args, backward)

    monkeypatch.setattr(attention, "_time", counted)
    auto = make_attention("auto")
    q, k, v = (torch.randn(2, 4, 37, 16) for _ in range(3))
    first = auto(q, k, v)
    (chosen,) = attention.CHOSEN.values()
    assert len(timed) >= 2 and chosen in attention.auto_candidates()  # CPU: SDPA's flash and math at least
    assert torch.equal(auto(q, k, v), first) and len(timed) >= 2 and len(attention.CHOSEN) == 1
    assert torch.equal(first, attention.auto_candidates()[chosen](q, k, v))
    assert f"model.attention_backend=auto: q (2, 4, 37, 16) torch.float32 on cpu (forward): {chosen}" in (
        capsys.readouterr().out
    )
    mask = torch.ones(2, 1, 1, 37, dtype=torch.bool)
    mask[..., 30:] = False
    masked = auto(q, k, v, mask)
    assert torch.allclose(masked, MathAttention()(q, k, v, mask), atol=1e-5)
    assert attention.CHOSEN[attention._key(q, k, v, mask)] not in ("flash", "xformers")
    grads = {}
    for backend in ("sdpa", "auto"):
        model = tiny_dit(attention_backend=backend)
        torch.manual_seed(1)  # the same weights and inputs for both
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.2)
        wrapped = [checkpoint_wrapper(b, preserve_rng_state=False) for b in model.blocks]
        model.blocks = torch.nn.ModuleList(wrapped)
        x, t, (y, m) = torch.randn(2, 3, 2, 8, 8), torch.rand(2), text()
        model(x, t, y, m).square().mean().backward()
        grads[backend] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(grads["auto"], grads["sdpa"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend, package", [("xformers", "xformers"), ("flash", "flash_attn")])
def test_missing_backend_is_an_error_not_a_fallback(backend, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(AttentionBackendUnavailable, match=f"{backend}.*not installed"):
        make_attention(backend)


def test_attention_operator_is_swappable():
    """The DiT with the math operator assigned to every block equals the default SDPA one."""
    model = tiny_dit()
    with torch.no_grad():  # a fresh DiT outputs zeros (adaLN-Zero): give it weights that show the attention
        for p in model.parameters():
            p.normal_(0, 0.2)
    x, t, (y, mask) = torch.randn(2, 3, 2, 8, 8), torch.rand(2), text()
    expected = model(x, t, y, mask)
    assert expected.abs().mean() > 0.01
    for block in model.blocks:
        block.attn.inner_attention = MathAttention()
    assert torch.allclose(model(x, t, y, mask), expected, atol=1e-5)


# The DiT options whose parameters the plain tiny recipe lacks: adaLN-single's tables, Wan's norms, and
# FLF2V's image embedder and image position embedding.
WAN_FLF2V = [
    "model.adaln=single",
    "model.qk_norm_across_heads=true",
    "model.pooled_text=false",
    "model.text_mask=false",
    "model.absolute_positions=true",
    "model.task=flf2v",
    "model.image_dim=8",
    "model.image_tokens=3",
    "text_encoder.max_length=512",  # Wan's padding (unmasked text)
]


def assert_same_tensors(expected: dict, got: dict, every: bool = True) -> None:
    """got's tensors equal expected's of the same name; every: and got has all of them."""
    missing = expected.keys() - got.keys() if every else set()
    assert not missing and got.keys() <= expected.keys(), (sorted(missing), sorted(got.keys() - expected))
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("overrides", [[], WAN_FLF2V], ids=["dit", "wan-flf2v"])
@pytest.mark.parametrize("zero_init", [True, False], ids=["zero-init", "random-weights"])
def test_meta_build_then_fill_equals_a_direct_build(overrides, zero_init):
    """train.py and infer.py build the DiT on the meta device (parallel/build/components.build_model
    weights=False) and fill it (fill_sharded / fill_unsharded, one parameter at a time), a PipeFusion stage
    only its own blocks: every tensor equals the DiT built directly on the host and initialised with the
    same seed (DiT.init_weights(seed=...)), in name, dtype and value."""
    from types import SimpleNamespace

    from configs import load_config
    from models.dit.transformer import build_dit
    from parallel.build.components import build_model, fill_sharded, fill_unsharded
    from parallel.compute.pipefusion_plan import keep_blocks
    from tests.conftest import TINY

    cfg = load_config(TINY, overrides)
    direct = build_dit(cfg.model, in_channels=4, text_dim=16)
    direct.init_weights(zero_init=zero_init, seed=cfg.train.seed)
    expected = direct.state_dict()
    assert sum(t.abs().sum() for t in expected.values()) > 0
    encoder, vae = SimpleNamespace(dim=16), SimpleNamespace(latent_channels=4)  # widths only

    def meta():
        model = build_model(cfg, encoder, vae, weights=False)
        assert all(t.is_meta for t in model.state_dict().values())
        return model

    unsharded = meta()
    fill_unsharded(unsharded, cfg.train.seed, None, zero_init=zero_init)
    assert_same_tensors(expected, unsharded.state_dict())
    if zero_init:  # training's fill (no FSDP mesh here: one shard, the whole of each parameter)
        sharded = meta()
        fill_sharded(SimpleNamespace(device=torch.device("cpu")), sharded, cfg.train.seed, None)
        assert_same_tensors(expected, sharded.state_dict())
    held = set()
    for stage in range(2):
        part = keep_blocks(meta(), stage, 2)
        fill_unsharded(part, cfg.train.seed, None, zero_init=zero_init, partial=True)
        assert_same_tensors(expected, part.state_dict(), every=False)
        held |= part.state_dict().keys()
    assert held == expected.keys()


def test_sizes_dict_spans_tiny_to_billions():
    with torch.device("meta"):
        counts = {
            name: sum(p.numel() for p in DiT(16, 4096, **size).parameters())
            for name, size in DiT_models.items()
        }
    assert counts["DiT-tiny"] < 1e6
    assert max(counts.values()) > 3e9


def test_short_overfit_lowers_the_loss():
    """A tiny DiT fitting two fixed clips: the flow-matching loss falls well below its start."""
    from omegaconf import OmegaConf

    from configs.schema import FlowConfig
    from data.media import fit_to_bucket, to_model_range
    from data.synthetic import SyntheticVideoDataset
    from models.flow import RectifiedFlow

    torch.manual_seed(0)
    data = SyntheticVideoDataset(2, frames=2, height=8, width=8)
    x0 = torch.stack(
        [
            to_model_range(torch.from_numpy(fit_to_bucket(data.render(i)[0], 2, 8, 8))).permute(3, 0, 1, 2)
            for i in range(2)
        ]
    )
    y, mask = text(2)
    model = tiny_dit(hidden_size=64)
    flow = RectifiedFlow(OmegaConf.structured(FlowConfig()), (1, 2, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fixed = [torch.Generator().manual_seed(i) for i in range(2)]
    noise, t = flow.draw(x0.shape[1:], fixed)
    start = flow.training_loss(model, x0, y, mask, noise, t).item()
    for step in range(150):
        noise, t = flow.draw(
            x0.shape[1:], [torch.Generator().manual_seed(100 + 2 * step + i) for i in range(2)]
        )
        loss = flow.training_loss(model, x0, y, mask, noise, t)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    noise, t = flow.draw(x0.shape[1:], [torch.Generator().manual_seed(i) for i in range(2)])
    end = flow.training_loss(model, x0, y, mask, noise, t).item()
    assert end < 0.5 * start, (start, end)


def test_selective_checkpointing_keeps_the_matmuls_and_recomputes_the_rest():
    """train.checkpoint_policy (parallel/compute/fsdp.py recompute_context) on a DiT's blocks: the gradients
    are those without checkpointing under every policy; in backward, "all" runs each block's matmuls again,
    "selective" runs none again (their outputs were kept) but still recomputes the norms."""
    import collections

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallel.compute.fsdp import recompute_context

    def gemm(op):  # by name, not from parallel/compute/fsdp.py's list: a GEMM missing from it would show
        name = op.__name__
        return ("mm" in name or "convolution" in name or "attention" in name) and "backward" not in name

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func] += 1
            return func(*args, **(kwargs or {}))

    x, t, (y, mask) = torch.randn(2, 3, 2, 8, 8), torch.tensor([0.3, 0.8]), text()
    runs = {}
    for policy in (None, "all", "selective"):
        model = tiny_dit(depth=3)
        if policy is not None:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(
                    block, preserve_rng_state=False, **recompute_context(policy)
                )
        loss = model(x, t, y, mask).square().mean()
        with Count() as count:
            loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        matmuls = sum(n for op, n in count.ops.items() if gemm(op))
        norms = count.ops[torch.ops.aten.native_layer_norm.default]
        runs[policy] = grads, matmuls, norms
    reference, matmuls, norms = runs[None]
    print({policy: run[1:] for policy, run in runs.items()})  # (matmuls, norms) run in backward
    for policy in ("all", "selective"):
        grads = runs[policy][0]
        assert grads.keys() == reference.keys()
        assert all(torch.allclose(g, reference[n], atol=1e-6) for n, g in grads.items()), policy
    assert runs["all"][1] > matmuls and runs["selective"][1] == matmuls
    assert runs["selective"][2] > norms and runs["all"][2] > norms
