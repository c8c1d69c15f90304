"""Calibrate the step cache (sample.cache=calibrated) for a model: sample some prompts uncached, record the
guided velocity of every step, and write per step its mean relative change and norm ratio (JSON).

    python scripts/calibrate_cache.py --config configs/demo.yaml --output runs/demo/cache.json
    python infer.py --config configs/demo.yaml sample.cache=calibrated \\
        sample.cache_calibration=runs/demo/cache.json --prompt "a red square moving left"

One process, any family, through infer.py, once per model and step count (sample.steps, or --steps):
sample.prompts (or --prompts), --seeds each, at the recipe's size (sample.*, else data.*); --image and
--last-image as infer.py's (one for every sample, or one each of prompts x seeds). The file records what
it was made for (architecture, weights, --lora files, frozen parts, schedule, guidance, steps): infer.py
refuses it for any other.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallel.lifecycle.startup  # noqa: E402, F401  (before torch loads)

# isort: split

import torch  # noqa: E402

from configs import DEFAULT_RECIPE, load_config, split_overrides  # noqa: E402
from models.sampler import guided_velocity  # noqa: E402
from models.step_cache import Calibration  # noqa: E402
from parallel.compute.cache import calibration_subject  # noqa: E402
from parallel.lifecycle.entrypoint import run_as_process  # noqa: E402


def record_velocities(cfg, args, overrides, prompts: list, steps: int, session=None) -> list:
    """The guided velocity of each step, (len(prompts) * seeds, ...) per step, of an uncached sampling of
    the prompts (prompt i, seed i) through infer.py on this process: the family's own parts, loop and
    solver, with both guidance branches here."""
    from benchlib import infer_videos

    everything = [p for p in prompts for _ in range(args.seeds)]
    batches = []  # infer.py samples sample.batch_size at a time: each batch's velocities, step by step

    def recording(denoise_with):  # in place of the walk: the serial one, recording as it goes
        def walk(family, parts, schedule, noise, cond, uncond, scale, progress=None):
            guided, steps = guided_velocity(family, parts, cond, uncond, scale), []
            batches.append(steps)

            def velocity(x, t):
                v = guided(x, t)
                steps.append(v.float().cpu())
                return v

            return family.steps.walk(parts, schedule, noise, velocity, progress)

        return walk

    argv = ["--config", args.config, "--prompt", *everything, "--seed", "0", "--steps", steps]
    argv += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    argv += ["--random-weights"] if args.random_weights else []
    argv += ["--lora", *args.lora] if args.lora else []
    argv += ["--image", *args.image] if args.image else []
    argv += ["--last-image", *args.last_image] if args.last_image else []
    infer_videos([*argv, *overrides, "sample.cache=none"], len(everything), session, walk=recording)
    return [torch.cat([batch[i] for batch in batches]) for i in range(len(batches[0]))]


def check_one_process(family, program: str) -> None:
    """What a calibration needs before anything loads: one process, and a family that replays one."""
    from parallel.drive.family_sampling import refuse_calibration
    from parallel.lifecycle.runtime import world_from_env

    refuse_calibration(family, program, "sample with sample.cache=none or first_block")
    if world_from_env()[1] > 1:
        raise ValueError(f"{program} runs on one process: start it with python, not torchrun")


def main(argv=None, session=None):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_RECIPE))
    p.add_argument("--checkpoint", default=None, help="default: the run's latest (model.pretrained without)")
    p.add_argument("--output", required=True, help="the calibration file to write (JSON)")
    p.add_argument("--steps", type=int, default=None, help="default: sample.steps")
    p.add_argument("--prompts", nargs="+", default=None, help="default: sample.prompts")
    p.add_argument("--seeds", type=int, default=2, help="samples per prompt")
    p.add_argument("--random-weights", action="store_true", help="a model with train.seed's random weights")
    p.add_argument(
        "--lora", nargs="+", default=[], metavar="FILE[:SCALE]", help="LoRAs merged, as infer.py --lora"
    )
    # what the table measures carries over to other images, as to other prompts
    p.add_argument("--image", nargs="+", default=[], help="the sampling's images, as infer.py --image")
    p.add_argument("--last-image", nargs="+", default=[], help="as infer.py --last-image")
    args = p.parse_args(args)
    cfg = load_config(args.config, overrides)
    steps = args.steps or cfg.sample.steps
    if steps < 3 or args.seeds < 1:
        raise ValueError(f"--steps must be at least 3 and --seeds at least 1, got {steps} and {args.seeds}")
    from models.families import family_named
    from parallel.checkpoints.checkpoint_files import find_checkpoint

    check_one_process(family_named(cfg.model.family), "scripts/calibrate_cache.py")
    checkpoint = find_checkpoint(cfg, args.checkpoint, args.random_weights)
    prompts = args.prompts or list(cfg.sample.prompts)
    # what the table is valid for, as infer.py will describe its own sampling (read before the weights)
    subject = calibration_subject(
        cfg, checkpoint, cfg.sample.use_ema, args.random_weights, args.lora, cfg.sample.guidance
    )
    velocities = record_velocities(cfg, args, overrides, prompts, steps, session)
    source = f"{args.config}, checkpoint {checkpoint}, {len(prompts)} prompts x {args.seeds} seeds"
    calibration = Calibration.measure(velocities, source, subject)
    calibration.save(args.output)
    middle = sorted(calibration.change[1:])[len(calibration.change) // 2 - 1]
    print(f"[calibrate] {steps} steps, median relative change per step {middle:.4f}: {args.output}")


if __name__ == "__main__":
    run_as_process(main)
