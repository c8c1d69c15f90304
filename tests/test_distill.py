"""Distillation (train.objective=dmd): the matching loss's gradient against DMD2's formula worked by hand,
the critic's loss against a flow-matching loss computed apart (the critic's adapter folded into a copy of
the base), the teacher (adapters off) against the base bit for bit, the student's simulated steps against
the sampler's own walk; runs against each other (a resume, ulysses and ring against one process), the
student sampled by diffusers' WanPipeline from the exported LoRA against infer.py, and the refusals."""

import copy
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import infer
import train
from configs.rundir import read_metrics
from models.distill import clean, matching_gradient, matching_loss, noised, simulate
from models.dit.family import DiTFamily, DiTParts, DiTText
from models.flow import RectifiedFlow
from models.loop import denoise, sigmas
from models.lora import active_adapter, adapted_modules, add_adapters, deltas_of, merge_deltas
from tests.conftest import ROOT, ranks, run_main
from tests.test_lora import tiny_wan
from tests.test_wan_pipeline import PROMPT, export, infer_sample, tiny_pipeline  # noqa: F401


def wan_with_both_adapters(seed=0):
    """A tiny Wan DiT with the student's and the critic's adapters, each random (B nonzero)."""
    model = tiny_wan(seed)
    add_adapters(model, 4, 8, ["blocks.*"], critic=True)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_A." in name or "_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 4, 2, 8, 8, generator=g), torch.randn(2, 7, 16, generator=g)
    return x, DiTText(y, torch.ones(2, 7, dtype=torch.bool))


def flow(shift: float) -> RectifiedFlow:
    config = dict(logit_mean=0, logit_std=1, shift=shift, shift_reference_tokens=0)
    return RectifiedFlow(OmegaConf.create(config), (1, 2, 2))


def test_the_teacher_is_the_base_bit_for_bit_and_each_adapter_its_own():
    base, model = tiny_wan(0), wan_with_both_adapters(0)
    x, cond = inputs()
    t = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        plain = base(x, t, cond.text, cond.text_mask)
        with active_adapter(model, None):
            teacher = model(x, t, cond.text, cond.text_mask)
        student = model(x, t, cond.text, cond.text_mask)  # the generator's by default
        with active_adapter(model, "critic"):
            critic = model(x, t, cond.text, cond.text_mask)
    assert torch.equal(teacher, plain)
    # each adapter is the one folded alone into a copy of the base
    for which, out in (("lora", student), ("critic", critic)):
        folded = copy.deepcopy(base)
        merge_deltas(folded, adapter_delta(model, which))
        with torch.no_grad():
            assert torch.allclose(out, folded(x, t, cond.text, cond.text_mask), atol=1e-5), which
    assert (student - critic).abs().max() > 1e-2
    assert all(m.lora_active == "lora" for m in adapted_modules(model).values())  # put back


def test_the_critic_adapter_doubles_the_adapters_and_is_trained_apart():
    """What scripts/bench_lora.py's distillation rows count: the critic's adapters have the student's shapes;
    and the EMA (the student's, sampled) leaves the critic out."""
    from parallel.build.lora import AdapterEMA

    one, both = tiny_wan(0), tiny_wan(0)
    add_adapters(one, 4, 8, ["blocks.*"])
    add_adapters(both, 4, 8, ["blocks.*"], critic=True)
    count = lambda m, key: sum(p.numel() for n, p in m.named_parameters() if key in n)  # noqa: E731
    assert count(both, "critic_") == count(both, "lora_") == count(one, "lora_") > 0
    assert AdapterEMA(both).names == AdapterEMA(one).names


def adapter_delta(model, which: str) -> dict:
    return deltas_of(
        {
            name: (getattr(m, f"{which}_A").weight, getattr(m, f"{which}_B").weight, m.lora_scale)
            for name, m in adapted_modules(model).items()
        }
    )


def test_the_matching_gradient_is_dmd2s_formula_worked_by_hand():
    """x0 = [[1, 2], [3, -1]] (2 samples of 2 values); the teacher predicts [[0, 2], [3, 1]], the critic
    [[1, 1], [2, 2]]. Normalisers mean|x0 - real| = (1 + 0) / 2 = 0.5 and (0 + 2) / 2 = 1; the gradient
    (fake - real) / normaliser = [[2, -2], [-1, 1]]; the loss's gradient with respect to x0 is that over
    the 4 elements, and its value 0.5 * mean(g^2) = 0.5 * (4 + 4 + 1 + 1) / 4 = 1.25."""
    x0 = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
    real = torch.tensor([[0.0, 2.0], [3.0, 1.0]])
    fake = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    assert torch.equal(matching_gradient(x0.detach(), real, fake), torch.tensor([[2.0, -2.0], [-1.0, 1.0]]))
    loss = matching_loss(x0, real, fake)
    loss.backward()
    assert loss.item() == pytest.approx(1.25)
    assert torch.allclose(x0.grad, torch.tensor([[2.0, -2.0], [-1.0, 1.0]]) / 4)
    # a sample the teacher predicts exactly (normaliser 0) takes no step rather than NaN
    assert torch.equal(matching_gradient(real, real, fake)[0], torch.zeros(2))


def test_the_critics_loss_is_the_flow_matching_loss_of_the_same_samples():
    """The family's training loss under the critic's adapter equals MSE(v, noise - x0) computed on a copy
    of the base with the critic folded in."""
    base, model = tiny_wan(0), wan_with_both_adapters(0)
    sample, cond = inputs(1)
    noise, sigma = (
        torch.randn(sample.shape, generator=torch.Generator().manual_seed(2)),
        torch.tensor([0.2, 0.9]),
    )
    flow = RectifiedFlow(
        OmegaConf.create(dict(logit_mean=0, logit_std=1, shift=1, shift_reference_tokens=0)), (1, 2, 2)
    )
    with active_adapter(model, "critic"), torch.no_grad():
        ours = DiTFamily().objective.loss(
            DiTParts(None, None, None, None), flow, model, sample, cond, noise, sigma
        )
    folded = copy.deepcopy(base)
    merge_deltas(folded, adapter_delta(model, "critic"))
    with torch.no_grad():
        v = folded(noised(sample, noise, sigma), sigma, cond.text, cond.text_mask)
    assert ours.item() == pytest.approx(((v - (noise - sample)) ** 2).mean().item(), rel=1e-6)


def test_the_students_simulated_steps_are_the_samplers_walk():
    """simulate's k Euler steps, then the clean prediction at the k-th level, are the sampler's walk of all
    K steps when k = K - 1 (its last Euler step lands on the prediction)."""
    model = wan_with_both_adapters(0)
    noise, cond = inputs(3)
    levels = sigmas(3, 0, {"shift": 3.0})
    batch = noise.shape[0]

    def velocity(x, s):
        with torch.no_grad():
            return model(x, s.expand(batch) if s.dim() == 0 else s, cond.text, cond.text_mask)

    walked = denoise(flow(3.0).schedule(levels), noise, velocity)
    x = simulate(velocity, noise, flow(3.0).schedule(levels), 2)
    ours = clean(x, levels[2].expand(batch), velocity(x, levels[2].expand(batch)))
    assert torch.allclose(ours, walked, atol=1e-5)


DMD = ["train.objective=dmd", "lora.rank=4", "lora.alpha=8", "distill.steps=2", "distill.critic_updates=2",
       "train.ema_decay=0.0", "train.log_every=1", "train.checkpoint_every=1",
       "sample.guidance=5.0"]  # fmt: skip


def losses(run) -> dict:
    """{step: (the critic's loss, the student's or None: no student turn since the run (re)started)}."""
    return {m["step"]: (m["loss"], m.get("dmd_loss")) for m in read_metrics(run)}


@pytest.fixture(scope="module")
def straight(tiny_pipeline, tmp_path_factory):  # noqa: F811
    """Three distillation steps on one process, the reference of the resumed and split runs."""
    run = tmp_path_factory.mktemp("distill") / "straight"
    assert (
        run_main(
            train, ["--config", str(tiny_pipeline[1]), *DMD, f"run.output_dir={run}", "train.max_steps=3"]
        )
        == 0
    )
    return run


@pytest.mark.slow  # three runs, two samplings, an export: the fast tier's distillation is Qwen-Image's row
def test_a_distillation_resumes_exactly_and_its_student_samples_unguided(
    tiny_pipeline,  # noqa: F811
    straight,
    tmp_path,
    capsys,
):
    """Three steps straight, and one then two resumed: the same critic and matching losses (the critic's
    optimizer and the student's are kept apart and both resume; the resumed run starts on a critic's turn,
    so its first step logs no student's loss rather than a stale one). Each checkpoint's health judges the
    critic's loss, the one logged as `loss`. The run's config.yaml samples the student
    in its 2 steps without guidance, as infer.py on the recipe with run.output_dir does; --guidance is
    refused; flow-matching training refuses to resume it. The student exported as a LoRA, loaded by
    WanPipeline.load_lora_weights, at its 2 steps and guidance 1 (off), samples what infer.py samples."""
    import export
    from diffusers import WanPipeline

    pipe_dir, recipe = tiny_pipeline
    common = ["--config", str(recipe), *DMD]
    run = tmp_path / "run"
    assert run_main(train, common + [f"run.output_dir={run}", "train.max_steps=1"]) == 0
    assert run_main(train, common + [f"run.output_dir={run}", "train.max_steps=3"]) == 0
    a, b = losses(straight), losses(run)
    assert a.keys() == b.keys() == {1, 2, 3} and None not in a[2]
    assert b[1] == a[1] and b[2] == (a[2][0], None) and b[3] == a[3], (a, b)
    assert a[1][1] != a[3][1] and a[1][0] != a[2][0]  # the losses move
    from parallel.checkpoints.checkpoint_reading import read_trainer_state

    assert read_trainer_state(straight / "checkpoints" / "step_3")["health"]["loss"] == a[3][0]
    config = OmegaConf.load(run / "config.yaml")
    assert (config.sample.steps, config.sample.guidance, config.distill.guidance) == (2, 1.0, 5.0)
    ours = infer_sample(run / "config.yaml", run, tmp_path / "ours.npy")
    again = infer_sample(recipe, run, tmp_path / "again.npy")  # the recipe: sample.steps 3, guidance 5
    assert np.array_equal(ours, again)
    out = tmp_path / "student.safetensors"
    assert export.main(["--checkpoint", str(run), "--lora", "--output", str(out)]) == 0
    pipe = WanPipeline.from_pretrained(pipe_dir)
    base = student_video(pipe)
    pipe.load_lora_weights(str(out))
    theirs = student_video(pipe)
    diff, moved = float(np.abs(theirs - ours).max()), float(np.abs(base - ours).max())
    with capsys.disabled():
        print(f"Wan student: diffusers vs infer.py {diff:.1e}; the base at the same steps {moved:.1e}")
    assert diff <= 1e-3 and moved > 100 * diff
    capsys.readouterr()
    assert run_main(infer, ["--config", str(recipe), f"run.output_dir={run}", "--guidance", "5"]) == 2
    assert "distilled to sample without guidance" in capsys.readouterr().err
    assert run_main(train, ["--config", str(recipe), "lora.rank=4", "lora.alpha=8", f"run.output_dir={run}",
                            "train.max_steps=4"]) == 2  # fmt: skip
    assert "trained a distillation (train.objective=dmd)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, overrides, refused",
    [
        (dict(guidance=5.0), [], "--guidance 5: checkpoint ck is a 2-step student distilled to sample "
         "without guidance (its teacher's 4 is in it): drop --guidance"),
        ({}, ["sample.guidance=5"], "sample.guidance=5.0: checkpoint ck is a 2-step student distilled to "
         "sample without guidance (its teacher's 4 is in it): drop sample.guidance"),
        ({}, ["sample.stg=1"], "sample.stg=1.0: checkpoint ck is a 2-step student distilled to sample one "
         "pass a step, with stg 0.0: drop sample.stg"),
        ({}, ["sample.stg=0", "sample.guidance=1"], None),  # the student's own values: taken
        (dict(steps=4), [], None),
        ({}, ["sample.steps=4"], None),
    ],
)  # fmt: skip
def test_a_students_sampling_is_its_own_and_a_command_that_says_otherwise_is_named(
    monkeypatch, flags, overrides, refused
):
    """infer.py on a distilled student (parallel/drive/distill.py student_sampling): its steps, guidance 1
    and its one-pass terms (LTX-2's STG off) replace the recipe's; a guidance or term the command line sets
    otherwise (a flag or a recipe key) is refused naming it; another step count is taken and warned about."""
    from types import SimpleNamespace

    from configs import load_config
    from parallel.drive import distill

    record = dict(steps=2, guidance=1.0, teacher_guidance=4.0, terms=dict(stg=0.0))
    monkeypatch.setattr(distill, "find_checkpoint", lambda *a: "ck")
    monkeypatch.setattr(distill, "read_trainer_state", lambda checkpoint: {"distill": record})
    cfg = load_config(ROOT / "configs" / "ltx-2.yaml", overrides)  # sample.stg 1 and guidance 3 there
    args = SimpleNamespace(checkpoint=None, random_weights=False, overrides=overrides,
                           **{"guidance": None, "steps": None, **flags})  # fmt: skip
    said = []
    if refused:
        with pytest.raises(ValueError) as error:
            distill.student_sampling(cfg, args, said.append)
        assert str(error.value) == refused
        return
    distill.student_sampling(cfg, args, said.append)
    steps = flags.get("steps", 4 if "sample.steps=4" in overrides else 2)
    assert (cfg.sample.steps, cfg.sample.guidance, cfg.sample.stg) == (steps, 1.0, 0.0)
    told = {4: ["--steps 4" if flags else "sample.steps=4"], 2: []}[steps]
    assert said == [f"{t}: checkpoint ck was distilled to sample in 2 steps" for t in told], said


def student_video(pipe) -> np.ndarray:
    return pipe(
        prompt=PROMPT, negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=2,
        guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np",
        max_sequence_length=40,
    ).frames[0]  # fmt: skip


@pytest.mark.slow  # a precompute and a run: the whole suite's
def test_a_distillation_on_precomputed_latents_reads_no_text_encoder(tiny_pipeline, tmp_path, monkeypatch):  # noqa: F811
    """precompute_latents.py with the distillation's recipe stores the student's previews (its no-guidance
    scale), so that the distillation on the latents never loads the text encoder."""
    import precompute_latents

    from models.families import family_named

    argv = [
        "--config",
        str(tiny_pipeline[1]),
        *DMD,
        "train.max_steps=1",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    latents = tmp_path / "latents"
    assert run_main(precompute_latents, [*argv, "--out", str(latents)]) == 0
    family, loaded = family_named("dit"), []
    load = type(family).load
    monkeypatch.setattr(
        type(family), "load", lambda self, *a, **k: loaded.append(k.get("texts", True)) or load(self, *a, **k)
    )
    assert run_main(train, [*argv, f"data.latents={latents}"]) == 0
    assert loaded == [False], loaded


@pytest.mark.slow  # two launches of 2 processes
def test_distillation_under_ulysses_and_ring_is_one_process(tiny_pipeline, straight, tmp_path):  # noqa: F811
    """Three steps under ulysses 2 (resumed from a one-process step 2, FSDP2 sharding the adapters over both
    ranks) and under ring 2 from the start: the critic's and the student's losses are one process's."""
    pipe_dir, recipe = tiny_pipeline
    common = ["--config", str(recipe), *DMD]
    resumed, ring = tmp_path / "resumed", tmp_path / "ring"
    assert run_main(train, common + [f"run.output_dir={resumed}", "train.max_steps=2"]) == 0
    for run, layout in ((resumed, "parallel.ulysses=2"), (ring, "parallel.ring=2")):
        result = ranks(2, "train.py", *common, f"run.output_dir={run}", "train.max_steps=3", layout)
        assert result.returncode == 0, result.stderr[-3000:]
    a = losses(straight)
    for run in (resumed, ring):
        b = losses(run)
        assert b.keys() == {1, 2, 3}
        worst = max(abs(x - y) / abs(x) for step in a for x, y in zip(a[step], b[step]))
        print(f"distillation under {run.name}: largest relative difference {worst:.1e}")
        assert worst <= 1e-5, (run.name, a, b)


FULL = [*[a for a in DMD if not a.startswith("lora.")], "lora.rank=0"]


@pytest.mark.slow  # four runs (one of 2 processes), two samplings, an export
def test_full_copies_resume_split_and_export(tiny_pipeline, tmp_path, capsys):  # noqa: F811
    """lora.rank=0: a full student and a full critic, each its own sharded model beside the frozen teacher.
    Three steps straight; one step, then two resumed (the critic's weights and both AdamW states come back
    from the checkpoint, the teacher from model.pretrained); and the last step under ring 2, resumed from a
    one-process step 2 with FSDP2 resharding all three models over both ranks: the same critic's and
    student's losses (relative 1e-5). The student, exported as a whole WanPipeline, samples at its 2 steps
    without guidance what infer.py samples from the run, and not what the teacher samples there."""
    from diffusers import WanPipeline

    pipe_dir, recipe = tiny_pipeline
    common = ["--config", str(recipe), *FULL]
    straight, resumed, ring = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ring"
    assert run_main(train, common + [f"run.output_dir={straight}", "train.max_steps=3"]) == 0
    assert "a full copy each" in capsys.readouterr().out
    for run, steps in ((resumed, 1), (resumed, 3), (ring, 2)):
        assert run_main(train, common + [f"run.output_dir={run}", f"train.max_steps={steps}"]) == 0
    result = ranks(2, "train.py", *common, f"run.output_dir={ring}", "train.max_steps=3", "parallel.ring=2")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b, c = losses(straight), losses(resumed), losses(ring)
    assert a.keys() == b.keys() == c.keys() == {1, 2, 3} and None not in a[2]
    assert b[1] == a[1] and b[2] == (a[2][0], None) and b[3] == a[3], (a, b)
    assert a[1][1] != a[3][1] and a[1][0] != a[2][0]  # the losses move
    worst = max(abs(x - y) / abs(x) for x, y in zip(a[3], c[3]))
    print(f"full-copy distillation under ring 2: largest relative difference {worst:.1e}")
    assert worst <= 1e-5, (a, c)
    ours = infer_sample(straight / "config.yaml", straight, tmp_path / "ours.npy")
    out = tmp_path / "exported"
    assert export.main(["--checkpoint", str(straight), "--pipeline", "--output", str(out)]) == 0
    theirs = student_video(WanPipeline.from_pretrained(out))
    teacher = student_video(WanPipeline.from_pretrained(pipe_dir))
    diff, moved = float(np.abs(theirs - ours).max()), float(np.abs(teacher - ours).max())
    with capsys.disabled():
        print(f"full Wan student: diffusers vs infer.py {diff:.1e}; the teacher at its steps {moved:.1e}")
    assert diff <= 1e-3 and moved > 100 * diff
    other = tmp_path / "other"  # the teacher's weights changed under the run: refused on a resume
    shutil.copytree(pipe_dir / "transformer", other)
    weights = next(other.glob("*.safetensors"))
    state = load_file(weights)
    save_file({k: v + 1e-3 for k, v in state.items()}, weights)
    capsys.readouterr()
    argv = [f"run.output_dir={straight}", "train.max_steps=4", f"model.pretrained={other}"]
    assert run_main(train, common + argv) == 2
    assert "now holds other weights" in capsys.readouterr().err


def test_distillation_refusals_name_the_cause(tmp_path, capsys):
    """Each refused before anything is read (the teacher need not exist) or the run directory is made."""
    from parallel.drive.distill import check_student_sigmas

    run = tmp_path / "run"
    common = [
        "--config",
        "configs/demo.yaml",
        *DMD,
        f"run.output_dir={run}",
        f"model.pretrained={tmp_path / 'x'}",
    ]
    for extra, said in (
        (["model.pretrained="], "distils model.pretrained (the teacher), which is not set"),
        (["lora.rank=0", "model.base_dtype=float8"], "full copies of the student and the critic, and "
         "model.base_dtype=float8"),
        (["distill.min_sigma=0.9", "distill.max_sigma=0.5"], "0 <= min_sigma < max_sigma <= 1"),
        (["model.task=i2v"], "model.task=i2v"),
        (["train.objective=other"], "'train.objective' is 'other'"),
        (["lora.init_from=some.safetensors"], "the student would start from that LoRA"),
    ):
        assert run_main(train, common + extra) == 2, extra
        assert said in capsys.readouterr().err, extra
    assert not run.exists()  # refused before the run directory is made
    # Qwen-Image's shift_terminal cannot stretch one step: 0 / 0
    one = sigmas(1, 4096, {"shift_terminal": 0.02, "use_dynamic_shifting": True})
    with pytest.raises(ValueError, match="distill.steps=1: Qwen-Image's schedule at 1 steps"):
        check_student_sigmas(one, 1, "Qwen-Image")
    check_student_sigmas(sigmas(2, 4096, {"shift_terminal": 0.02, "use_dynamic_shifting": True}), 2, "Q")
    # a family whose training conditions on given images (Qwen-Image-Edit's references)
    from types import SimpleNamespace

    from parallel.drive.distill import check_distillation

    objective = SimpleNamespace(check_distillation=lambda cfg: None)
    given = lambda cfg: ("references",)  # noqa: E731
    edit = SimpleNamespace(title="Qwen-Image-Edit", objective=objective, given_frames=given)
    dmd = OmegaConf.create(dict(train=dict(objective="dmd"), distill=dict(guidance=4.0)))
    with pytest.raises(ValueError, match=r"conditions on given images \(references\)"):
        check_distillation(dmd, edit)
    # an EMA that would still be mostly the teacher when the run ends is said at start
    from parallel.drive.distill import averaged_teacher

    cfg = OmegaConf.create(dict(train=dict(objective="dmd", max_steps=1000, ema_decay=0.999),
                                distill=dict(critic_updates=5), sample=dict(use_ema=True)))  # fmt: skip
    assert "keeps 82% of the teacher" in averaged_teacher(cfg)
    cfg.sample.use_ema = False  # export still takes the EMA
    assert "scripts/export.py --no-ema" in averaged_teacher(cfg)
    cfg.train.ema_decay = 0.95
    assert averaged_teacher(cfg) == ""
