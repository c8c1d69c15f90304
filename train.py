"""Train a DiT from a recipe.

    torchrun --nproc_per_node N train.py --config configs/X.yaml [section.key=value ...]
    python train.py --config configs/demo.yaml train.max_steps=100     # one process

Everything a run writes goes to `run.output_dir` (see configs/rundir.py). The loop below reads top to
bottom: model, EMA and optimizer; resume; then step, log, checkpoint, preview.
"""

import parallel.startup  # noqa: F401  (first: before torch loads)

# isort: split

import argparse
import math
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from configs import DEFAULT_RECIPE, load_config, split_overrides, to_yaml
from configs.rundir import RunDirectory
from data.loader import build_buckets, build_dataset, build_loader, build_sampler, check_same_plan
from data.media import to_model_range, write_video
from data.sampler import sample_seed
from models.dit import DiT_models, count_parameters
from models.flow import RectifiedFlow
from models.pipeline import build_frozen, build_model, generate, open_pretrained
from models.vae import vae_latent_space
from models.wan import check_wan_folder
from parallel import comm, faults
from parallel import vae as parallel_vae
from parallel.checkpoint import (
    NonFiniteWeights,
    check_architecture,
    check_checkpoint_files,
    load_checkpoint,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from parallel.divergence import NonFiniteGuard
from parallel.fsdp import parallelize_dit, update_ema
from parallel.init import copy_shards, materialize
from parallel.layout import ParallelLayout
from parallel.runtime import (
    init_runtime,
    local_world_size,
    run_as_process,
    world_from_env,
)
from parallel.sequence import apply_sequence_parallel, share_batch
from parallel.watchdog import Stopped, stop_request


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
    """Linear warm-up, then constant or (train.lr_decay=cosine) down to 0 at train.max_steps."""
    warmup = max(1, train_cfg.warmup_steps)
    if step < warmup or train_cfg.lr_decay == "constant":
        return train_cfg.lr * min(1.0, (step + 1) / warmup)
    progress = min(1.0, (step - warmup) / max(1, train_cfg.max_steps - warmup))
    return train_cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return
    tc = cfg.train
    # Everything that can be refused is checked before the first collective.
    rank, world_size, _ = world_from_env()
    layout = ParallelLayout.from_config(
        cfg.parallel, world_size, DiT_models[cfg.model.size]["num_heads"], "train", local_world_size()
    )
    buckets = build_buckets(cfg)
    preview_space = vae_latent_space(cfg.vae)
    try:
        preview_space.latent_shape(
            cfg.sample.frames or cfg.data.frames,
            cfg.sample.height or cfg.data.height,
            cfg.sample.width or cfg.data.width,
            cfg.model.patch_size,
        )
    except ValueError as e:
        raise ValueError(f"the preview size in sample.frames/height/width: {e}") from None
    if not cfg.sample.prompts:
        raise ValueError("sample.prompts is empty: training previews need at least one prompt")
    dataset = build_dataset(cfg, buckets)
    sampler = build_sampler(cfg, dataset, buckets, layout.dp_rank(rank), layout.dp)
    checkpoint = resolve_checkpoint(tc.resume, cfg.run.output_dir)
    resume = read_trainer_state(checkpoint)["sampler"] if checkpoint else None
    if checkpoint is not None:  # file sizes here; every crc32 below, the reading shared by the ranks
        check_checkpoint_files(checkpoint)
    elif cfg.model.pretrained:  # a resume takes every weight from its checkpoint and never reads the folder
        check_wan_folder(cfg.model.pretrained)

    comm.set_failure_dir(Path(cfg.run.output_dir) / "failures")
    runtime = init_runtime(cfg.parallel, layout, cfg.run.output_dir)
    phase = runtime.watchdog.mark  # the watchdog names the phase a rank stalls or fails in
    # Ranks that read other data fail here, by name, not in a hang later; then every rank judges the
    # checkpoint's data position alike (another dp size or other data: refused, or data.on_plan_change).
    check_same_plan(sampler, dataset, resume["step"] if resume else None, runtime.control_group)
    start_step, replanned = sampler.load_state_dict(resume, cfg.data.on_plan_change) if resume else (0, "")
    if checkpoint is not None:  # a damaged file is refused by name now, before any model is built
        verify_checkpoint(checkpoint, runtime.control_group)
    sampler.start_step = start_step  # O(1): the sampler computes its position from the step
    device = runtime.device
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    text_encoder, vae = build_frozen(cfg, device)
    # Built on the meta device and sharded before any weight exists; then each rank fills only its shard
    # (from train.seed, or read from model.pretrained): no rank ever holds the whole model.
    model = apply_sequence_parallel(build_model(cfg, text_encoder, vae, weights=False), runtime.sequence)
    architecture = model.architecture()  # recorded in every checkpoint, checked on resume and sampling
    if checkpoint is not None:
        check_architecture(checkpoint, architecture)
    # Only a run that will go on replaces the run directory's config.yaml (the old one is kept beside it).
    run = RunDirectory(cfg.run.output_dir, runtime.is_main)
    run.write_config(cfg)
    run.start_data_report(dataset.left_out_files(), start_step)
    run.trim_metrics(start_step)  # a resume logs the steps after its checkpoint again
    # A resume takes every weight from its checkpoint: the pretrained folder is then neither needed nor read.
    pretrained = open_pretrained(cfg, model) if checkpoint is None else None
    if runtime.is_main:
        print(
            f"[tessera] {cfg.model.size}: {count_parameters(model) / 1e6:.2f}M parameters; layout "
            f"{layout.describe()}{' (parallel.auto)' if cfg.parallel.auto else ''}; {device.type} ({runtime.backend}, "
            f"{'bf16' if bf16 else 'fp32'})\n[tessera] data: {dataset.summary(run.data_report)}\n[tessera] {sampler.steps_per_epoch} "
            f"steps per epoch ({sampler.num_batches} batches{_padding_note(sampler)})",
            flush=True,
        )
    model = parallelize_dit(
        model,
        runtime.fsdp_mesh,
        torch.bfloat16 if bf16 else torch.float32,
        tc.activation_checkpointing,
        tc.compile,
    )
    if checkpoint is None:
        materialize(model, device, tc.seed, pretrained)
    else:
        model.to_empty(device=device)  # load_checkpoint fills every weight below
    del pretrained  # closes the safetensors files
    ema = apply_sequence_parallel(
        build_model(cfg, text_encoder, vae, weights=False).requires_grad_(False), runtime.sequence
    )
    ema = parallelize_dit(ema, runtime.fsdp_mesh)
    copy_shards(ema, model, device)  # the EMA starts as the model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
    )
    flow = RectifiedFlow(cfg.flow, cfg.model.patch_size)

    if checkpoint is not None:
        load_checkpoint(runtime, checkpoint, model, ema, optimizer, verified=True)
        if runtime.is_main:
            print(
                f"[tessera] resumed from {checkpoint} at step {start_step}"
                f"{'; the data plan changed: ' + replanned if replanned else ''}",
                flush=True,
            )
    # One rank per sequence-parallel group reads, encodes and counts the data; share_batch gives it to the rest.
    reader = runtime.sequence.sp_rank == 0
    batches = iter(build_loader(dataset, sampler, cfg.data.num_workers)) if reader else None
    run.start_wandb(cfg)

    window = torch.zeros(
        4 + len(buckets), dtype=torch.float64
    )  # loss sum, samples, tokens, replaced, batches per bucket
    reported = set()
    progress = tqdm(
        total=tc.max_steps,
        initial=start_step,
        disable=not runtime.is_main,
        dynamic_ncols=True,
        desc="train",
        mininterval=1.0,
    )
    model.train()
    window_start, window_step = time.perf_counter(), start_step  # throughput is averaged between log steps
    replaced_total, saved_step = 0, start_step
    guard = NonFiniteGuard(tc, device, run.path, runtime.is_main, bf16)
    stop_request.accepting = (
        True  # from here on, SIGTERM / SIGUSR1 / Ctrl-C stop after a step, with a checkpoint
    )
    for step in range(start_step, tc.max_steps):
        runtime.watchdog.begin_step(
            step + 1, long=step == start_step
        )  # the first step compiles: long deadline
        faults.at_step(rank, step + 1)  # tests only (TESSERA_FAULT)
        samples = [i for i, _ in sampler.batch_at(step)]  # from the plan: the same on every rank of a group
        bucket, n = int(dataset.bucket_of[samples[0]]), len(samples)
        # Text dropout, noise and timestep of each sample come from its own (seed, step, sample) generator.
        rngs = [torch.Generator().manual_seed(sample_seed(tc.seed, step, i)) for i in samples]
        dropped = [torch.rand(1, generator=g).item() < tc.text_dropout for g in rngs]
        x0 = y = y_mask = None
        if reader:
            batch = next(batches)
            if batch["index"] != samples:
                raise RuntimeError(
                    f"step {step}: the loader gave samples {batch['index']}, the plan {samples}"
                )
            x0, y, y_mask = encode_batch(batch, dropped, text_encoder, vae, device)
        shapes = [
            (n, *buckets.latent_shapes[bucket]),
            (n, text_encoder.max_length, text_encoder.dim),
            (n, text_encoder.max_length),
        ]
        x0, y, y_mask = share_batch(runtime.sequence, x0, y, y_mask, shapes, device)
        noise, t = flow.draw(x0.shape[1:], rngs)
        phase("forward")
        loss = faults.nan_loss(
            flow.training_loss(model, x0, y, y_mask, noise, t), rank, step + 1
        )  # tests only
        phase("backward")
        loss.backward()
        phase("optimizer")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        # the whole model's norm on every rank (no communication when it is already replicated, as on torch 2.13)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = learning_rate(tc, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        done = step + 1
        skipped = guard.skip(done, grad_norm)
        if not skipped:
            optimizer.step()
            update_ema(ema, model, tc.ema_decay)
        optimizer.zero_grad(set_to_none=True)
        if reader:
            window[1:4] += torch.tensor([n, n * buckets.tokens[bucket], len(batch["failures"])])
            window[4 + bucket] += 1
            for path, why in batch["failures"]:
                if path not in reported:
                    reported.add(path)
                    print(f"[tessera] rank {rank}: replaced {path} by another sample ({why})", flush=True)
                    run.report_replaced(rank, path, why, done)

        if done % tc.log_every == 0 or done == tc.max_steps:
            phase("log")
            window[0] = loss.detach().double().item() if reader else 0.0  # this step's loss, once per group
            totals = comm.all_reduce(
                window.to(device, copy=True)
            ).cpu()  # on the device: NCCL takes no CPU tensors
            mean_loss = totals[0].item() / layout.dp
            guard.check(done, None if skipped else mean_loss)
            elapsed = time.perf_counter() - window_start
            step_time = elapsed / (done - window_step)
            mix = {
                buckets.buckets[b].name: int(count) for b, count in enumerate(totals[4:].tolist()) if count
            }
            replaced_total = replaced_total + int(totals[3])
            metrics = {
                "step": done,
                "loss": mean_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "step_time": step_time,
                "samples_per_s": totals[1].item() / elapsed,
                "tokens_per_s": totals[2].item() / elapsed,
                "epoch": sampler.position(step)[0],
                "buckets": mix,
                "replaced_samples": replaced_total,
            }
            run.log_metrics(metrics | ({"skipped_steps": guard.skipped} if tc.on_nonfinite == "skip" else {}))
            progress.set_postfix(
                loss=f"{mean_loss:.4f}",
                samples_s=f"{totals[1].item() / elapsed:.1f}",
                buckets=_bucket_mix(mix),
                refresh=False,
            )
            window.zero_()
            window_start, window_step = time.perf_counter(), done
        progress.update(1)
        stop = runtime.agreed_stop_signal() if done < tc.max_steps else 0  # the same answer on every rank
        if stop and runtime.is_main:
            arrived = stop_request.received_in_step or "another rank's step"
            print(
                f"[tessera] {signal.Signals(stop).name} received in step {arrived}: saving step {done}, then stopping",
                file=sys.stderr,
                flush=True,
            )
        if done % tc.checkpoint_every == 0 or done == tc.max_steps or (stop and saved_step != done):
            phase("checkpoint")
            guard.check(done)
            trainer_state = {
                "step": done,
                "sampler": sampler.state_dict(done),
                "world_size": runtime.world_size,
                "architecture": architecture,
            }
            try:
                save_checkpoint(
                    runtime, run.path, done, model, ema, optimizer, trainer_state, tc.keep_checkpoints
                )
            except NonFiniteWeights as e:  # weights that overflowed while every gradient norm was finite
                raise guard.diverged(str(e)) from None
            saved_step = done
        if stop:
            progress.close()
            if runtime.is_main:
                print(
                    f"stopped at step {done} by {signal.Signals(stop).name}; saved {run.path / 'checkpoints' / f'step_{done}'}"
                    f"; run the same command to resume",
                    file=sys.stderr,
                    flush=True,
                )
            raise Stopped(stop)
        if (tc.sample_every and done % tc.sample_every == 0) or done == tc.max_steps:
            phase("preview")
            guard.check(done)
            write_previews(
                cfg, runtime, run, ema if cfg.sample.use_ema else model, vae, text_encoder, flow, done
            )
            runtime.fence()  # rank 0 writes the files alone: the others wait here, not in the next step
    stop_request.accepting = False
    runtime.watchdog.end_loop()
    progress.close()
    run.finish()


def encode_batch(batch, dropped: list[bool], text_encoder, vae, device):
    """(x0 latents, text embeddings, text mask) of a batch: encoded now from pixels and captions, or read
    from precomputed latents (data.latents), where a dropped caption becomes the empty prompt's embedding."""
    if "latent" in batch:
        y, y_mask = batch["text"].to(device), batch["text_mask"].to(device)
        if any(dropped):
            empty, empty_mask = text_encoder([""], device)
            y[torch.tensor(dropped)], y_mask[torch.tensor(dropped)] = empty, empty_mask
        return batch["latent"].to(device), y, y_mask
    y, y_mask = text_encoder(["" if d else c for d, c in zip(dropped, batch["caption"])], device)
    video = to_model_range(batch["video"].to(device, non_blocking=True))
    # in the tiles precompute_latents.py uses, so media and precomputed latents are the same latents
    return parallel_vae.encode(vae, video, tile=vae.tile_latent, overlap=vae.tile_overlap), y, y_mask


def _padding_note(sampler) -> str:
    if sampler.padding_batches > 0:
        return f" + {sampler.padding_batches} repeated to fill every rank"
    if sampler.padding_batches < 0:
        return f", {-sampler.padding_batches} dropped to fit every rank"
    return ""


def _bucket_mix(mix: dict) -> str:
    """The three most frequent buckets of the window, as shares: '8x32x32 50% 4x28x36 30% ...'."""
    total = sum(mix.values()) or 1
    top = sorted(mix.items(), key=lambda kv: -kv[1])
    return " ".join(f"{name} {100 * n / total:.0f}%" for name, n in top[:3]) + (
        " ..." if len(top) > 3 else ""
    )


def write_previews(cfg, runtime, run, model, vae, text_encoder, flow, step):
    """Every rank samples (the model is sharded, so its forward needs all of them); rank 0 writes."""
    sc = cfg.sample
    was_training = model.training
    runtime.watchdog.sampling_progress(0, sc.steps)  # a deadline per denoising step
    videos = generate(
        model.eval(),
        vae,
        text_encoder,
        flow,
        list(sc.prompts),
        sc.frames or cfg.data.frames,
        sc.height or cfg.data.height,
        sc.width or cfg.data.width,
        sc.steps,
        sc.guidance,
        sc.negative_prompt,
        seeds=[cfg.train.seed + i for i in range(len(sc.prompts))],
        progress=runtime.watchdog.sampling_progress,
    )
    model.train(was_training)
    if runtime.is_main:
        for i, video in enumerate(videos):
            write_video(run.samples / f"step_{step}_{i}.mp4", video, fps=sc.fps)


if __name__ == "__main__":
    run_as_process(main)
