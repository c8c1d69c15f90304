"""Weights that hold NaN or inf are refused where they are loaded, naming the file and the first tensor that
holds one: model.pretrained (a Wan folder or a tessera run), a checkpoint that is sampled or resumed. (LoRA
files are checked as they are read, in models/lora_formats.py.) A model started from such weights trains
to NaN at its first step, where the divergence guard could only blame the learning rate, or samples a
video of NaN with exit 0.

The cost is one isfinite pass per tensor, on the device it is loaded to, with no copy of the weights, and
one host read per device. On a sharded model each rank checks its own shards and the ranks agree on the
first bad tensor in one tiny all-reduce, so every rank raises the same error, or none does."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models.float8 import is_float8
from parallel.build.init import canonical_name, is_scale
from parallel.compute import comm


class NonFiniteWeightsError(ValueError):
    """Weights read from a file (or a checkpoint) that hold NaN or inf: the message names the file and
    the first tensor, and what to load instead."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


NONE = 1 << 62  # no tensor holds NaN or inf (larger than any index)
ELSEWHERE = -1  # first_non_finite: another rank holds the tensor (lists that differ between ranks)


def first_non_finite(tensors: list, group=None, aligned: bool = True) -> int | None:
    """The index of the first of `tensors` that holds NaN or inf, or None; the verdict is the same on every
    rank of `group` (an all-reduce of one number). `aligned`: every rank passes the same tensors in the
    same order, each holding its own shards (DTensors: their local part), so an index names a tensor on
    every rank; else (PipeFusion stages: other blocks) a rank that holds no such tensor gets ELSEWHERE."""
    flags: dict = {}  # device -> (indices, flags): tensors of two devices cannot be stacked
    for i, t in enumerate(tensors):
        t = _local(t)
        if t.is_floating_point() and t.numel() and not is_float8(t):  # float8: its scale says (no inf)
            indices, finite = flags.setdefault(t.device, ([], []))
            indices.append(i)
            finite.append(torch.isfinite(t).all())
    mine = NONE
    for indices, finite in flags.values():
        bad = (~torch.stack(finite)).nonzero().flatten().tolist()  # the one host read of this device
        if bad:
            mine = min(mine, indices[bad[0]])
    agreed = mine
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([mine], dtype=torch.int64)  # the control group is gloo: a host tensor
        agreed = int(comm.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)[0])
    if agreed == NONE:
        return None
    return agreed if aligned else mine if mine != NONE else ELSEWHERE


def first_bad_parameter(model, group=None, select=None, aligned: bool = True) -> str | None:
    """The state-dict name of the first parameter of `model` (of those `select(name)` accepts) that holds
    NaN or inf, the same on every rank of `group`; None when all are finite; with `aligned` false (the
    ranks hold other parameters) a rank that holds none names it "a tensor of another rank"."""
    # a float8 weight's row scales hold its NaN or inf (float8 has no inf): named as the weight
    named = [(_weight_of(canonical_name(n)), p) for n, p in model.named_parameters()]
    named = [(n, p) for n, p in named if select is None or select(n)]
    index = first_non_finite([p for _, p in named], group, aligned)
    if index is None:
        return None
    return "a tensor another rank (PipeFusion stage) holds" if index == ELSEWHERE else named[index][0]


def _weight_of(name: str) -> str:
    return name.removesuffix("_scale") if is_scale(name) else name


def check_pretrained_finite(model, pretrained, group=None, select=None, aligned: bool = True) -> None:
    """After `model` was filled from model.pretrained (`pretrained`: its models/weight_files.py LazyWeights):
    refuse weights with NaN or inf, naming where the first such tensor was read from."""
    name = first_bad_parameter(model, group, select, aligned)
    if name is None:
        return
    if name.startswith("a tensor another rank"):
        where = f"model.pretrained={pretrained.folder}: {name}"
    else:
        where = pretrained.where(name)
    raise NonFiniteWeightsError(
        f"{where} holds NaN or inf (the first such tensor), so every output would be NaN; nothing was "
        "run. The weights are damaged or were saved from a diverged run: download or export them again, "
        "or name other weights in model.pretrained"
    )


def check_checkpoint_finite(model, path, use_ema: bool, group=None, aligned: bool = True) -> None:
    """After an unsharded model was filled from checkpoint `path` for sampling: refuse NaN or inf, naming
    the checkpoint, the tensor and the checkpoint before it."""
    name = first_bad_parameter(model, group, aligned=aligned)
    if name is not None and name.startswith("a tensor another rank"):
        _refuse_sampling(path, name)
    elif name is not None:
        _refuse_sampling(path, f"{'ema' if use_ema else 'model'}.{name}")


def check_adapters_finite(adapters: dict, path, use_ema: bool) -> None:
    """A LoRA run's adapters {module: (A, B, scale)} read from checkpoint `path` for sampling (whole host
    tensors, the same on every rank)."""
    named = [
        (f"{m}.lora_{ab}.weight", t) for m, (a, b, _) in adapters.items() for ab, t in (("A", a), ("B", b))
    ]
    index = first_non_finite([t for _, t in named])
    if index is not None:
        _refuse_sampling(path, f"{'ema' if use_ema else 'model'}.{named[index][0]}")


def _refuse_sampling(path, tensor: str):
    raise NonFiniteWeightsError(
        f"checkpoint {path}: tensor '{tensor}' holds NaN or inf, so every video would be NaN; nothing was "
        f"sampled. {_elsewhere(path, 'infer.py --checkpoint')}"
    )


def check_resumed_finite(runtime, path, model, ema, optimizer, distiller=None) -> None:
    """After a training run resumed from checkpoint `path`: its trained weights (the model's trainable
    parameters, their EMA, AdamW's moments; a distillation's critic and its AdamW's, `distiller`) hold no
    NaN or inf, the same verdict on every rank. A LoRA's frozen base was checked when it was read
    (parallel/build/components.py fill_sharded)."""
    names = {p: canonical_name(n) for n, p in model.named_parameters()}
    named = [(f"model.{names[p]}", p) for p in names if p.requires_grad]
    if hasattr(ema, "params"):  # parallel.build.lora.AdapterEMA: the adapters' EMA
        named += [(f"ema.{n}", t) for n, t in ema.params.items()]
    else:
        named += [(f"ema.{canonical_name(n)}", p) for n, p in ema.named_parameters()]
    optimizers = [("optimizer", optimizer, names)]
    if distiller is not None:  # its critic: adapters of the model, or a model of its own
        critic_names = names
        if distiller.critic_model is not None:
            critic_names = {p: canonical_name(n) for n, p in distiller.critic_model.named_parameters()}
            named += [(f"critic.{critic_names[p]}", p) for p in critic_names if p.requires_grad]
        optimizers.append(("critic_optimizer", distiller.critic, critic_names))
    for label, opt, where in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        named.append((f"{label}.{where.get(p, '?')}.{key}", value))
    index = first_non_finite([t for _, t in named], runtime.control_group)
    if index is not None:
        raise NonFiniteWeightsError(
            f"checkpoint {path}: '{named[index][0]}' holds NaN or inf, so training would diverge at its "
            f"first step; nothing was trained. {_elsewhere(path, 'train.resume=')}"
        )


def _elsewhere(path, option: str) -> str:
    from parallel.checkpoints.checkpoint_files import previous_checkpoint

    previous = previous_checkpoint(path)
    if previous is None:
        return "No earlier complete checkpoint is beside it: train again from an earlier start"
    joiner = "" if option.endswith("=") else " "
    return f"Use the one before it: {option}{joiner}{previous}"
