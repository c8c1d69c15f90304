"""Train a DiT from a recipe.

    torchrun --nproc_per_node N train.py --config configs/X.yaml [section.key=value ...]
    python train.py --config configs/demo.yaml train.max_steps=100     # one process

Everything a run writes goes to `run.output_dir` (see configs/rundir.py). `main` reads top to bottom:
check the recipe, start the process groups, build the model, EMA and optimizer (or resume them), then
the loop: step, log, checkpoint, preview.
"""

import parallel.lifecycle.startup  # noqa: F401  (first: before torch loads)

# isort: split

import argparse
import math
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from configs import DEFAULT_RECIPE, load_config, split_overrides, to_yaml
from configs.rundir import RunDirectory, check_loggers
from data.buckets import describe_mix
from data.latents import encoder_record
from data.loader import (
    build_buckets,
    build_dataset,
    build_loader,
    build_sampler,
    check_same_plan,
    encode_family_batch,
    warn_on_main,
)
from data.media import write_video
from data.sampler import sample_seed
from models.families import family_named
from models.flow import RectifiedFlow, expert_timesteps
from models.layers import count_parameters
from parallel.build.components import (
    build_copies,
    build_ema,
    check_lora_start,
    check_weights_source,
    expert_recipe,
    fill_sharded,
    meta_model_builder,
    meta_transformer,
    open_pretrained,
)
from parallel.build.lora import lora_record
from parallel.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from parallel.checkpoints.checkpoint_files import resolve_checkpoint
from parallel.checkpoints.checkpoint_reading import (
    check_checkpoint_files,
    read_trainer_state,
    verify_checkpoint,
)
from parallel.checkpoints.checkpoint_records import (
    check_architecture,
    check_encoders,
    check_expert,
    check_trained,
    expert_record,
)
from parallel.compute import comm
from parallel.compute.fp8 import after_optimizer_step, check_fp8, chosen_layers
from parallel.compute.fsdp import (
    check_cpu_offload,
    gathers_in_float8,
    offloaded_activations,
    parallelize_dit,
    param_device,
    reshard_all,
    update_ema,
)
from parallel.compute.layout import ParallelLayout
from parallel.drive.distill import (
    Distiller,
    averaged_teacher,
    build_distiller,
    check_distillation,
    check_objective,
    describe_distillation,
    distill_backward,
    distilled_recipe,
    student_record,
)
from parallel.drive.family_training import (
    FamilyRun,
    check_family_inputs,
    check_family_sizes,
    check_family_training,
    empty_batch,
    family_batch,
    family_previews,
    frozen_family,
    training_layouts,
)
from parallel.lifecycle.divergence import NonFiniteGuard
from parallel.lifecycle.entrypoint import run_as_process
from parallel.lifecycle.finite import check_resumed_finite
from parallel.lifecycle.memory_plan import check_training_memory
from parallel.lifecycle.preemption import Stopped
from parallel.lifecycle.runtime import init_runtime, local_world_size, world_from_env
from parallel.lifecycle.storage import NonFiniteWeights


def parse_args(argv):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe YAML (default: the demo)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parsed = parser.parse_args(args)
    parsed.overrides = overrides
    return parsed


def learning_rate(train_cfg, step: int) -> float:
    """Linear warm-up, then constant, or down to 0 at train.max_steps: cosine, or linear over the last
    train.decay_fraction of the steps."""
    warmup = max(1, train_cfg.warmup_steps)
    if train_cfg.lr_decay == "linear":
        left = train_cfg.max_steps - step  # steps left, this one included
        tail = max(1.0, train_cfg.decay_fraction * train_cfg.max_steps)
        return train_cfg.lr * max(0.0, min(1.0, (step + 1) / warmup, left / tail))
    if step < warmup or train_cfg.lr_decay == "constant":
        return train_cfg.lr * min(1.0, (step + 1) / warmup)
    progress = min(1.0, (step - warmup) / max(1, train_cfg.max_steps - warmup))
    return train_cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def main(argv=None, session=None):
    args = parse_args(argv)
    cfg = expert_recipe(load_config(args.config, args.overrides))  # Wan 2.2: one expert's weights and range
    OmegaConf.set_readonly(cfg, True)  # resolved: config.yaml records what runs
    if args.print_config:
        print(to_yaml(cfg))
        return
    plan = check_before_start(cfg)
    cfg = plan.cfg  # train.memory=auto's choice in it
    runtime = init_runtime(cfg.parallel, plan.layout, cfg.run.output_dir, session=session)
    start_step, replanned = agree_on_data(cfg, plan, runtime)
    trainer = build_trainer(cfg, plan, runtime, start_step, replanned)
    train_loop(cfg, plan, runtime, trainer, start_step)


@dataclass
class Plan:
    """What the recipe and the run directory decide before any process group exists."""

    layout: ParallelLayout
    buckets: object  # data.buckets.BucketTable
    dataset: object  # data.dataset.BucketedDataset
    sampler: object  # data.sampler.BucketSampler
    checkpoint: object  # the step_<N> folder to resume from, or None
    resume: dict | None  # the checkpoint's sampler state
    base: object  # parallel.build.lora.Base: the frozen base of a LoRA run (lora.rank > 0), else None
    adapter_start: dict | None = None  # lora.init_from's adapters {name: whole tensor} on a fresh start
    preview_images: tuple = (None, None)  # image-to-video: the previews' first and last frames (PIL)
    expert: dict | None = None  # the timesteps this run trains (Wan 2.2's expert), kept in each checkpoint
    trained: dict = field(default_factory=dict)  # the family's training_record, kept in each checkpoint
    encoders: dict = field(default_factory=dict)  # the frozen encoders (data/latents.py), kept in each one
    memory: str = ""  # the modelled peak, for the start-up line (parallel/lifecycle/memory_plan.py)
    cfg: object = None  # the recipe as it runs (train.memory=auto's choice in it), what config.yaml records


def check_before_start(cfg) -> Plan:
    """Everything that can be refused, checked before the first collective: the layout, the buckets and
    the preview size, the data, the checkpoint's files (or the pretrained folder), and a LoRA's base."""
    rank, world_size, local_rank = world_from_env()
    family = family_named(cfg.model.family)
    cfg = distilled_recipe(cfg, family)  # train.objective=dmd: the previews sample the student
    check_loggers(cfg)
    check_family_inputs(cfg, family)
    check_distillation(cfg, family)
    averaged = averaged_teacher(cfg)
    if averaged:
        warn_on_main(averaged)
    # the checkpoint's record before the data: a refused resume costs no manifest probe
    checkpoint = resolve_checkpoint(cfg.train.resume, cfg.run.output_dir)
    resume = read_trainer_state(checkpoint)["sampler"] if checkpoint else None
    # model.pretrained before the layout, which reads a family's heads from its folder. A full resume
    # takes every weight from its checkpoint; a LoRA's base, and a distillation's teacher, are read (and
    # must be the ones it was trained with) either way.
    reads = checkpoint is None or bool(cfg.lora.rank) or cfg.train.objective == "dmd"
    check_weights_source(cfg, family, reads)
    heads = family.heads(cfg) or cfg.parallel.ulysses
    buckets = build_buckets(cfg)
    takes = training_layouts(cfg, family, buckets)  # parallel.auto: among the splits it trains under
    layout = ParallelLayout.from_config(
        cfg.parallel, world_size, heads, "train", local_world_size(), takes=takes
    )
    check_family_training(cfg, family, layout)
    check_family_sizes(cfg, family, layout, buckets)
    # before any weights or data are read (a folder's headers may be): a misfit is refused with what fits
    # train.memory=auto: the recipe from here on carries the checkpointing and offload it chose
    cfg, memory = check_training_memory(cfg, layout, buckets, world_size, local_world_size(), local_rank)
    sc, data = cfg.sample, cfg.data
    try:
        space, patch = family.geometry(cfg)
        space.latent_shape(sc.frames or data.frames, sc.height or data.height, sc.width or data.width, patch)
    except ValueError as e:
        raise ValueError(f"the preview size in sample.frames/height/width: {e}") from None
    if not sc.prompts:
        raise ValueError("sample.prompts is empty: training previews need at least one prompt")
    preview_images = family.check_training_images(cfg, buckets.frame_counts, warn_on_main)
    check_cpu_offload(cfg.train.cpu_offload, world_size)
    check_fp8(cfg, "cuda" if torch.cuda.is_available() else "cpu", meta_transformer)
    expert = expert_record(cfg)
    trained = family.training_record(cfg)  # kept in each checkpoint
    encoders = encoder_record(cfg)  # kept in each checkpoint too
    if checkpoint is not None:  # file sizes here; every crc32 below, the reading shared by the ranks
        check_checkpoint_files(checkpoint)
        check_expert(checkpoint, expert)  # an expert's weights stay on its timesteps
        check_trained(checkpoint, trained)  # the same weights frozen, the same optimizer state
        check_encoders(checkpoint, encoders)  # the latents and embeddings it learnt
        check_objective(checkpoint, cfg)  # a distillation resumes as one, and flow matching as itself
    dataset = build_dataset(cfg, buckets)
    sampler = build_sampler(cfg, dataset, buckets, layout.dp_rank(rank), layout.dp)
    base, adapter_start = check_lora_start(cfg, checkpoint)
    return Plan(
        layout, buckets, dataset, sampler, checkpoint, resume, base, adapter_start, preview_images, expert,
        trained, encoders, memory, cfg,
    )  # fmt: skip


def agree_on_data(cfg, plan: Plan, runtime) -> tuple[int, str]:
    """The step to start from, and why the data plan changed ("" if it did not). Ranks that read other
    data fail here, by name, not in a hang later; then every rank judges the checkpoint's data position
    alike (another dp size or other data: refused, or data.on_plan_change), and a damaged checkpoint
    file is refused before any model is built."""
    sampler, resume = plan.sampler, plan.resume
    base = f"{plan.base.source} {plan.base.fingerprint}" if plan.base is not None else ""
    check_same_plan(sampler, plan.dataset, resume["step"] if resume else None, runtime.control_group, base)
    start_step, replanned = sampler.load_state_dict(resume, cfg.data.on_plan_change) if resume else (0, "")
    if plan.checkpoint is not None:
        verify_checkpoint(plan.checkpoint, runtime.control_group)
    sampler.start_step = start_step  # O(1): the sampler computes its position from the step
    return start_step, replanned


@dataclass
class Trainer:
    """The model and everything that trains it, built once by build_trainer."""

    model: torch.nn.Module
    ema: object  # a DiT sharded like the model, or parallel.build.lora.AdapterEMA
    optimizer: torch.optim.Optimizer
    flow: RectifiedFlow
    family: FamilyRun  # the family and its frozen parts (text encoder, VAE)
    run: RunDirectory
    architecture: dict  # recorded in every checkpoint, checked on resume and sampling
    guard: NonFiniteGuard
    batches: object  # this rank's loader iterator; None on ranks that get their batch from share_batch
    training: object  # what a checkpoint saves and loads: TrainingState, or LoRAState (adapters only)
    trainable: list  # the parameters AdamW updates: every one, or the adapters' (a distillation's student's)
    lora: dict | None  # a LoRA run's record in trainer_state.pt (rank, targets, base); None: full
    distiller: Distiller | None = None  # train.objective=dmd: the critic's optimizer and the student's steps
    distill: dict | None = None  # its record in trainer_state.pt (parallel/drive/distill.py distill_record)


def build_optimizer(tc, trainable: list) -> torch.optim.AdamW:
    """AdamW, fused: one kernel (one DTensor dispatch) for every parameter instead of a dozen per parameter
    list; a sixth of the demo's step on a CPU went to the foreach AdamW's dispatches."""
    fused = all(p.device.type in ("cpu", "cuda") for p in trainable)
    return torch.optim.AdamW(
        trainable, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, fused=fused
    )


def build_trainer(cfg, plan: Plan, runtime, start_step: int, replanned: str = "") -> Trainer:
    """The DiT is built on the meta device and sharded before any weight exists; then each rank fills
    only its shard (from train.seed, model.pretrained, or the checkpoint): no rank holds the whole model."""
    tc, device, checkpoint = cfg.train, runtime.device, plan.checkpoint
    bf16 = runtime.bf16(tc.precision)
    dtype = torch.bfloat16 if bf16 else torch.float32
    # its text encoder and VAE, in the compute dtype where the family takes it
    family = frozen_family(cfg, family_named(cfg.model.family), device, dtype, plan.preview_images)
    distill = student_record(cfg, family)  # a student step count its schedule cannot make: refused here
    meta_model = meta_model_builder(cfg, runtime.sequence, dtype)
    model, adapted = meta_model(adapters=bool(cfg.lora.rank))
    fp8 = chosen_layers(model, tc.fp8_min_features) if tc.fp8 else ""  # for the summary (check_fp8 ran)
    architecture = model.architecture()
    if checkpoint is not None:
        check_architecture(checkpoint, architecture)
    # Only a run that will go on replaces the run directory's config.yaml (the old one is kept beside it).
    run = RunDirectory(cfg.run.output_dir, runtime.is_main, runtime.ensure_directory)
    run.write_config(cfg)
    run.start_data_report(plan.dataset.left_out_files(), start_step)
    run.trim_metrics(start_step)  # a resume logs the steps after its checkpoint again
    # a LoRA checkpoint holds the adapters only: its base is read on every start
    pretrained = open_pretrained(cfg, model, base=plan.base) if checkpoint is None or adapted else None
    if runtime.is_main:
        print(_summary(cfg, plan, runtime, model, run, bf16, fp8), flush=True)
    model = parallelize_dit(
        model, runtime.fsdp_mesh, dtype, tc.activation_checkpointing, tc.compile, tc.cpu_offload,
        tc.checkpoint_policy, tc.fp8_min_features if tc.fp8 else None,
    )  # fmt: skip
    if checkpoint is None or adapted:
        fill_sharded(runtime, model, tc.seed, pretrained, cfg.lora.seed, tc.cpu_offload, plan.adapter_start)
        plan.adapter_start = None  # lora.init_from's tensors (~0.6 GB at 14B, rank 32) are in the shards now
    else:
        model.to_empty(device=param_device(device, tc.cpu_offload))  # load_checkpoint fills every weight
    del pretrained  # closes the safetensors files
    one_model = lambda: meta_model()[0]  # noqa: E731
    copies = None
    if tc.objective == "dmd" and not adapted:  # full copies of the critic and the teacher
        copies = build_copies(cfg, runtime, model, one_model, dtype, checkpoint is not None)
    trainable, distiller = build_distiller(cfg, model, build_optimizer, copies)  # every one, or the adapters
    optimizer = build_optimizer(tc, trainable)
    ema, training = build_ema(cfg, runtime, model, optimizer, one_model, bool(adapted), distiller)
    if checkpoint is not None:
        load_checkpoint(runtime, checkpoint, training, verified=True)
        check_resumed_finite(runtime, checkpoint, model, ema, optimizer, distiller)  # one verdict, every rank
        if runtime.is_main:
            why = f"; the data plan changed: {replanned}" if replanned else ""
            print(f"[tessera] resumed from {checkpoint} at step {start_step}{why}", flush=True)
    # One rank per sequence-parallel group reads, encodes and counts the data; share_batch gives it to the
    # rest.
    loader = build_loader(plan.dataset, plan.sampler, cfg.data.num_workers, runtime.faults)
    batches = iter(loader) if runtime.sequence.sp_rank == 0 else None
    run.start_wandb(cfg)
    run.start_tensorboard(cfg, start_step)
    guard = NonFiniteGuard(tc, device, run.path, runtime.is_main, bf16)
    flow = RectifiedFlow(
        cfg.flow,
        family.family.geometry(cfg)[1],
        timesteps=expert_timesteps(cfg.model.expert, cfg.sample.boundary),
    )
    lora = lora_record(cfg.lora, plan.base, adapted) if adapted else None
    return Trainer(
        model,
        ema,
        optimizer,
        flow,
        family,
        run,
        architecture,
        guard,
        batches,
        training,
        trainable,
        lora,
        distiller,
        distill,
    )


def train_loop(cfg, plan: Plan, runtime, t: Trainer, start_step: int) -> None:
    tc, sampler = cfg.train, plan.sampler
    window = Window(len(plan.buckets), start_step)
    progress = tqdm(
        total=tc.max_steps,
        initial=start_step,
        disable=not runtime.is_main,
        dynamic_ncols=True,
        desc="train",
        mininterval=1.0,
    )
    t.model.train()
    saved_step, reported = start_step, set()
    runtime.stop.accepting = True  # from here on, SIGTERM / SIGUSR1 / Ctrl-C stop after a step, with a save
    for step in range(start_step, tc.max_steps):
        done = step + 1  # steps are counted from 1 in metrics.jsonl, step_<N> and messages
        runtime.watchdog.begin_step(done, long=step == start_step)  # the first step compiles: long deadline
        runtime.faults.at_step(done)  # tests only (TESSERA_FAULT)
        samples = [i for i, _ in sampler.batch_at(step)]  # from the plan: the same on every rank of a group
        batch, inputs, rngs = load_batch(cfg, runtime, t, step, samples)
        loss, grad_norm, skipped = train_step(cfg, runtime, t, step, inputs, rngs)
        if step == start_step and runtime.watchdog.memory is not None:  # its baseline: after a whole step
            runtime.watchdog.memory.begin(done)
        if batch is not None:
            window.add(len(samples), plan.buckets, int(plan.dataset.bucket_of[samples[0]]), batch["failures"])
            report_replaced(runtime, t.run, batch["failures"], reported, done)
        if done % tc.log_every == 0 or done == tc.max_steps:
            runtime.watchdog.mark("log")
            context = {"lr": learning_rate(tc, step), "grad_norm": float(grad_norm)}
            context["epoch"] = sampler.position(step)[0]
            losses = [loss] + ([t.distiller.matching] if t.distiller is not None else [])
            metrics = window.summarize(runtime, plan, losses if batch is not None else None, done, context)
            if "dmd_loss" in metrics:  # the student's must be finite too; the critic's (last) is the health's
                t.guard.check(done, None if skipped else metrics["dmd_loss"])
            t.guard.check(done, None if skipped else metrics["loss"])
            extra = {"skipped_steps": t.guard.skipped} if tc.on_nonfinite == "skip" else {}
            t.run.log_metrics(metrics | extra)
            progress.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                samples_s=f"{metrics['samples_per_s']:.1f}",
                buckets=describe_mix(metrics["buckets"]),
                refresh=False,
            )
            window.restart(done)
        progress.update(1)
        stop = runtime.agreed_stop_signal() if done < tc.max_steps else 0  # the same answer on every rank
        if stop and runtime.is_main:
            arrived = runtime.stop.received_in_step or "another rank's step"
            say(
                f"[tessera] {signal.Signals(stop).name} received in step {arrived}: saving step {done}, "
                "then stopping"
            )
        if done % tc.checkpoint_every == 0 or done == tc.max_steps or (stop and saved_step != done):
            save(runtime, plan, t, done, tc.keep_checkpoints)
            saved_step = done
        if stop:
            progress.close()
            if runtime.is_main:
                saved = t.run.path / "checkpoints" / f"step_{done}"
                say(
                    f"stopped at step {done} by {signal.Signals(stop).name}; saved {saved}; run the same "
                    "command to resume"
                )
            raise Stopped(stop)
        if (tc.sample_every and done % tc.sample_every == 0) or done == tc.max_steps:
            runtime.watchdog.mark("preview")
            t.guard.check(done)
            write_previews(cfg, runtime, t.run, t, done)
            runtime.fence()  # rank 0 writes the files alone: the others wait here, not in the next step
    runtime.stop.accepting = False
    runtime.watchdog.end_loop()
    progress.close()
    t.run.finish()


def load_batch(cfg, runtime, t: Trainer, step: int, samples: list[int]):
    """(the loader's batch or None, (x0, the family's conditioning, noise, t, the empty prompt's conditioning
    or None), each sample's generator) for `step`, on every rank of the group: encoded by the group's reader
    (a prompt's length is its own: shared with a header). Text dropout, noise and timestep of each sample
    come from its own (seed, step, sample) generator. A distillation keeps every caption and adds the empty
    prompt's conditioning (the teacher's guidance)."""
    tc = cfg.train
    rngs = [torch.Generator().manual_seed(sample_seed(tc.seed, step, i)) for i in samples]
    dropped = [torch.rand(1, generator=g).item() < tc.text_dropout for g in rngs]
    if t.distiller is not None:
        dropped = [False] * len(samples)
    batch, encoded = None, None
    if t.batches is not None:
        batch = next(t.batches)
        if batch["index"] != samples:
            raise RuntimeError(f"step {step}: the loader gave samples {batch['index']}, the plan {samples}")
        encoded = encode_family_batch(t.family, batch, dropped, runtime.device)
    x0, cond = family_batch(t.family, runtime.sequence, encoded, runtime.device)
    uncond = empty_batch(t.family, len(samples), runtime.device) if t.distiller is not None else None
    noise, timesteps = t.family.family.objective.draw(t.family.parts, t.flow, x0, cond, rngs)
    return batch, (x0, cond, noise, timesteps, uncond), rngs


def train_step(cfg, runtime, t: Trainer, step: int, inputs, rngs):
    """Forward, backward, clip, and (unless the guard skips a non-finite step) AdamW and the EMA: of the
    model, or of a distillation's critic every step and its student every distill.critic_updates steps.
    Returns (loss (the critic's in a distillation), the gradient norm, skipped)."""
    tc, phase, d = cfg.train, runtime.watchdog.mark, t.distiller
    phase("forward")
    if d is None:
        x0, cond, noise, timesteps, _ = inputs  # the family's loss (LTX-2: a sigma and a loss per stream)
        with offloaded_activations(tc.activation_offload, runtime.device):
            loss = t.family.family.objective.loss(t.family.parts, t.flow, t.model, x0, cond, noise, timesteps)
        loss = runtime.faults.nan_loss(loss, step + 1)  # tests only
        phase("backward")
        loss.backward()
        student = True
    else:  # the backwards run inside: each in its forward's adapter
        with offloaded_activations(tc.activation_offload, runtime.device):
            loss, student = distill_backward(d, tc.seed, step, t.family, t.model, t.flow, inputs, rngs)
        loss = runtime.faults.nan_loss(loss, step + 1)
    phase("optimizer")
    updates = ([(t.optimizer, t.trainable, 1.0)] if student else []) + (
        [(d.critic, d.params, d.lr_ratio)] if d else []
    )
    norms = [whole_norm(params, tc.grad_clip) for _, params, _ in updates]
    grad_norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    for optimizer, _, scale in updates:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(tc, step) * scale
    skipped = t.guard.skip(step + 1, grad_norm)  # a non-finite critic stops (or skips) the step too
    if not skipped:
        for optimizer, _, _ in updates:
            optimizer.step()
        if tc.fp8:
            after_optimizer_step(t.model, gathers_in_float8(runtime.fsdp_mesh))
        if t.lora and student:  # the adapters' EMA
            t.ema.update(t.model, tc.ema_decay)
        elif student:
            update_ema(t.ema, t.model, tc.ema_decay)
    for optimizer, _, _ in updates:
        optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, skipped


def whole_norm(params: list, clip: float) -> torch.Tensor:
    """The gradients of `params` clipped to `clip`; their whole norm on every rank (no communication when it
    is already replicated, as on torch 2.13)."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@dataclass
class Window:
    """What the ranks add up between two log steps, summed in one all-reduce at the log step."""

    num_buckets: int
    start_step: int
    samples: float = 0.0
    tokens: float = 0.0
    replaced: float = 0.0
    per_bucket: list = field(default_factory=list)  # batches per bucket
    started: float = field(default_factory=time.perf_counter)
    replaced_total: int = 0  # over the whole run, for metrics.jsonl

    def __post_init__(self):
        self.per_bucket = [0.0] * self.num_buckets

    def add(self, n: int, buckets, bucket: int, failures) -> None:
        self.samples += n
        self.tokens += n * buckets.tokens[bucket]
        self.replaced += len(failures)
        self.per_bucket[bucket] += 1

    def summarize(self, runtime, plan: Plan, losses, done: int, context: dict) -> dict:
        """The window's metrics, summed over every rank (each group's reader adds its step `losses` once:
        [the loss] or, in a distillation, [the critic's, the student's last]; None on the other ranks), with
        `context` (lr, grad_norm, epoch) in metrics.jsonl's order."""
        # a distillation: the critic's loss, the student's, and whether the student has had a turn since
        # the start (a resume may begin on a critic's turn)
        n = 3 if plan.cfg.train.objective == "dmd" else 1
        own = [0.0] * n  # not a group's reader: adds nothing
        if losses is not None:
            own[0] = losses[0].detach().double().item()
            if n == 3 and losses[1] is not None:
                own[1:] = [losses[1].double().item(), 1.0]
        packed = torch.tensor(
            [*own, self.samples, self.tokens, self.replaced, *self.per_bucket], dtype=torch.float64
        )
        totals = comm.all_reduce(packed.to(runtime.device)).cpu()  # on the device: NCCL takes no CPU tensors
        summed = totals[:n].tolist()
        summed_loss, samples, tokens, replaced = summed[0], *totals[n : n + 3].tolist()
        elapsed = time.perf_counter() - self.started
        self.replaced_total += int(replaced)
        mix = {plan.buckets.buckets[b].name: int(c) for b, c in enumerate(totals[n + 3 :].tolist()) if c}
        metrics = {
            "step": done,
            "loss": summed_loss / plan.layout.dp,
            "lr": context["lr"],
            "grad_norm": context["grad_norm"],
            "step_time": elapsed / (done - self.start_step),
            "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed,
            "epoch": context["epoch"],
            "buckets": mix,
            "replaced_samples": self.replaced_total,
        }
        if n == 3 and summed[2] > 0:  # the student's matching loss, from its last turn
            metrics["dmd_loss"] = summed[1] / plan.layout.dp
        return metrics

    def restart(self, done: int) -> None:
        """A new window begins after step `done` (its logging included in the window that ends)."""
        self.samples = self.tokens = self.replaced = 0.0
        self.per_bucket = [0.0] * self.num_buckets
        self.started, self.start_step = time.perf_counter(), done


def report_replaced(runtime, run: RunDirectory, failures, reported: set, step: int) -> None:
    """Samples the loader could not read and replaced: said once per file, and kept in the data report."""
    for path, why in failures:
        if path not in reported:
            reported.add(path)
            print(f"[tessera] rank {runtime.rank}: replaced {path} by another sample ({why})", flush=True)
            run.report_replaced(runtime.rank, path, why, step)


def save(runtime, plan: Plan, t: Trainer, done: int, keep: int) -> None:
    runtime.watchdog.mark("checkpoint")
    t.guard.check(done)
    trainer_state = {
        "step": done,
        "sampler": plan.sampler.state_dict(done),
        "world_size": runtime.world_size,
        "architecture": t.architecture,
        "expert": plan.expert,
        "trained": plan.trained,
        "encoders": plan.encoders,
    }
    if t.lora:
        trainer_state["lora"] = t.lora
    if t.distill:
        trainer_state["distill"] = t.distill
    # whether its loss and weights were in range: a divergence recommends only a checkpoint that was
    trainer_state["health"] = t.guard.health(done, t.trainable, runtime.control_group)
    try:
        save_checkpoint(runtime, t.run.path, done, t.training, trainer_state, keep)
    except NonFiniteWeights as e:  # weights that overflowed while every gradient norm was finite
        # the advice names the last good checkpoint (the newest saved in range), not merely `latest`
        raise t.guard.diverged(e.what) from None
    t.run.checkpointed()  # main rank: TensorBoard flushed, report.png drawn


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _summary(cfg, plan: Plan, runtime, model, run: RunDirectory, bf16: bool, fp8: str) -> str:
    auto = " (parallel.auto)" if cfg.parallel.auto else ""
    precision = ", ".join(filter(None, ("bf16" if bf16 else "fp32", fp8)))
    threads = f", {runtime.threads}" if runtime.threads else ""  # a CPU run's
    device = f"{runtime.device.type} ({runtime.backend}, {precision}{threads})"
    sampler, described = plan.sampler, family_named(cfg.model.family).describe(cfg)
    return (
        f"[tessera] {described}: {count_parameters(model) / 1e6:.2f}M parameters; layout "
        f"{plan.layout.describe()}{auto}; {device}\n"
        + (f"[tessera] memory: {plan.memory}\n" if plan.memory else "")
        + (f"[tessera] {describe_distillation(cfg)}\n" if cfg.train.objective == "dmd" else "")
        + f"[tessera] data: {plan.dataset.summary(run.data_report)}\n"
        f"[tessera] {sampler.steps_per_epoch} steps per epoch ({sampler.num_batches} batches"
        f"{sampler.padding_note()})"
    )


def write_previews(cfg, runtime, run, t: Trainer, step):
    """Every rank samples (the model is sharded, so its forward needs all of them); rank 0 writes. With
    sample.use_ema, from the EMA model (a LoRA run: the EMA adapters, swapped in for the previews)."""
    if cfg.sample.use_ema and t.lora:
        with t.ema.swapped_in(t.model, before_restore=reshard_all):
            return sample_previews(cfg, runtime, run, t.model, t, step)
    model = t.ema if cfg.sample.use_ema else t.model
    sample_previews(cfg, runtime, run, model, t, step)
    reshard_all(model)  # the next forward must gather the shards the optimizer or the EMA update changed


def sample_previews(cfg, runtime, run, model, t: Trainer, step):
    was_training = model.training
    runtime.watchdog.sampling_progress(0, cfg.sample.steps)  # a deadline per denoising step
    seeds = [cfg.train.seed + i for i in range(len(cfg.sample.prompts))]
    # NaN or inf: found alike on every rank (each samples them all)
    videos, bad = family_previews(
        cfg, t.family, model.eval(), seeds, runtime.watchdog.sampling_progress, runtime.device
    )
    model.train(was_training)
    write_preview_files(cfg, runtime, run, step, videos, bad)


def write_preview_files(cfg, runtime, run, step, videos, bad):
    """Rank 0 writes the previews that are finite and logs them; a NaN or inf preview is a warning."""
    sc = cfg.sample
    if runtime.is_main:
        for i in range(len(sc.prompts)):
            if i not in bad:
                write_video(run.preview_path(step, i), videos[i], fps=sc.fps)
        run.log_previews(step, {i: (p, videos[i]) for i, p in enumerate(sc.prompts) if i not in bad}, sc.fps)
        if bad:  # a warning, not a stop: the checkpoints (the work) are guarded by train.on_nonfinite
            found = "; ".join(f"sample.prompts[{i}] in {where}" for i, where in bad.items())
            say(
                f"[tessera] warning: step {step}'s preview gave NaN or inf ({found}): not written. The "
                "weights previewed (sample.use_ema) may be diverging, or bf16 overflows"
            )


if __name__ == "__main__":
    run_as_process(main)
