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

import zlib

import torch

from models.step_cache import CacheError
from parallel import comm
from parallel.cfg import SamplingGroups


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
