import math

import pytest
import torch
from omegaconf import OmegaConf

from configs.schema import FlowConfig
from models.dit.family import sample_dit
from models.flow import RectifiedFlow, expert_timesteps


def make_flow(**kw):
    return RectifiedFlow(OmegaConf.structured(FlowConfig(**kw)), patch_size=(1, 2, 2))


def test_shift_grows_with_resolution():
    flow = make_flow(shift=3.0, shift_reference_tokens=256)
    assert flow.shift_for(256) == pytest.approx(3.0)
    assert flow.shift_for(1024) == pytest.approx(6.0)


def test_a_zero_reference_fixes_the_shift_as_wan_does():
    flow = make_flow(shift=3.0, shift_reference_tokens=0)
    assert flow.shift_for(256) == flow.shift_for(32_760) == 3.0


def test_timesteps_follow_the_shifted_logit_normal():
    flow = make_flow(shift=3.0, shift_reference_tokens=16)
    g = torch.Generator().manual_seed(0)
    ts = torch.tensor([flow.sample_timestep(16, g) for _ in range(4000)])
    assert 0 < ts.min() and ts.max() < 1
    # median of logit-normal(0, 1) is 0.5; the shift maps it to 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert ts.median().item() == pytest.approx(0.75, abs=0.02)


def test_an_expert_draws_the_density_restricted_to_its_side_of_the_boundary():
    """Wan 2.2: the high-noise expert trains on t >= boundary, the low-noise one below. Each draw is the
    unrestricted sequence's next value on that side (so the density is the same, cut at the boundary)."""
    free = make_flow(shift=3.0, shift_reference_tokens=0)
    g = torch.Generator().manual_seed(0)
    sequence = [free.sample_timestep(16, g) for _ in range(4000)]
    for expert, inside in (("high", lambda t: t >= 0.875), ("low", lambda t: t < 0.875)):
        flow = make_flow(shift=3.0, shift_reference_tokens=0)
        flow.timesteps = expert_timesteps(expert, 0.875)
        g = torch.Generator().manual_seed(0)
        drawn = [flow.sample_timestep(16, g) for _ in range(200)]
        assert drawn == [t for t in sequence if inside(t)][:200]
    assert expert_timesteps("none", None) == (0.0, 1.0)


def test_draw_is_per_sample():
    flow = make_flow()
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    noise, t = flow.draw((3, 2, 4, 4), gens())
    noise2, t2 = flow.draw((3, 2, 4, 4), gens()[1:])
    assert torch.equal(noise[1:], noise2) and torch.equal(t[1:], t2)


def test_training_loss_is_zero_for_the_true_velocity():
    flow = make_flow()
    x0, noise, t = torch.randn(2, 3, 1, 4, 4), torch.randn(2, 3, 1, 4, 4), torch.tensor([0.3, 0.8])

    def oracle(x_t, t_, y, m):  # knows x0, so v = (x_t - x0) / t
        return (x_t - x0) / t_.view(-1, 1, 1, 1, 1)

    assert flow.training_loss(oracle, x0, None, None, noise, t).item() < 1e-10


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_sampler_with_exact_velocity_reaches_the_data(guidance):
    """With the exact velocity field of a single target, Euler sampling on any schedule lands on it;
    with guidance, on cond + g (cond - uncond) extrapolated from both targets."""
    flow = make_flow(shift=2.0)
    target = {"cond": torch.full((1, 3, 1, 4, 4), 0.5), "uncond": torch.full((1, 3, 1, 4, 4), -0.25)}

    def model(x, sigma, y, m):
        x0 = torch.cat([target["cond"] if yi.item() > 0 else target["uncond"] for yi in y[:, 0, 0]])
        return (x - x0) / sigma.view(-1, 1, 1, 1, 1)

    y, neg = torch.ones(1, 1, 1), -torch.ones(1, 1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = sample_dit(flow, model, torch.randn(1, 3, 1, 4, 4), y, mask, neg, mask, steps=10, guidance=guidance)
    expected = (
        target["uncond"] + guidance * (target["cond"] - target["uncond"]) if guidance != 1 else target["cond"]
    )
    # with guidance, the update is linear in the two exact velocities, so it stays exact
    assert torch.allclose(out, expected, atol=1e-4), (out.mean().item(), expected.mean().item())
    assert math.isfinite(out.abs().max().item())


def test_ti2v_gives_the_first_frame_at_t_zero_and_leaves_it_out_of_the_loss():
    """Wan2.2 TI2V's training: the model sees the given latent frame in place of frame 0, its tokens at
    t = 0 and the others at t, and the loss covers frames 1 onward only."""
    from models.image_condition import ConditionedModel, ImageCondition

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    t = torch.tensor([0.3, 0.8])
    seen = {}

    class Oracle(torch.nn.Module):
        patch_size = (1, 2, 2)

        def forward(self, x, t_tokens, y, y_mask):
            seen.update(x=x, t=t_tokens)
            v = noise - x0
            return torch.cat([v[:, :, :1] + 5.0, v[:, :, 1:]], dim=2)  # wrong on the given frame only

    model = ConditionedModel(Oracle(), ImageCondition(x0[:, :, :1], None, first_frame=True))
    flow = make_flow()
    assert flow.training_loss(model, x0, None, None, noise, t, from_frame=1).item() == 0
    assert flow.training_loss(model, x0, None, None, noise, t).item() > 1
    assert torch.equal(seen["x"][:, :, 0], x0[:, :, 0])
    assert seen["t"].shape == (2, 12) and (seen["t"][:, :4] == 0).all()
    assert torch.equal(seen["t"][:, 4:], t.view(2, 1).expand(2, 8))
