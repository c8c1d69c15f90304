"""train.objective=dmd: distillation on the sharded model (models/distill.py's pieces), checked before
anything starts, recorded in every checkpoint, and read back by infer.py.

The generator (the `lora` adapters), the critic (the `critic` adapters) and the teacher (neither: the frozen
base) are one sharded model, each forward picking its adapter (models/lora.py active_adapter); or, with
lora.rank=0, three sharded models: the generator (train.py's), the critic and the teacher. Every rank runs
the same forwards in the same order, so FSDP2's gathers and the sequence-parallel exchanges pair up: how many
student steps a step simulates comes from the step's seed alone; what differs per sample (its noise and noise
levels) comes from the sample's own generator, so one process and every layout draw the same.
"""

import copy
import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from models.distill import clean, draw_noise, draw_sigmas, matching_loss, noised, simulate
from models.lora import active_adapter, is_critic
from parallel.build.lora import describe_base
from parallel.checkpoints.checkpoint_files import CheckpointError, find_checkpoint
from parallel.checkpoints.checkpoint_reading import read_trainer_state
from parallel.compute.fsdp import reshard_all
from parallel.drive.stored_previews import preview_size


@dataclass
class Distiller:
    """What a distillation step needs besides the generator's optimizer (train.py's)."""

    steps: int  # the student's
    guidance: float  # the teacher's scale
    low: float  # the noise levels of the matching and critic losses: u in [low, high], shifted
    high: float
    shift: float | None  # None: the flow's shift at the sample's token count (training's)
    critic_updates: int  # critic updates per generator update
    critic: torch.optim.Optimizer
    params: list  # the critic's adapters, or its model's parameters
    lr_ratio: float  # the critic's learning rate over train.lr
    matching: torch.Tensor | None = None  # the last generator turn's loss, for the metrics
    # full copies (lora.rank=0): the critic's and the teacher's own sharded models; None: adapters
    critic_model: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None

    @contextmanager
    def net(self, model, role: str):
        """The module that plays `role` (generator, critic, teacher) in the forwards inside: `model` with
        that role's adapter (or none: the teacher), or its own model. A backward that recomputes a forward
        (activation checkpointing) must run inside the same choice."""
        if self.critic_model is None:
            with active_adapter(model, {"generator": "lora", "critic": "critic", "teacher": None}[role]):
                yield model
        else:
            yield {"generator": model, "critic": self.critic_model, "teacher": self.teacher}[role]


def distilled_recipe(cfg, family):
    """The recipe as a distillation runs it (what config.yaml records): the teacher's guidance kept in
    distill.guidance (and the family's other terms in distill.<key>: LTX-2's), and sample.steps,
    sample.guidance and those terms the student's (its steps, one pass a step), so that the previews and
    `infer.py --config <run>/config.yaml` sample the student as it will be used."""
    if cfg.train.objective != "dmd":
        return cfg
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    for key, student in (("guidance", family.guidance.unguided), *family.guidance.student_terms):
        if out.distill[key] is None:
            out.distill[key] = out.sample[key]
        out.sample[key] = student
    out.sample.steps = out.distill.steps
    OmegaConf.set_readonly(out, True)
    return out


def describe_distillation(cfg) -> str:
    """The start-up line's words for a distillation ("" for flow matching)."""
    if cfg.train.objective != "dmd":
        return ""
    dc = cfg.distill
    how = "a full copy each, beside the frozen teacher"
    if cfg.lora.rank:
        how = "two LoRAs on the frozen teacher"
    return (
        f"distillation (DMD2): a {dc.steps}-step student and its critic, {how}; the teacher guided at "
        f"{dc.guidance:g}; {dc.critic_updates} critic update(s) per student update"
    )


def check_distillation(cfg, family) -> None:
    """What a distillation refuses by name before anything starts (configs/ refused a recipe without a
    teacher or adapters already): a family or task whose distillation is not built (given images: image-to-
    video, edit references), and a teacher's scale the family refuses."""
    if cfg.train.objective != "dmd":
        return
    family.objective.check_distillation(cfg)
    given = family.given_frames(cfg)
    if given:
        raise ValueError(
            f"train.objective=dmd: {family.title}'s training here conditions on given images "
            f"({', '.join(given)}), and a student conditioned on them is not built: distil a text-to-video "
            "or text-to-image recipe"
        )
    family.check_guidance(cfg, cfg.distill.guidance)


def averaged_teacher(cfg) -> str:
    """What is wrong (else "") with an EMA that would still be mostly the teacher at the end: it moves on
    the student's turns alone (train.max_steps / distill.critic_updates of them), and scripts/export.py
    exports it (infer.py and the previews sample it unless sample.use_ema=false)."""
    if cfg.train.objective != "dmd":
        return ""
    turns = -(-cfg.train.max_steps // cfg.distill.critic_updates)  # steps 0, k, 2k, ... below max_steps
    left = cfg.train.ema_decay**turns
    if left <= 0.5:
        return ""
    return (
        f"train.ema_decay={cfg.train.ema_decay:g} over the student's {turns} turns (train.max_steps / "
        f"distill.critic_updates) keeps {left:.0%} of the teacher in the EMA that export, infer.py and the "
        "previews use: set train.ema_decay lower (0.95 for a few hundred turns), or take the student's own "
        "adapters (sample.use_ema=false; scripts/export.py --no-ema)"
    )


def check_student_sigmas(sigmas: torch.Tensor, steps: int, title: str) -> None:
    """The family's schedule at the student's step count must walk down from noise: a schedule that cannot
    make that many steps (Qwen-Image's shift_terminal stretches one step into 0/0) is refused by name."""
    good = bool(torch.isfinite(sigmas).all()) and bool((sigmas[:-1] > sigmas[1:]).all()) and sigmas[0] > 0
    if not good:
        raise ValueError(
            f"distill.steps={steps}: {title}'s schedule at {steps} steps gives the noise levels "
            f"{[round(float(s), 4) for s in sigmas]}, which do not fall from noise to 0: choose more steps"
        )


def distill_record(cfg, sigmas: torch.Tensor | None = None) -> dict | None:
    """What trainer_state.pt says of a distillation (None: flow matching): the student's steps, the noise
    levels they walk at the preview size, the scale that samples it unguided and the teacher's."""
    if cfg.train.objective != "dmd":
        return None
    record = {"steps": cfg.distill.steps, "guidance": cfg.sample.guidance, "teacher": cfg.model.pretrained}
    record["teacher_guidance"] = cfg.distill.guidance
    if sigmas is not None:
        record["sigmas"] = [float(s) for s in sigmas]
    return record


def student_record(cfg, run) -> dict | None:
    """A distillation's record (None: flow matching), with the noise levels its student walks at the preview
    size, checked (`run`: the FamilyRun, whose frozen parts hold the scheduler's config)."""
    if cfg.train.objective != "dmd":
        return None
    family = run.family
    space, patch = family.geometry(cfg)
    # a schedule reads its size alone
    latents = torch.empty(1, *space.latent_shape(*preview_size(cfg), patch))
    sigmas = family.steps.schedule(run.parts, cfg.distill.steps, latents).sigmas
    check_student_sigmas(sigmas, cfg.distill.steps, family.title)
    record = distill_record(cfg, sigmas)
    record["terms"] = {key: cfg.sample[key] for key, _ in family.guidance.student_terms}
    if not cfg.lora.rank:  # full copies: the teacher is read again on a resume (a LoRA's base is checked)
        record["teacher_fingerprint"] = describe_base(cfg.model.pretrained).fingerprint
    return record


def check_objective(checkpoint, cfg) -> None:
    """Refuse to resume a distillation as flow-matching training or the reverse, or another student."""
    saved = read_trainer_state(checkpoint).get("distill")
    ours = distill_record(cfg)
    if bool(saved) != bool(ours):
        theirs = "a distillation (train.objective=dmd)" if saved else "flow matching (train.objective=flow)"
        raise CheckpointError(
            f"checkpoint {checkpoint} trained {theirs}; this recipe sets "
            f"train.objective={cfg.train.objective}. Use the recipe it was trained with (its run's "
            "config.yaml), or train.resume=none to start afresh"
        )
    if saved and saved["steps"] != ours["steps"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} distils a {saved['steps']}-step student; this recipe asks for "
            f"distill.steps={ours['steps']}: set it back, or train.resume=none"
        )
    fingerprint = (saved or {}).get("teacher_fingerprint")
    if fingerprint and describe_base(cfg.model.pretrained).fingerprint != fingerprint:
        raise CheckpointError(
            f"checkpoint {checkpoint} distils the teacher {saved['teacher']} as it was when the run began, "
            f"and model.pretrained={cfg.model.pretrained} now holds other weights: name that teacher, or "
            "train.resume=none to start afresh"
        )


def build_distiller(cfg, model, build_optimizer, copies=None) -> tuple[list, Distiller | None]:
    """(the generator's trainable parameters, the Distiller or None); `build_optimizer(tc, params)`:
    train.py's AdamW; `copies`: (the critic's model, the teacher's) of full copies (lora.rank=0)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.train.objective != "dmd":
        return [p for _, p in named], None
    dc, tc = cfg.distill, cfg.train
    critic_model, teacher = copies if copies is not None else (None, None)
    if critic_model is None:
        critic = [p for n, p in named if is_critic(n)]
    else:
        critic = [p for p in critic_model.parameters() if p.requires_grad]
    lr = dc.critic_lr if dc.critic_lr is not None else tc.lr
    distiller = Distiller(
        dc.steps, dc.guidance, dc.min_sigma, dc.max_sigma, dc.shift, dc.critic_updates,
        build_optimizer(tc, critic), critic, lr / tc.lr, critic_model=critic_model, teacher=teacher,
    )  # fmt: skip
    return [p for n, p in named if not is_critic(n)], distiller


def distill_backward(d: Distiller, seed: int, step: int, run, model, flow, inputs, rngs) -> tuple:
    """One step's forwards and backwards: (the critic's loss, whether the generator took its turn). On a
    generator turn (every distill.critic_updates steps) the matching loss's gradient reaches the generator's
    adapters; every step the critic learns the flow-matching loss on the student's (detached) samples.
    `run`: the FamilyRun; `rngs`: each sample's generator (objective.draw drew the student's noise)."""
    x0, cond, noise, _, uncond = inputs
    family, parts, batch, objective = run.family, run.parts, x0.shape[0], run.family.objective
    start = objective.student_noise(parts, x0, cond, noise)
    schedule = family.steps.schedule(parts, d.steps, start)  # the student's noise levels and solver
    sigmas = schedule.sigmas.to(x0.device)
    shift = d.shift if d.shift is not None else flow.shift_for(flow.num_tokens(x0))
    k = random.Random(f"dmd {seed} {step}").randrange(d.steps)  # the same on every rank
    generator_turn = step % d.critic_updates == 0
    # the backward runs inside its forward's adapter: activation checkpointing recomputes that forward
    with d.net(model, "generator") as generator:
        velocity = lambda x, s: objective.student_velocity(family, parts, generator, x, s, cond)  # noqa: E731
        x = simulate(velocity, start, schedule, k)
        with torch.set_grad_enabled(generator_turn):
            sample = clean(x, sigmas[k].expand(batch), velocity(x, sigmas[k].expand(batch)))
        if generator_turn:
            matching = generator_loss(d, run, model, sample, cond, uncond, rngs, shift)
            matching.backward()
            d.matching = matching.detach()
    sigma = draw_sigmas(rngs, d.low, d.high, shift)
    with d.net(model, "critic") as critic:
        noise = draw_noise(sample.shape[1:], rngs)
        loss = objective.sample_loss(parts, flow, critic, sample.detach(), cond, noise, sigma)
        loss.backward()
    return loss, generator_turn


def generator_loss(d: Distiller, run, model, sample, cond, uncond, rngs, shift: float) -> torch.Tensor:
    """DMD's matching loss on the student's `sample`: noised to a drawn level, predicted clean by the guided
    teacher (no adapter) and by the critic, both without gradients."""
    family, parts, objective = run.family, run.parts, run.family.objective
    sigma = draw_sigmas(rngs, d.low, d.high, shift).to(sample.device)
    eps = draw_noise(sample.shape[1:], rngs).to(sample.device, sample.dtype)
    with torch.no_grad():
        x = noised(sample.detach(), eps, sigma)
        with d.net(model, "teacher") as teacher:
            v_real = objective.teacher_velocity(family, parts, teacher, x, sigma, cond, uncond, d.guidance)
        if d.teacher is not None:  # no backward reshards a frozen copy: FSDP2 keeps its last block gathered
            reshard_all(d.teacher)
        with d.net(model, "critic") as critic:
            v_fake = objective.student_velocity(family, parts, critic, x, sigma, cond)
    return matching_loss(sample, clean(x, sigma, v_real), clean(x, sigma, v_fake))


def student_sampling(cfg, args, say) -> None:
    """infer.py on a distilled student's checkpoint (in place on `cfg`): its step count unless the command
    gives one (--steps or sample.steps: warned about), no guidance and the family's one-pass terms; a
    guidance (--guidance or sample.guidance) or another term the command sets otherwise is refused by name.
    `say`: a warning printer. A checkpoint that cannot be found is left to the weights' own check."""
    try:
        checkpoint = find_checkpoint(cfg, args.checkpoint, args.random_weights)
    except CheckpointError:
        return
    record = read_trainer_state(checkpoint).get("distill") if checkpoint is not None else None
    if not record:
        return
    named = {override.split("=", 1)[0] for override in args.overrides}  # what the command line sets

    def given(flag, key):  # (the setting's name, how the command says it, its value), or None where unset
        if flag is not None:
            return f"--{key}", f"--{key} {flag:g}", flag
        value = cfg.sample[key]
        return (f"sample.{key}", f"sample.{key}={value}", value) if f"sample.{key}" in named else None

    student = f"checkpoint {checkpoint} is a {record['steps']}-step student"
    guidance = given(args.guidance, "guidance")
    if guidance and guidance[2] != record["guidance"]:
        raise ValueError(
            f"{guidance[1]}: {student} distilled to sample without guidance (its teacher's "
            f"{record['teacher_guidance']:g} is in it): drop {guidance[0]}"
        )
    steps = given(args.steps, "steps")
    if steps and steps[2] != record["steps"]:
        say(f"{steps[1]}: checkpoint {checkpoint} was distilled to sample in {record['steps']} steps")
    for key, value in record.get("terms", {}).items():  # a term the command sets, as the guidance: refused
        if f"sample.{key}" in named and cfg.sample[key] != value:
            raise ValueError(
                f"sample.{key}={cfg.sample[key]}: {student} distilled to sample one pass a step, with {key} "
                f"{value}: drop sample.{key}"
            )
    OmegaConf.set_readonly(cfg, False)
    cfg.sample.steps = steps[2] if steps else record["steps"]
    cfg.sample.guidance = record["guidance"]
    for key, value in record.get("terms", {}).items():  # the family's other terms, one pass a step
        cfg.sample[key] = value
