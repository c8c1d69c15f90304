"""The step cache (models/step_cache.py, sample.cache) across a sampling layout. The ranks that share a
sample (cfg x pipefusion x ulysses x ring: the replica) must skip the same work, or they wait in different
collectives. Before the first step they compare what decides their skips (one small all-gather; a rank
with another recipe or calibration file is an `error:` line naming the ranks). What keeps first_block's
decisions equal is that its signal is added up over them (one all-reduce of two numbers per sample and
call): every rank compares the same sums with the same threshold. After sampling they compare the
decisions they took, a last check for what the sums cannot cover (under cfg alone a disagreement would
otherwise go unnoticed; under ulysses or ring it would already have stopped a collective). Faults (tests):
`cache_plan` gives a rank another threshold, `cache_signal` inflates its share of the first-block signal,
`cache_decision` flips its decisions after the sums are agreed.
"""

import json
import zlib
from pathlib import Path

import torch

from models.step_cache import CacheError
from parallel.compute import comm
from parallel.compute.cfg import SamplingGroups


def share_step_cache(cache, groups: SamplingGroups, steps: int, device, faults) -> None:
    """Check that every rank of the replica caches alike (an uncached rank too), and give first_block its
    agreement."""
    if cache is not None and faults.planned("cache_plan"):  # as if this rank read another recipe
        cache.threshold *= 0.5
    fingerprint = 0 if cache is None else cache.fingerprint(steps)
    _same_everywhere(fingerprint, groups, device, "what decides the step cache's skips")
    if cache is None or cache.method != "first_block" or groups.replica_size == 1:
        return
    inflate, flip = faults.planned("cache_signal"), faults.planned("cache_decision")

    def agree(sums: torch.Tensor) -> torch.Tensor:  # (samples, 2): this rank's change and reference sums
        if inflate:
            sums[:, 0] *= 1000.0
        sums = comm.all_reduce(sums.contiguous(), group=groups.replica_group)
        if flip:  # a rank that decides otherwise from the agreed sums (a bug the end check must catch)
            sums[:, 0] = sums[:, 1] - sums[:, 0]
        return sums

    cache.agree = agree


def check_cache_decisions(cache, groups: SamplingGroups, device) -> None:
    """After sampling: every rank of the replica took the same first_block decisions."""
    if cache is None or cache.method != "first_block" or groups.replica_size == 1:
        return
    _same_everywhere(zlib.crc32(repr(cache.decisions).encode()), groups, device, "the step cache's decisions")


def _same_everywhere(value: int, groups: SamplingGroups, device, what: str) -> None:
    if groups.replica_size == 1:
        return
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    everyone = torch.empty(groups.replica_size, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(everyone, mine, groups.replica_group)
    values = everyone.cpu().tolist()
    if len(set(values)) > 1:
        described = ", ".join(f"replica rank {r}: {v:#010x}" for r, v in enumerate(values))
        raise CacheError(
            f"the ranks sampling one video differ in {what} ({described}); every rank must run the same "
            "command, recipe (sample.cache, sample.cache_threshold, sample.cache_first_block_threshold, "
            "sample.cache_max_skips) and calibration file"
        )


def check_calibration(cache, cfg, args, checkpoint, guidance: float) -> None:
    """sample.cache=calibrated: refuse a calibration made for another model, weights, LoRAs, guidance or
    schedule than this infer.py run's (`args`: its command line), before any model is built."""
    if cache is None or cache.method != "calibrated":
        return
    use_ema = cfg.sample.use_ema and not args.no_ema
    subject = calibration_subject(cfg, checkpoint, use_ema, args.random_weights, args.lora, guidance)
    cache.calibration.check_made_for(subject, cfg.sample.cache_calibration)


def calibration_subject(cfg, checkpoint, use_ema: bool, random_weights: bool, loras, guidance: float) -> dict:
    """What a step-cache calibration measures, and is valid for: the transformer's architecture, its
    weights (a checkpoint, model.pretrained or random; a float8 base), the LoRAs merged, the frozen parts
    and the noise schedule (Family.calibration_parts), the guidance, the family's conditioning settings.
    Files are known by a fingerprint of their contents, not their path. Prompts, seeds and the sampling
    size are left out: the table carries over to them. scripts/calibrate_cache.py records it; infer.py
    compares (models/step_cache.py check_made_for)."""
    from models.families import family_named

    family = family_named(cfg.model.family)
    subject = {
        "model": family.meta_transformer(cfg).architecture(),
        "weights": _weights(cfg, checkpoint, use_ema, random_weights),
        "loras": _loras(loras),
        **family.calibration_parts(cfg, fingerprint_files),
        "guidance": float(guidance),
        "base_dtype": cfg.model.base_dtype,  # a float8 base samples other velocities
        "conditioning": _conditioning(family.latent_record(cfg)),  # e.g. its references' size
    }
    return json.loads(json.dumps(subject))  # as the file holds it (tuples become lists)


def _conditioning(record: dict) -> dict:
    """{"what", "id"} of the family's settings that change its conditioning (Family.latent_record: {} at
    their defaults, as models/step_cache.py ADDED_LATER takes a table written before they were recorded)."""
    what = ", ".join(f"{key}={value}" for key, value in sorted(record.items())) or "the family's defaults"
    return {"what": what, "id": json.dumps(record, sort_keys=True)}


def _weights(cfg, checkpoint, use_ema: bool, random_weights: bool) -> dict:
    """{"what": for people, "id": what is compared} of the DiT's weights."""
    from parallel.build.lora import is_tessera_run
    from parallel.checkpoints.checkpoint_files import resolve_checkpoint

    if random_weights:
        return {"what": f"random weights (train.seed={cfg.train.seed})", "id": f"random {cfg.train.seed}"}
    kind = "EMA" if use_ema else "raw"
    pretrained = cfg.model.pretrained
    if checkpoint is None and pretrained and is_tessera_run(pretrained):  # its latest's EMA weights
        checkpoint, kind = resolve_checkpoint(str(pretrained), Path(pretrained)), "EMA"
    if checkpoint is not None:
        step = Path(checkpoint)
        sealed = step / "checksums.json" if (step / "checksums.json").is_file() else step / ".metadata"
        crc = f"{zlib.crc32(sealed.read_bytes()):08x}"  # every file's crc32: the checkpoint's contents
        return {"what": f"checkpoint {step} ({kind} weights)", "id": f"checkpoint {crc} {kind}"}
    folder = Path(pretrained)
    if folder.is_file():  # one transformer file in the release's names
        return {"what": f"model.pretrained={pretrained}", "id": f"pretrained {fingerprint_files([folder])}"}
    if not (folder / "config.json").is_file() and (folder / "transformer" / "config.json").is_file():
        folder = folder / "transformer"
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
    return {"what": f"model.pretrained={pretrained}", "id": f"pretrained {fingerprint_files(files)}"}


def _loras(specs) -> dict:
    from models.lora_formats import parse_lora_spec

    if not specs:
        return {"what": "none", "id": "none"}
    parsed = [parse_lora_spec(spec) for spec in specs]
    what = ", ".join(f"{path}:{scale:g}" for path, scale in parsed)
    return {"what": what, "id": " ".join(f"{fingerprint_files([Path(p)])}:{s!r}" for p, s in parsed)}


def fingerprint_files(files: list, window: int = 1 << 16) -> str:
    """crc32 of each file's name, size and its first and last 64 KiB (a safetensors header and the
    first and last weights): two exports of different weights differ, whatever their paths, at the cost
    of a few reads."""
    crc = 0
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(window)
            f.seek(max(0, size - window))
            crc = zlib.crc32(f"{file.name} {size}".encode() + head + f.read(window), crc)
    return f"{crc:08x}"


def count_full_calls(sample_batch, cache, replica, device, samples: int) -> None:
    """After a batch: every rank of the replica took the same first_block decisions, and the calls that
    ran every block are added to `sample_batch.full_calls` (summed over the samples)."""
    check_cache_decisions(cache, replica, device)  # per batch: start() resets them
    if cache is not None and cache.method == "first_block":
        sample_batch.full_calls += cache.full_calls * samples
