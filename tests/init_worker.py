"""Run under torchrun (gloo, CPU) by tests/test_init.py: a DiT built on the meta device, sharded with
FSDP2 and filled by parallel/build/init.py equals the one-process model, from a seed and from a pretrained
diffusers Wan folder (argv[1]); each rank reads only its own rows of the pretrained weights."""

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

from models.dit.transformer import DiT  # noqa: E402
from models.dit.wan import WanWeights, tessera_state_dict_from_diffusers  # noqa: E402
from parallel.build.init import canonical_name, local_rows, materialize  # noqa: E402
from parallel.compute.fsdp import parallelize_dit  # noqa: E402

TINY = dict(in_channels=4, text_dim=16, depth=2, hidden_size=32, num_heads=4, patch_size=(1, 2, 2))


def sharded(kwargs, mesh, activation_checkpointing=False):
    with torch.device("meta"):
        model = DiT(**kwargs)
    return parallelize_dit(model, mesh, activation_checkpointing=activation_checkpointing)


def compare(label, model, expected: dict):
    rank = dist.get_rank()
    worst, names = 0.0, 0
    for name, param in model.named_parameters():
        full = param.full_tensor()
        ref = expected[canonical_name(name)]
        assert full.shape == ref.shape, (name, full.shape, ref.shape)
        worst = max(worst, (full - ref.float()).abs().max().item())
        names += 1
    assert names == len(expected), (names, len(expected))
    if rank == 0:
        print(
            f"{'ok' if worst == 0.0 else 'FAIL'} {label}: {names} parameters, max difference {worst}",
            flush=True,
        )


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # From a seed: the sharded weights are those of init_weights(seed) on one process, with and without
    # the activation-checkpointing wrapper in the parameter names.
    for options in ({}, dict(adaln="single", qk_norm_across_heads=True, pooled_text=False, text_mask=False)):
        reference = DiT(**TINY, **options)
        reference.init_weights(seed=7)
        for ac in (False, True):
            model = sharded({**TINY, **options}, mesh, ac)
            materialize(model, "cpu", seed=7)
            compare(
                f"seed {'adaLN-single' if options else 'adaLN-Zero'} ac={ac}",
                model,
                dict(reference.named_parameters()),
            )
    # From a pretrained diffusers folder, reading only this rank's rows.
    folder = Path(sys.argv[1])
    weights = WanWeights(folder)
    reads = []
    read = weights.read
    weights.read = lambda name, start, stop: reads.append((name, start, stop)) or read(name, start, stop)
    model = sharded(weights.dit_kwargs, mesh)
    materialize(model, "cpu", seed=0, pretrained=weights)
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    compare("pretrained", model, tessera_state_dict_from_diffusers(state))
    own = {canonical_name(n): local_rows(p) for n, p in model.named_parameters()}
    assert all((start, stop) == own[name] for name, start, stop in reads), reads
    partial = sum(stop - start < weights.shape(name)[0] for name, start, stop in reads)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, partial)
    if dist.get_rank() == 0:
        print(
            f"ok pretrained reads only own rows: {len(reads)} reads, {counts} of them partial per rank",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_finished()  # gloo threads must not outlive the interpreter
