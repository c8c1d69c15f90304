"""PipeFusion and CFG-parallel sampling checks run by tests/test_pipefusion.py under torchrun (4 processes,
gloo, CPU).

One launch runs every layout: the process group is made once, and each case builds its own cfg /
PipeFusion / sequence groups from its layout (as parallel/lifecycle/runtime.py does) and samples through
parallel.drive.family_sampling.load_sampling and models/sampler.py generate_images (the transformer, the walk
and the decode infer.py runs). Every rank computes the serial reference itself (generate_images on the whole
model, one process). Token
grid 3 x 5 x 3 = 45 tokens in 15 rows: 2 and 4 patches are 7/8 and 3/4/4/4 rows, which no sequence-parallel
degree divides, so padded patches run too. Prints `ok <case> ...` per passed check; a mismatch raises.
"""

import contextlib
import datetime
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config  # noqa: E402
from models.dit.family import DiTFamily  # noqa: E402
from models.flow import RectifiedFlow  # noqa: E402
from models.image_condition import ImageCondition  # noqa: E402
from models.sampler import Sampling, generate_images, serial_denoise  # noqa: E402
from models.step_cache import Calibration, StepCache  # noqa: E402
from parallel.build.components import build_frozen, build_model  # noqa: E402
from parallel.build.init import materialize  # noqa: E402
from parallel.compute.layout import ParallelLayout  # noqa: E402
from parallel.drive.family_sampling import Weights, load_sampling  # noqa: E402
from parallel.lifecycle.faults import Faults  # noqa: E402
from parallel.lifecycle.runtime import sampling_groups, sequence_groups  # noqa: E402

TINY = Path(__file__).resolve().parent / "tiny.yaml"
STEPS, FRAMES, HEIGHT, WIDTH, GUIDANCE = 3, 3, 20, 12, 2.0
PROMPTS = ["a red square moving left", "a green circle moving up"]
EXACT = 1e-5  # the bound against the serial sampler, on pixels in [0, 1]
FAMILY = DiTFamily()  # the serial and the parallel samplings' (own_schedule changes its steps' schedule)


def config(patches=None, warmup=1, image=False):
    return load_config(
        TINY,
        [
            "model.size=DiT-demo",
            "model.absolute_positions=true",  # as the demo samples
            f"parallel.pipefusion_patches={patches or 'null'}",
            f"parallel.pipefusion_warmup={warmup}",
        ]
        + (["model.task=i2v", "model.image_dim=16", "model.image_tokens=3"] if image else []),
    )


def image_condition(vae):
    """A random image-to-video condition for the 2 prompts: 4 mask + C latent channels, CLIP features."""
    g = torch.Generator().manual_seed(5)
    C, T, h, w = vae.latent_shape(FRAMES, HEIGHT, WIDTH, (1, 2, 2))
    return ImageCondition(torch.randn(2, 4 + C, T, h, w, generator=g), torch.randn(2, 3, 16, generator=g))


def sample(parts, denoise_with=serial_denoise, decode=None):
    sampling = Sampling(PROMPTS, [0, 1], (FRAMES, HEIGHT, WIDTH), STEPS, GUIDANCE)
    images = generate_images(
        FAMILY, parts, sampling, denoise_with=denoise_with, device=parts.device, decode=decode
    )
    return torch.from_numpy(images)


def serial_reference(cache=None, image=False):
    cfg = config(image=image)
    parts = FAMILY.load(cfg, torch.device("cpu"), torch.float32, transformer=False)
    model = build_model(cfg, parts.text_encoder, parts.vae, weights=False)
    materialize(model, "cpu", cfg.train.seed, zero_init=False)  # as infer.py --random-weights
    parts.transformer, parts.cache = model.eval(), cache
    parts.condition = image_condition(parts.vae) if image else None
    return sample(parts)


def step_cache():
    """sample.cache=calibrated on a hand-made table: of the 3 steps, the middle one is skipped."""
    table = [float("nan"), 0.1, 0.1]
    cache = StepCache(Calibration(STEPS, table, [float("nan"), 0.9, 0.9]), threshold=0.3, max_skips=2)
    assert [s.compute for s in cache.plan(STEPS)] == [True, False, True]
    return cache


def stale_kv_reference(patches: int, warmup: int, cache=None):
    """PipeFusion's result written out on one process, independently of parallel/compute/pipefusion.py: after
    the warm-up steps the patches run one after the other through the whole model, and every layer attends
    to a full-sequence K/V buffer that holds this step's K/V for the patches done so far and the previous
    step's for the others (keys never written are masked)."""
    import torch.nn.functional as F

    cfg = config()
    text_encoder, vae = build_frozen(cfg, "cpu")
    model = build_model(cfg, text_encoder, vae, weights=False)
    materialize(model, "cpu", cfg.train.seed, zero_init=False)
    flow = RectifiedFlow(cfg.flow, cfg.model.patch_size)
    current = {}

    class BufferedAttention(torch.nn.Module):
        keys = values = written = None

        def forward(self, q, k, v):
            if self.keys is None:
                self.keys = k.new_zeros((*k.shape[:2], current["tokens"], k.shape[3]))
                self.values, self.written = (
                    torch.zeros_like(self.keys),
                    torch.zeros(current["tokens"], dtype=torch.bool),
                )
            a, b = current["range"]
            self.keys[:, :, a:b], self.values[:, :, a:b], self.written[a:b] = k, v, True
            return F.scaled_dot_product_attention(
                q, self.keys, self.values, attn_mask=self.written.view(1, 1, 1, -1)
            )

    for block in model.blocks:
        block.attn.inner_attention = BufferedAttention()
    with torch.no_grad():
        latent_shape = vae.latent_shape(FRAMES, HEIGHT, WIDTH, flow.patch_size)
        x = torch.stack(
            [torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
        )
        y, y_mask = text_encoder(PROMPTS, "cpu")
        neg_y, neg_mask = text_encoder([""] * 2, "cpu")
        y, y_mask = torch.cat([y, neg_y]), torch.cat([y_mask, neg_mask])
        sigmas = flow.sigmas(x, STEPS)
        pt, ph, pw = model.patch_size
        grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
        current["tokens"] = tokens = grid[0] * grid[1] * grid[2]
        rows = grid[0] * grid[1]
        bounds = [rows * i // patches * grid[2] for i in range(patches + 1)]
        plan, v, passes = (cache.plan(STEPS) if cache is not None else None), None, 0
        for i in range(STEPS):
            if plan is not None and not plan[i].compute:  # the cache reuses the last velocity, scaled
                x = flow.euler_step(x, v * plan[i].scale, sigmas, i)
                continue
            passes += 1  # the warm-up: the first `warmup` steps that run
            embedded, _ = model.embed(torch.cat([x, x]))
            rope = model.rope(grid, "cpu")
            cond = model.condition(sigmas[i].expand(4), y, y_mask)
            outputs = []
            for a, b in [(0, tokens)] if passes <= warmup else zip(bounds, bounds[1:]):
                current["range"] = (a, b)
                h = embedded[:, a:b]
                for block in model.blocks:
                    h = block(h, cond.c, cond.y, cond.block_mask, rope[a:b])
                outputs.append(model.final_layer(h, cond.temb))
            v_cond, v_uncond = torch.cat(outputs, dim=1).chunk(2)
            v = model.unpatchify(v_uncond + GUIDANCE * (v_cond - v_uncond), grid)
            x = flow.euler_step(x, v, sigmas, i)
        return torch.from_numpy(((vae.decode(x).clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).numpy())


def run_case(layout: ParallelLayout, patches=None, warmup=1, cache=None, image=False):
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=60)
    sequence = sequence_groups(layout, rank, timeout)
    runtime = SimpleNamespace(
        layout=layout,
        sequence=sequence,
        device=torch.device("cpu"),
        sampling=sampling_groups(layout, rank, timeout, sequence),
        faults=Faults.from_env(rank),
        control_group=None,  # the finiteness check's group: random weights are never checked
        bf16=lambda precision: False,
    )
    cfg = config(patches, warmup, image)
    request = SimpleNamespace(cache=cache, experts=None)
    weights = Weights(None, None, use_ema=True, random=True)
    parts, denoise_with, decode = load_sampling(
        cfg, runtime, FAMILY, request, weights, (), patches=patches or layout.pipefusion
    )
    if layout.pipefusion > 1:  # a stage holds only its blocks
        kept = sum(not hasattr(b, "stage") for b in parts.transformer.blocks)
        assert kept == 4 // layout.pipefusion, (kept, layout)
    parts.condition = image_condition(parts.vae) if image else None
    return sample(parts, denoise_with, decode)


@contextlib.contextmanager
def own_schedule():
    """The DiT family's schedule (of its steps, which both samplings take: every DiTFamily's in this
    process) made other than its flow's sigmas (their square roots: still from 1 to 0)."""
    family = FAMILY

    def schedule(parts, steps, latents):
        return parts.flow.schedule(parts.flow.sigmas(latents, steps).sqrt())

    family.steps.schedule = schedule
    try:
        yield
    finally:
        del family.steps.schedule  # the class's again


def report(name, error, bound=None):
    if bound is not None and not error <= bound:
        raise AssertionError(f"{name}: max abs difference {error:.2e} > {bound:.0e}")
    if dist.get_rank() == 0:
        print(f"ok {name} maxabs={error:.2e}", flush=True)


def main():
    import models.image_condition

    # image-to-video's condition is given as random tensors (image_condition): no CLIP encoder to load
    models.image_condition.image_inputs = lambda cfg, device: None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    reference = serial_reference()
    full = STEPS  # warm-up over every step: the whole sequence each step, which must equal serial exactly
    exact_cases = [
        ("pf4 M=4", ParallelLayout(pipefusion=4), 4),
        ("pf4 M=8", ParallelLayout(pipefusion=4), 8),
        ("pf2 M=2", ParallelLayout(dp=2, pipefusion=2), 2),
        ("pf2 M=4", ParallelLayout(dp=2, pipefusion=2), 4),
        ("pf2xu2", ParallelLayout(pipefusion=2, ulysses=2), 2),
        ("pf2xr2", ParallelLayout(pipefusion=2, ring=2), 4),
        ("pf2xcfg2", ParallelLayout(cfg=2, pipefusion=2), 2),
        ("cfg2", ParallelLayout(dp=2, cfg=2), None),
        ("cfg2xu2", ParallelLayout(cfg=2, ulysses=2), None),
    ]
    for name, layout, patches in exact_cases:
        report(
            f"{name} warmup=all vs serial",
            (run_case(layout, patches, warmup=full) - reference).abs().max().item(),
            EXACT if layout.pipefusion > 1 or layout.cfg > 1 else None,
        )
    # Warm-up 1: stale K/V. The result depends on the patches and the warm-up only, not on how many
    # stages the blocks are split into nor on what runs inside a stage.
    pipelined = run_case(ParallelLayout(dp=2, pipefusion=2), 4, warmup=1)
    report("pf2 M=4 warmup=1 vs serial", (pipelined - reference).abs().max().item())
    report(
        "pf2 M=4 warmup=1 vs the stale-K/V reference",
        (pipelined - stale_kv_reference(patches=4, warmup=1)).abs().max().item(),
        EXACT,
    )
    if (pipelined - reference).abs().max() < 1e-4:
        raise AssertionError("warm-up 1 gave the serial result: the patches did not run with stale K/V")
    for name, layout in [
        ("pf4", ParallelLayout(pipefusion=4)),
        ("pf2xu2", ParallelLayout(pipefusion=2, ulysses=2)),
        ("pf2xr2", ParallelLayout(pipefusion=2, ring=2)),
        ("pf2xcfg2", ParallelLayout(cfg=2, pipefusion=2)),
    ]:
        report(
            f"{name} M=4 warmup=1 vs pf2 M=4 warmup=1",
            (run_case(layout, 4, warmup=1) - pipelined).abs().max().item(),
            EXACT,
        )
    for warmup in (0, 2):
        result = run_case(ParallelLayout(pipefusion=4), 4, warmup=warmup)
        report(f"pf4 M=4 warmup={warmup} vs serial", (result - reference).abs().max().item())
        report(
            f"pf4 M=4 warmup={warmup} vs the stale-K/V reference",
            (result - stale_kv_reference(patches=4, warmup=warmup)).abs().max().item(),
            EXACT,
        )
    # The step cache: a skipped step runs on no stage and sends nothing; the last stage applies it.
    cached = serial_reference(step_cache())
    report("cached serial vs serial", (cached - reference).abs().max().item())
    if (cached - reference).abs().max() < 1e-4:
        raise AssertionError("the cache changed nothing: no step was skipped")
    report(
        "cached pf2xcfg2 warmup=all vs cached serial",
        (run_case(ParallelLayout(cfg=2, pipefusion=2), 2, warmup=full, cache=step_cache()) - cached)
        .abs()
        .max()
        .item(),
        EXACT,
    )
    report(
        "cached pf2xu2 M=4 warmup=1 vs the cached stale-K/V reference",
        (
            run_case(ParallelLayout(pipefusion=2, ulysses=2), 4, warmup=1, cache=step_cache())
            - stale_kv_reference(patches=4, warmup=1, cache=step_cache())
        )
        .abs()
        .max()
        .item(),
        EXACT,
    )
    # The schedule the family hands the walk (here one other than the flow's own sigmas) is the one PipeFusion
    # walks: its noise levels and Euler steps are the serial loop's.
    with own_schedule():
        scheduled = serial_reference()
        report("own schedule serial vs serial", (scheduled - reference).abs().max().item())
        if (scheduled - reference).abs().max() < 1e-4:
            raise AssertionError("the schedule of its own changed nothing")
        result = run_case(ParallelLayout(pipefusion=2, ulysses=2), 2, warmup=full)
        report(
            "own schedule pf2xu2 warmup=all vs own schedule serial",
            (result - scheduled).abs().max().item(),
            EXACT,
        )
    # Image-to-video: stage 0 concatenates the condition's latent, every stage reads its features.
    image_reference = serial_reference(image=True)
    for name, layout, patches in [
        ("pf2xcfg2", ParallelLayout(cfg=2, pipefusion=2), 2),
        ("pf2xu2", ParallelLayout(pipefusion=2, ulysses=2), 4),
        ("cfg2xu2", ParallelLayout(cfg=2, ulysses=2), None),
    ]:
        report(
            f"i2v {name} warmup=all vs i2v serial",
            (run_case(layout, patches, warmup=full, image=True) - image_reference).abs().max().item(),
            EXACT,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
