"""A recipe's peak memory modelled on the meta device, and the start-up check that refuses a misfit.

Before any process group, weight or data file (train.py check_before_start): per device the sharded
weights, gradients, AdamW and EMA (exact counts of the model's parameters and dtypes), a block gathered and
the next prefetched, the activations kept for backward at the largest bucket (a rule of thumb,
ACTIVATION_VALUES) and the frozen encoders; per host the processes, loader workers and offloaded states;
compared with the GPU's free memory and the host's available memory (parallel/lifecycle/memory.py). A refusal
names the figures and what would fit; train.memory_check=false skips the check (the model is an estimate).
train.memory=auto picks the fastest activation checkpointing and offload that fit (memory_choices).
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel.lifecycle.memory import GiB, floor_of, gib, host_memory

ACTIVATION_VALUES = 17  # values a block keeps per token and hidden unit for backward (no attention matrix)
WORKER_BYTES = 3 * GiB // 10  # a data loader worker (forked: what it touches of its own)
SIBLING_BYTES = GiB  # another local rank's process before its work: interpreter, libraries, CUDA's host side
COLLECTIVE_BYTES = GiB // 2  # NCCL's buffers and the allocator's reserve on a GPU of several ranks


@dataclass
class Peak:
    """What a recipe's run adds to this rank's process as it is at the check (its interpreter, libraries and
    CUDA context are in what the free figures leave out already), and to the host the other local ranks'
    processes (SIBLING_BYTES each: they may not have started yet): bytes per device and per host, and what
    makes them up (for the message)."""

    device: int
    host: int
    parts: dict = field(default_factory=dict)  # name -> bytes per device (on a CPU: per process)

    def describe(self) -> str:
        return ", ".join(f"{name} {gib(n)}" for name, n in self.parts.items() if n >= (64 << 20))


@dataclass
class Setting:
    """What the peak depends on besides the model."""

    fsdp: int  # ranks the states are sharded over
    local: int  # processes on this host
    sp: int  # ranks a sample's tokens are split over (ulysses x ring)
    tokens: int  # tokens of the largest step of one data-parallel rank (batch x tokens of its bucket)
    compute_bytes: int  # 2 for bf16, 4 for float32
    checkpointing: str  # none | all | selective
    cpu_offload: bool
    on_gpu: bool
    workers: int  # data loader workers per process
    batch_bytes: int  # one batch as the loader hands it over
    frozen_bytes: int  # the text encoder, VAE and image encoder on every rank
    activation_offload: bool = False  # train.activation_offload: the blocks' inputs on the host
    # a distillation's full copies (lora.rank=0): a critic trained as the model is, and the frozen teacher
    # stored in the compute dtype
    full_copies: bool = False


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def modelled_peak(model, setting: Setting) -> Peak:
    """The peak of training `model` (on the meta device, with its adapters if it trains a LoRA) under
    `setting`: the sharded states (weights as they are stored, and for what trains a float32 gradient,
    AdamW's two moments and the EMA), one block gathered (and the next prefetched) in the compute dtype
    with its gradient, the activations kept for backward, and the frozen parts."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    n_trained = sum(p.numel() for p in trained)
    lora = any("lora_" in name for name, _ in model.named_parameters())
    states = {
        "weights": _nbytes(params),
        "gradients": 4 * n_trained,
        "AdamW": 8 * n_trained,
        # a full fine-tune's EMA: a whole float32 copy of the model (frozen parts too); a LoRA's: its adapters
        "EMA": 4 * (n_trained if lora else sum(p.numel() for p in params)),
    }
    if setting.full_copies:
        states["critic"] = _nbytes(params) + 12 * n_trained
        states["teacher"] = setting.compute_bytes * sum(p.numel() for p in params)
    blocks = list(model.blocks)
    block = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()))
    block_elements = sum(p.numel() for p in block.parameters())
    block_trained = sum(p.numel() for p in block.parameters() if p.requires_grad)
    working = block_elements * 2 * setting.compute_bytes + block_trained * 4
    hidden = _width(block)
    tokens = math.ceil(setting.tokens / setting.sp)
    one_block = tokens * hidden * setting.compute_bytes * ACTIVATION_VALUES
    kept = {"none": one_block * len(blocks), "selective": one_block * len(blocks) // 2}
    block_input = tokens * hidden * setting.compute_bytes
    inputs = block_input * len(blocks)  # what full checkpointing keeps
    moved = setting.activation_offload and setting.checkpointing == "all" and setting.on_gpu
    activations = kept.get(setting.checkpointing, (0 if moved else inputs) + one_block)
    # torch's pinned host memory comes in powers of two (its caching host allocator), kept for the run
    offloaded = len(blocks) * 2 ** math.ceil(math.log2(block_input)) if moved else 0
    sharded = {name: math.ceil(n / setting.fsdp) for name, n in states.items()}
    on_device = {"working block": working, "activations": activations, "frozen parts": setting.frozen_bytes}
    if not setting.cpu_offload:
        on_device = sharded | on_device
    loader = setting.workers * (WORKER_BYTES + 2 * setting.batch_bytes)
    if setting.on_gpu and setting.fsdp > 1:
        on_device["collective buffers"] = COLLECTIVE_BYTES
    device, parts = sum(on_device.values()), dict(on_device)
    if setting.on_gpu:  # the host holds the offloaded states, and the loader's
        per_process = sum(sharded.values()) if setting.cpu_offload else 0
        if setting.cpu_offload:
            parts["offloaded states (host)"] = per_process
    else:  # the device is the host
        per_process = device
    if setting.on_gpu and offloaded:
        per_process += offloaded
        parts["offloaded block inputs (host)"] = offloaded
    siblings = (setting.local - 1) * SIBLING_BYTES
    host = setting.local * (per_process + loader) + siblings
    return Peak(device, host, parts | {"loader workers (host)": loader, "other local ranks (host)": siblings})


def _width(block) -> int:
    """The hidden width of a block: the in_features most of its Linear layers' outputs share (weighed by
    out_features: LTX-2's video stream, 4096 wide, over its more numerous 2048-wide audio Linears; an
    adapter's own Linear layers left out: their B's in_features is the rank)."""
    from collections import Counter

    from models.lora import is_adapter

    own = [m for n, m in block.named_modules() if not is_adapter(n + ".") and isinstance(m, torch.nn.Linear)]
    widths = Counter()
    for m in own:
        widths[m.in_features] += m.out_features
    return widths.most_common(1)[0][0] if widths else 1


def device_free(local_rank: int) -> int | None:
    """Free bytes of this rank's GPU, or None on a CPU (and for a rank with no GPU of its own, which
    parallel/lifecycle/runtime.py pick_device refuses by name)."""
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        return None
    free, _ = torch.cuda.mem_get_info(local_rank)
    return free


class MemoryPlanError(ValueError):
    """A recipe whose modelled peak exceeds the free memory (a user error: the message says what fits)."""


def check_training_memory(cfg, layout, buckets, world_size: int, local_world: int, local_rank: int):
    """The start-up check (see the module docstring): (the recipe, with train.memory=auto's choice of
    activation checkpointing and offload in it, the start-up line's words on the modelled peak; "" with
    train.memory_check=false), or a MemoryPlanError naming the figures and what would fit."""
    if not cfg.train.memory_check:
        return cfg, ""
    setting = training_setting(cfg, layout, buckets, world_size, local_world)
    model = meta_model(cfg, cfg.lora.rank)
    free = device_free(local_rank)  # first: the CUDA context it makes is then in the host's figure too
    available, total, where = host_memory()
    return plan_memory(cfg, setting, model, Room(free, available, total, where, local_rank))


def plan_memory(cfg, setting, model, room) -> tuple:
    """check_training_memory's verdict for `model` under `setting` in `room` (scripts/card_memory.py asks
    it for a card it simulates): (the recipe with train.memory=auto's choice, the words), or refused."""
    chosen, words = cfg, ""
    if cfg.train.memory == "auto":  # the fastest that fits; none: refused with the most frugal's figures
        tried = [(what, keys, _applied(setting, keys)) for what, keys in memory_choices(cfg, setting)]
        fitting = [t for t in tried if not room.short(modelled_peak(model, t[2]), t[2])]
        what, keys, setting = fitting[0] if fitting else tried[-1]
        chosen, words = with_train_keys(cfg, keys), f"train.memory=auto chose {what}; "
    peak = modelled_peak(model, setting)
    short = room.short(peak, setting)
    if short:
        fits = _what_fits(cfg, model, setting, room.free, room.available - floor_of(room.total))
        raise MemoryPlanError(
            f"this recipe does not fit: its modelled peak is {'; '.join(short)} ({peak.describe()}; the "
            f"model: {_count(model)} parameters). It would end in an out-of-memory failure, or the kernel's "
            f"out-of-memory killer. {fits} (the figures are modelled on the meta device: "
            "train.memory_check=false skips this check)"
        )
    unit = "GPU" if setting.on_gpu else "process"
    host = f"{gib(peak.host)} on this host ({gib(room.available)} available)"
    return chosen, f"{words}modelled peak {gib(peak.device)} per {unit}, {host}"


@dataclass
class Room:
    """The memory a run may take: the GPU's free bytes (None on a CPU) and the host's available ones."""

    free: int | None
    available: int
    total: int
    where: str
    local_rank: int

    def short(self, peak: Peak, setting: Setting | None = None) -> list:
        """What `peak` exceeds, in words ([]: it fits)."""
        short = []
        if self.free is not None and peak.device > self.free:
            short.append(f"{gib(peak.device)} per GPU, and GPU {self.local_rank} has {gib(self.free)} free")
        if (
            self.total and peak.host + floor_of(self.total) > self.available
        ):  # what the run's watch keeps free
            local = setting.local if setting is not None else 1
            processes = f"{local} process{'es' * (local > 1)}"
            short.append(
                f"{gib(peak.host)} on this host ({processes}), and {self.where} has {gib(self.available)} "
                "available"
            )
        return short


def memory_choices(cfg, setting: Setting) -> list:
    """train.memory=auto's candidates, fastest first: [(words, {train key: value})]. Selective checkpointing
    keeps torch's attention outputs (sdpa or math only); checkpointing recomputes a LoRA's dropout with
    other masks (lora.dropout > 0: none); train.activation_offload moves the blocks' inputs from a GPU to
    its host (slower than keeping them: a copy each way per step, not overlapped on the way out, faster
    than train.cpu_offload's copies of every block's weights); train.cpu_offload runs on one GPU."""
    off = {"activation_checkpointing": False, "checkpoint_policy": "all", "cpu_offload": False,
           "activation_offload": False}  # fmt: skip
    choices = [("no activation checkpointing", off)]
    if cfg.lora.rank and cfg.lora.dropout > 0:
        return choices
    if cfg.model.attention_backend in ("sdpa", "math"):
        selective = {**off, "activation_checkpointing": True, "checkpoint_policy": "selective"}
        choices.append(("selective activation checkpointing", selective))
    every = {**off, "activation_checkpointing": True}
    choices.append(("full activation checkpointing", every))
    inputs = {**every, "activation_offload": True}
    if setting.on_gpu:  # on a CPU the host is the device: nothing to move
        choices.append(("full activation checkpointing with train.activation_offload", inputs))
    if setting.on_gpu and setting.fsdp == 1:
        choices.append(
            ("full activation checkpointing with train.cpu_offload", {**every, "cpu_offload": True})
        )
        choices.append(
            ("full activation checkpointing with train.cpu_offload and train.activation_offload",
             {**inputs, "cpu_offload": True})
        )  # fmt: skip
    return choices


def _applied(setting: Setting, keys: dict) -> Setting:
    from dataclasses import replace

    checkpointing = keys["checkpoint_policy"] if keys["activation_checkpointing"] else "none"
    offloads = dict(cpu_offload=keys["cpu_offload"], activation_offload=keys["activation_offload"])
    return replace(setting, checkpointing=checkpointing, **offloads)


def with_train_keys(cfg, keys: dict):
    """A read-only copy of the recipe with `keys` set under train (what config.yaml then records)."""
    import copy

    from omegaconf import OmegaConf

    chosen = copy.deepcopy(cfg)
    OmegaConf.set_readonly(chosen, False)
    for key, value in keys.items():
        chosen.train[key] = value
    OmegaConf.set_readonly(chosen, True)
    return chosen


def training_setting(cfg, layout, buckets, world_size: int, local_world: int, on_gpu=None) -> Setting:
    """The setting of this recipe's run (`on_gpu`: this machine's unless given)."""
    from parallel.lifecycle.runtime import computes_in_bf16

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    largest = max(range(len(buckets)), key=lambda i: buckets.tokens[i] * buckets.batch_sizes[i])
    bucket = buckets.buckets[largest]
    tc = cfg.train
    return Setting(
        fsdp=world_size,
        local=local_world,
        sp=layout.ulysses * layout.ring,
        tokens=buckets.tokens[largest] * buckets.batch_sizes[largest],
        compute_bytes=2 if computes_in_bf16(tc.precision, "cuda" if on_gpu else "cpu") else 4,
        checkpointing=tc.checkpoint_policy if tc.activation_checkpointing else "none",
        cpu_offload=tc.cpu_offload,
        activation_offload=tc.activation_offload,
        full_copies=tc.objective == "dmd" and not cfg.lora.rank,
        on_gpu=on_gpu,
        workers=cfg.data.num_workers,
        batch_bytes=buckets.batch_sizes[largest] * 3 * bucket.frames * bucket.height * bucket.width,
        frozen_bytes=frozen_bytes(
            cfg, 2 if computes_in_bf16(tc.precision, "cuda" if on_gpu else "cpu") else 4
        ),
    )


def meta_model(cfg, rank: int, on_gpu=None):
    """The recipe's transformer on the meta device, with rank-`rank` adapters on lora.targets (0: none, a
    full fine-tune: every parameter float32 and trained), as train.py builds it (`on_gpu`: its adapters
    in bf16; this machine's unless given)."""
    from models.families import family_named
    from models.lora import is_adapter
    from parallel.build.components import meta_transformer
    from parallel.build.lora import insert_adapters

    family = family_named(cfg.model.family)
    model = meta_transformer(cfg)
    if rank:
        lora = {**{k: cfg.lora[k] for k in cfg.lora}, "rank": rank}
        from types import SimpleNamespace

        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        dtype = torch.bfloat16 if on_gpu else torch.float32
        insert_adapters(
            model, SimpleNamespace(**lora), dtype, cfg.model.base_dtype, keep=_trains(family, cfg),
            critic=cfg.train.objective == "dmd",
        )  # fmt: skip
    for name, p in model.named_parameters():
        trained = (not rank or is_adapter(name)) and family.trains_parameter(cfg, name)
        p.requires_grad_(trained)
    return model


def _trains(family, cfg):
    return lambda name: family.trains_parameter(cfg, name)


def _count(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _what_fits(cfg, model, setting: Setting, free: int | None, available: int) -> str:
    """The changes of the recipe that would fit here, each with its modelled peak; or why none would."""
    from dataclasses import replace

    def fits(peak: Peak) -> bool:
        return (free is None or peak.device <= free) and peak.host <= available

    tried = []
    if not cfg.lora.rank:
        lora = replace(setting, full_copies=False)  # a distillation's critic and teacher become adapters
        tried.append(("a LoRA (lora.rank=32)", meta_model(cfg, 32, setting.on_gpu), lora))
    if setting.checkpointing == "none":
        tried.append(("train.activation_checkpointing=true", model, replace(setting, checkpointing="all")))
    if setting.on_gpu and not setting.cpu_offload and setting.fsdp == 1:
        tried.append(("train.cpu_offload=true", model, replace(setting, cpu_offload=True)))
    if setting.on_gpu:
        gpus = next(
            (
                n
                for n in (2, 4, 8, 16, 32, 64, 128, 256)
                if fits(modelled_peak(model, replace(setting, fsdp=n)))
            ),
            None,
        )
        if gpus:
            tried.append(
                (f"{gpus} GPUs (FSDP2 shards the states over them)", model, replace(setting, fsdp=gpus))
            )
    good = [f"{what}: {gib(peak.device)}" for what, m, s in tried if fits(peak := modelled_peak(m, s))]
    if good:
        return "What would fit: " + "; ".join(good) + "."
    weights = _nbytes(model.parameters())
    where = "a GPU" if setting.on_gpu else "this host"
    return (
        f"Nothing tried here fits on {where} (a LoRA, activation checkpointing, offload, more GPUs): the "
        f"weights alone are {gib(weights)}; a smaller model, fewer frames or a lower resolution, or a "
        "machine with more memory"
    )


def frozen_bytes(cfg, compute_bytes: int) -> int:
    """The frozen parts' bytes on every rank in the compute dtype: the tensors their folders' .safetensors
    files hold (counted from the headers), the VAE, text and image encoders of the recipe (a pipeline
    folder's parts besides its transformers). With data.latents a pipeline's text and image encoders are
    left out (released once the previews' prompts are encoded). Tiny random parts (no folder) count as
    nothing: the check errs towards running."""
    folders = {cfg.vae.pretrained, cfg.text_encoder.pretrained, cfg.image_encoder.pretrained} - {None}
    root = Path(cfg.model.pretrained) if cfg.model.pretrained else None
    if root is not None and (root / "model_index.json").is_file():  # a pipeline folder: its other parts
        folders.add(str(root))
    files = {f for folder in folders if Path(folder).is_dir() for f in Path(folder).rglob("*.safetensors")}
    skipped = ("transformer",) + (("text_encoder", "image_encoder") if cfg.data.latents else ())
    return compute_bytes * sum(_elements(f) for f in files if not f.parent.name.startswith(skipped))


def _elements(file: Path) -> int:
    import json

    try:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return 0
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
