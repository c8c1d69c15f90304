"""LoRA training on a sharded DiT (the adapters themselves: models/lora.py).

Adapters are inserted on the meta-device model before `fully_shard`, so FSDP2 shards them with their
block. The frozen base keeps the compute dtype (bf16 on GPU) and has no float32 master copy, gradient,
optimizer state or EMA; only the adapters do (float32 master weights, AdamW, an EMA). A checkpoint holds
the adapters, their EMA and AdamW state (megabytes) and names the base it was trained on, with a
fingerprint of its contents: a resume against another base is refused by name before any collective.
"""

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from models.float8 import quantize_blocks
from models.lora import add_adapters, is_adapter, is_critic
from parallel.build.init import canonical_name
from parallel.checkpoints.checkpoint import optimizer_state_dict, read_tensors, set_optimizer_state
from parallel.checkpoints.checkpoint_files import CHECKSUMS, CheckpointError, resolve_checkpoint
from parallel.checkpoints.checkpoint_reading import read_trainer_state

SAMPLED_BYTES = 64 << 10  # of each tensor's start and end, in a Wan folder's fingerprint


def insert_adapters(
    model, lora_cfg, compute_dtype: torch.dtype, base_dtype: str = "auto", keep=None, critic: bool = False
) -> list[str]:
    """Adapters on the targeted Linear layers of a meta-device model, before it is sharded; the frozen base
    takes `compute_dtype` (bf16: no float32 copy of the base exists anywhere), the adapters float32; with
    base_dtype float8 (model.base_dtype) the blocks' Linear weights are float8 with a scale per row
    (models/float8.py; parallel/build/init.py materialize quantizes the rows as it reads them). `keep`: as
    models/lora.py add_adapters' (the layers the recipe trains); `critic`: a distillation's critic adapter
    beside each (train.objective=dmd)."""
    alpha = lora_cfg.alpha if lora_cfg.alpha is not None else lora_cfg.rank
    names = add_adapters(
        model, lora_cfg.rank, alpha, list(lora_cfg.targets), lora_cfg.dropout, lora_cfg.per_projection, keep,
        critic,
    )  # fmt: skip
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if is_adapter(name) else compute_dtype)
    if base_dtype == "float8":
        quantize_blocks(model)
    return names


def is_tessera_run(path) -> bool:
    """Whether model.pretrained names a tessera run (or its checkpoints/, `latest` or a step_<N>) rather
    than a diffusers folder."""
    path = Path(path)
    return (
        path.name == "latest"
        or (path / ".metadata").is_file()
        or (path / "latest").is_file()
        or (path / "checkpoints" / "latest").is_file()
    )


@dataclass
class Base:
    """The frozen base of a LoRA run: model.pretrained as given, the folder its weights come from (a
    tessera run resolves to its latest step_<N>) and a fingerprint of their contents."""

    path: str
    source: Path
    fingerprint: str

    def record(self) -> dict:
        return {"path": self.path, "source": str(self.source), "fingerprint": self.fingerprint}


def describe_base(pretrained: str) -> Base:
    """The base named by model.pretrained, fingerprinted (a few MB read, whatever the model's size)."""
    if is_tessera_run(pretrained):
        step = resolve_checkpoint(str(pretrained), Path(pretrained))
        if read_trainer_state(step).get("lora"):
            raise CheckpointError(
                f"model.pretrained={pretrained} is a LoRA run (its checkpoint {step} holds adapters only): "
                "name its base instead, and apply the LoRA with infer.py --lora or export it with --merge"
            )
        return Base(str(pretrained), step, _tessera_fingerprint(step))
    from models.family import component_folder, is_single_file

    if is_single_file(pretrained):  # a family's transformer file
        return Base(str(pretrained), Path(pretrained), _safetensors_fingerprint([Path(pretrained)]))
    folder = component_folder(pretrained, "transformer")  # a pipeline folder's transformer/
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        what = (
            "does not exist" if not Path(pretrained).exists() else f"has no .safetensors weights in {folder}"
        )
        raise FileNotFoundError(f"model.pretrained={pretrained} {what}")
    return Base(str(pretrained), folder, _safetensors_fingerprint(files))


def _tessera_fingerprint(step: Path) -> str:
    """A tessera checkpoint is sealed with every file's size and crc32 (checksums.json): hash that."""
    try:
        return "crc:" + hashlib.sha256((step / CHECKSUMS).read_bytes()).hexdigest()[:32]
    except OSError as e:
        raise CheckpointError(f"model.pretrained: {step} has no readable {CHECKSUMS} ({e})") from None


def _safetensors_fingerprint(files: list) -> str:
    """sha256 over each safetensors file's header and the first and last 64 KiB of every tensor: any
    retraining, merge or other checkpoint changes these bytes, and hashing reads a few MB, not 28 GB."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = f.read(length)
            digest.update(file.name.encode() + header)
            entries = json.loads(header)
            for key in sorted(k for k in entries if k != "__metadata__"):
                start, end = entries[key]["data_offsets"]
                for offset in sorted({start, max(start, end - SAMPLED_BYTES)}):
                    f.seek(8 + length + offset)
                    digest.update(f.read(min(SAMPLED_BYTES, end - offset)))
    return "sampled:" + digest.hexdigest()[:32]


def check_resume_base(checkpoint: Path, lora_cfg, base: Base | None) -> None:
    """Refuse, before any collective, to resume a checkpoint of another kind (full vs LoRA), rank or base."""
    saved = read_trainer_state(checkpoint).get("lora")
    if bool(saved) != bool(lora_cfg.rank):
        ours = f"a LoRA (lora.rank={lora_cfg.rank})" if lora_cfg.rank else "every weight (lora.rank=0)"
        theirs = f"a LoRA of rank {saved['rank']}" if saved else "every weight (full fine-tuning)"
        raise CheckpointError(
            f"checkpoint {checkpoint} trained {theirs}; this recipe trains {ours}. Use the recipe it was "
            f"trained with, or train.resume=none to start afresh"
        )
    if not saved:
        return
    alpha = lora_cfg.alpha if lora_cfg.alpha is not None else lora_cfg.rank
    same = saved["rank"] == lora_cfg.rank and float(saved["alpha"]) == float(alpha)
    if not same or sorted(saved["targets"]) != sorted(lora_cfg.targets):
        raise CheckpointError(
            f"checkpoint {checkpoint} holds adapters of rank {saved['rank']}, alpha {saved['alpha']} on "
            f"{list(saved['targets'])}; this recipe asks for rank {lora_cfg.rank}, alpha {alpha} on "
            f"{list(lora_cfg.targets)}: set lora.rank, lora.alpha and lora.targets as it was trained, or "
            "train.resume=none"
        )
    if per_projection(saved) != lora_cfg.per_projection:
        value = str(per_projection(saved)).lower()
        raise CheckpointError(
            f"checkpoint {checkpoint} holds adapters trained with lora.per_projection={value}: set "
            f"lora.per_projection={value} as it was trained, or train.resume=none"
        )
    if base is not None and saved["base"]["fingerprint"] != base.fingerprint:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds adapters trained on the base {saved['base']['path']} "
            f"({saved['base']['source']}, fingerprint {saved['base']['fingerprint']}); model.pretrained="
            f"{base.path} ({base.source}) has other weights (fingerprint {base.fingerprint}). Point "
            "model.pretrained at the base it was trained on, or train.resume=none"
        )


def local(p):
    return p.to_local() if isinstance(p, DTensor) else p


class AdapterEMA:
    """The exponential moving average of the adapters alone (not a distillation's critic, which only ever
    trains), sharded as they are."""

    def __init__(self, model):
        self.params = {  # the adapters the run samples with: every one but a distillation's critic
            n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n) and not is_critic(n)
        }
        self.names = list(self.params)

    @torch.no_grad()
    def update(self, model, decay: float) -> None:
        params = dict(model.named_parameters())
        ours = [local(self.params[n]) for n in self.names]
        torch._foreach_lerp_(ours, [local(params[n]) for n in self.names], 1.0 - decay)

    @contextmanager
    def swapped_in(self, model, before_restore=None):
        """The model with the EMA adapters in place of its own, for previews; its own are put back (after
        before_restore(model): parallel.compute.fsdp.reshard_all, so that no gathered EMA copy outlives
        the swap)."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            kept = {n: local(params[n]).clone() for n in self.names}
            for n in self.names:
                local(params[n]).copy_(local(self.params[n]))
        try:
            yield model
        finally:
            if before_restore is not None:
                before_restore(model)
            with torch.no_grad():
                for n in self.names:
                    local(params[n]).copy_(kept[n])


class LoRAState:
    """What a LoRA checkpoint holds: the adapters, their EMA and AdamW's state
    (parallel/checkpoints/checkpoint.py's TrainingState holds those of a full fine-tuning); a distillation's
    critic adapters too, and its own AdamW state (`critic`: that optimizer)."""

    def __init__(self, model, ema: AdapterEMA, optimizer, critic=None):
        self.model, self.ema, self.optimizer, self.critic = model, ema, optimizer, critic

    def state_dict(self) -> dict:
        state = {
            "model": {k: v for k, v in get_model_state_dict(self.model).items() if is_adapter(k)},
            "ema": {canonical_name(n): self.ema.params[n] for n in self.ema.names},
            "optimizer": optimizer_state_dict(self.model, self.optimizer),
        }
        if self.critic is not None:
            state["critic_optimizer"] = optimizer_state_dict(self.model, self.critic)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))
        for n in self.ema.names:
            local(self.ema.params[n]).copy_(local(state["ema"][canonical_name(n)]))
        set_optimizer_state(self.model, self.optimizer, state["optimizer"])
        if self.critic is not None:
            set_optimizer_state(self.model, self.critic, state["critic_optimizer"])


def per_projection(record: dict) -> bool:
    """Whether a LoRA run's fused Linear layers have an adapter per projection (runs saved before
    lora.per_projection existed shared one A)."""
    return record.get("per_projection", False)


def lora_record(lora_cfg, base: Base, adapted: list[str]) -> dict:
    """What trainer_state.pt says of a LoRA run (read back by check_resume_base, infer.py and export)."""
    return {
        "rank": lora_cfg.rank,
        "alpha": lora_cfg.alpha if lora_cfg.alpha is not None else lora_cfg.rank,
        "targets": list(lora_cfg.targets),
        "per_projection": lora_cfg.per_projection,
        "init_from": lora_cfg.init_from,
        "modules": adapted,
        "base": base.record(),
    }


def checkpoint_adapters(step, record: dict, model, use_ema: bool = True, verified: bool = False) -> dict:
    """A LoRA run's adapters {module: (A, B, scale)} as whole host tensors, read from checkpoint `step`
    (its EMA unless use_ema is False); `model`: a meta-device DiT of the run's architecture (adapters are
    added to it here, so pass a throwaway one)."""
    from models.lora import adapted_modules

    # the modules the run adapted: its targets may match layers it kept frozen, which have no adapter
    adapted = set(record["modules"]).__contains__ if record.get("modules") else None
    with torch.device("meta"):
        add_adapters(
            model,
            record["rank"],
            record["alpha"],
            record["targets"],
            per_projection=per_projection(record),
            keep=adapted,
        )
    modules = adapted_modules(model)
    shapes = {}
    for name, m in modules.items():
        shapes[f"{name}.lora_A.weight"] = tuple(m.lora_A.weight.shape)
        shapes[f"{name}.lora_B.weight"] = tuple(m.lora_B.weight.shape)
    tensors = read_tensors(step, "ema" if use_ema else "model", shapes, verified=verified)
    return {
        name: (tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"], m.lora_scale)
        for name, m in modules.items()
    }


def lora_of(step) -> dict | None:
    """The LoRA record of a checkpoint (None: a full fine-tuning's)."""
    return read_trainer_state(step).get("lora")


def base_of_run(checkpoint, record: dict, pretrained: str | None) -> str:
    """The base a LoRA run's checkpoint samples or exports on: `pretrained` (model.pretrained), else the
    one the checkpoint names (a tessera run that saved newer steps since: the step it was trained on, while
    kept); refused by name if that folder now holds other weights."""
    path = pretrained or record["base"]["path"]
    found = describe_base(path)
    source = record["base"].get("source")
    moved_on = found.fingerprint != record["base"]["fingerprint"] and is_tessera_run(path)
    if moved_on and source and is_tessera_run(source):
        # a base run that saved newer steps since: the step the adapters were trained on, if it is kept
        if describe_base(str(source)).fingerprint == record["base"]["fingerprint"]:
            return str(source)
    if found.fingerprint != record["base"]["fingerprint"]:
        was = f" ({source}, no longer kept)" if moved_on and source else ""
        raise CheckpointError(
            f"checkpoint {checkpoint} holds adapters trained on {record['base']['path']}{was} (fingerprint "
            f"{record['base']['fingerprint']}); model.pretrained={path} holds other weights "
            f"({found.fingerprint}). Point model.pretrained at the base the LoRA was trained on"
        )
    return path


def lora_base(cfg, checkpoint) -> dict | None:
    """A LoRA run's checkpoint samples on its base (parallel.build.lora.base_of_run); returns its LoRA record
    (None: a full fine-tuning's checkpoint)."""
    record = lora_of(checkpoint)
    if record is not None:
        cfg.model.pretrained = base_of_run(checkpoint, record, cfg.model.pretrained)
    return record
