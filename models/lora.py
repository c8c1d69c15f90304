"""Low-rank adapters (LoRA, Hu et al.) on a DiT's Linear layers; single-device code.

A targeted nn.Linear becomes a LoRALinear in place: its `weight` and `bias` keep their names (so
model.pretrained, checkpoints and FSDP2 see the base as before) and it gains `lora_A` (r x in) and `lora_B`
(out x r): W x + b + (alpha / r) B A x. Not PEFT: its wrapper renames every base weight
(`...base_layer.weight`) that the pretrained reader, the seeded initialisation and the checkpoints know, and
fused projections (qkv, kv) need exact splitting on export (models/lora_formats.py). A fused Linear gets one
rank-r adapter per projection (lora.per_projection), as PEFT's to_q/to_k/to_v: lora_A stacks their A's
(n r x in), lora_B holds each one's B in its rows. Each adapter's init comes from its own (seed, name)
generator, the same in every layout. Distillation (models/distill.py) adds the critic's adapter
(`critic_A`, `critic_B`) beside each; `active_adapter` picks the one a forward adds (or none: the teacher).
"""

import fnmatch
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

from models.float8 import SCALE, base_linear

# Every Linear of the blocks' self-attention, cross-attention and feed-forward (tessera's names: the
# fused qkv and kv projections count as one Linear each).
DEFAULT_TARGETS = ("blocks.*.attn.*", "blocks.*.cross_attn.*", "blocks.*.mlp.*")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update; made from an nn.Linear by `add_adapters` (not constructed)."""

    lora_scale: float
    lora_dropout: nn.Module
    lora_groups: int  # n > 1: a fused Linear whose n projections (row blocks) have adapters of their own
    # which adapter the forward adds: "lora" (the generator's, the only one outside distillation), "critic",
    # or None (the base alone, bit for bit); set on every layer at once by active_adapter
    lora_active: str | None = "lora"
    dequantizes = True  # its forward calls models/float8.py base_linear: a float8 base may be under it

    def forward(self, x):
        base = base_linear(self, x)  # F.linear, or of a float8 base (models/float8.py)
        if self.lora_active is None:
            return base
        return base + self.lora_update(x).to(base.dtype)

    def lora_update(self, x):
        """The active adapter's scaled update alone, in its dtype (a caller that runs the base Linear itself,
        as the DiT's float32 time embedder does, adds it); zeros with none active."""
        if self.lora_active is None:
            return torch.zeros((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
        A, B = getattr(self, f"{self.lora_active}_A"), getattr(self, f"{self.lora_active}_B")
        down = A(self.lora_dropout(x).to(A.weight.dtype))  # (..., n r)
        n = self.lora_groups
        if n == 1:
            update = B(down)
        else:  # projection i: its rows of B times its r entries of A x
            B = B.weight
            update = torch.einsum(
                "...gr,gor->...go", down.unflatten(-1, (n, -1)), B.view(n, -1, B.shape[1])
            ).flatten(-2)
        return update * self.lora_scale


def target_modules(model: nn.Module, patterns) -> dict[str, nn.Linear]:
    """{name: module} of the Linear layers whose names match one of the fnmatch `patterns`. A pattern that
    matches no Linear is an error naming it (an adapter that silently goes nowhere is the bug to avoid)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen, empty = {}, []
    for pattern in patterns:
        hits = [name for name in linears if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            empty.append(pattern)
        chosen.update({name: linears[name] for name in hits})
    if empty:
        examples = ", ".join(list(linears)[:6])
        raise ValueError(
            f"lora.targets: {', '.join(repr(p) for p in empty)} match no Linear layer of this model "
            f"(its Linear layers are named like {examples}, ...)"
        )
    return dict(sorted(chosen.items()))


def projection_count(module: nn.Linear, per_projection: bool) -> int:
    """How many adapters a Linear gets: one per fused projection (models/dit/transformer.py marks qkv and kv),
    or 1."""
    return getattr(module, "fused_projections", 1) if per_projection else 1


def add_adapters(
    model: nn.Module,
    rank: int,
    alpha: float,
    patterns,
    dropout: float = 0.0,
    per_projection: bool = True,
    keep=None,
    critic: bool = False,
) -> list[str]:
    """Turn the targeted Linear layers of `model` into LoRALinear in place (on whatever device the model
    is, the meta device included; parallel/build/init.materialize fills them) and freeze every other
    parameter. per_projection: a fused Linear gets one rank-`rank` adapter per projection (else one shared A).
    `keep(name)`: False for a targeted layer the recipe keeps frozen, which gets no adapter (LTX-2's audio
    with data.audio=false). `critic`: each layer gets the critic's adapter too (distillation), of the same
    shape. Returns the names of the adapted modules."""
    targets = target_modules(model, patterns)
    if keep is not None:
        targets = {name: m for name, m in targets.items() if keep(name)}
        if not targets:
            raise ValueError(
                f"lora.targets={list(patterns)}: every layer they match is one this recipe keeps frozen "
                "(the family's trains_parameter: LTX-2's audio with data.audio=false); target others"
            )
    too_big = [
        f"{name} ({m.in_features} -> {m.out_features})"
        for name, m in targets.items()
        if rank > min(m.in_features, m.out_features // projection_count(m, per_projection))
    ]
    if too_big:
        raise ValueError(f"lora.rank={rank} is larger than the smallest side of {', '.join(too_big[:3])}")
    model.requires_grad_(False)
    for module in targets.values():
        device, n = module.weight.device, projection_count(module, per_projection)
        module.__class__ = LoRALinear
        module.lora_A = nn.Linear(module.in_features, n * rank, bias=False, device=device)
        module.lora_B = nn.Linear(rank, module.out_features, bias=False, device=device)
        if critic:
            module.critic_A = nn.Linear(module.in_features, n * rank, bias=False, device=device)
            module.critic_B = nn.Linear(rank, module.out_features, bias=False, device=device)
        module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        module.lora_scale = alpha / rank
        module.lora_groups = n
    return list(targets)


ADAPTER_KEYS = (".lora_A.", ".lora_B.", ".critic_A.", ".critic_B.")


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) belongs to an adapter (the generator's or the critic's)."""
    return any(key in name for key in ADAPTER_KEYS)


def is_critic(name: str) -> bool:
    """Whether a parameter belongs to a distillation's critic adapter."""
    return ".critic_A." in name or ".critic_B." in name


@contextmanager
def active_adapter(model: nn.Module, which: str | None):
    """Every adapted layer of `model` adds adapter `which` ("lora": the generator's, "critic", or None: the
    base alone) in the forwards inside; the one before is put back after. A backward that recomputes a
    forward (activation checkpointing) must run inside the same choice as its forward."""
    layers = list(adapted_modules(model).values())
    before = [m.lora_active for m in layers]
    for m in layers:
        m.lora_active = which
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.lora_active = was


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_adapter(name)]


@torch.no_grad()
def init_adapter(name: str, tensor: torch.Tensor, generator=None) -> None:
    """An adapter's initialisation, in place: A as PEFT and the LoRA paper (Kaiming-uniform, bound
    1/sqrt(in)), B zeros, so that training starts from the base model exactly."""
    if ".lora_B." in name or ".critic_B." in name:
        tensor.zero_()
    else:
        bound = 1.0 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)


def seeded_adapter(name: str, shape, seed: int) -> torch.Tensor:
    """An adapter parameter, whole, in float32, as lora.seed initialises it in every layout."""
    from models.layers import parameter_generator

    whole = torch.empty(shape, dtype=torch.float32)
    init_adapter(name, whole, parameter_generator(seed, name))
    return whole


def lora_delta(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The weight update B A (out x in, float32, unscaled) of one adapter; an A with n times B's rank holds
    n per-projection adapters (add_adapters' per_projection), projection i taking its rows of B."""
    A, B = A.float(), B.float()
    n = A.shape[0] // B.shape[1]
    if n == 1:
        return B @ A
    return torch.cat([b @ a for a, b in zip(A.chunk(n), B.chunk(n))])


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_deltas(model: nn.Module, deltas: dict, elsewhere=()) -> None:
    """Add weight deltas {linear module name: [(rows, delta (rows x in) float32)]} into the model's Linear
    weights, in float32 then back to their dtype; rows is a slice of the output rows (a fused qkv takes
    its q, k and v updates in its thirds) or None for all. An entry (rows, A, B, scale) (factors_of's,
    LoRAUpdate.factors') is the delta scale B A, made as its module's turn comes (all of them at once would
    take the transformer's size in float32), and on a float8 layer (model.base_dtype=float8) it stays a
    frozen adapter beside the quantized weight, as training computed it: e4m3's rounding would swallow an
    update smaller than its step. `elsewhere`: the module names another PipeFusion stage holds
    (parallel/compute/pipefusion_plan.held_elsewhere); a delta under one is that stage's to merge and is
    skipped here. Any other name the model lacks is an error naming it: a delta that silently goes nowhere
    would sample the base model."""
    modules = dict(model.named_modules())
    skipped = [name for name in deltas if name not in modules and is_under(name, elsewhere)]
    unknown = [name for name in deltas if name not in modules and name not in skipped]
    if unknown:
        raise ValueError(f"LoRA deltas for layers this model lacks: {', '.join(sorted(unknown)[:4])}")
    for name, updates in deltas.items():
        if name in skipped:
            continue
        module = modules[name]
        if getattr(module, SCALE, None) is not None:  # its rows' scales would have to change with them
            if any(len(update) == 2 for update in updates):
                raise ValueError(f"{name}: a float8 base (model.base_dtype=float8) takes no merged deltas")
            _keep_beside(module, updates)
            continue
        weight = module.weight.float()
        for update in updates:
            rows, delta = (update[0], update[3] * lora_delta(*update[1:3])) if len(update) == 4 else update
            weight[rows if rows is not None else slice(None)] += delta.to(weight.device)
        module.weight.copy_(weight.to(module.weight.dtype))


def _keep_beside(module: nn.Linear, updates: list) -> None:
    """Factored updates [(rows, A, B, scale)] as one frozen adapter of `module` (a LoRALinear from here on,
    with what an earlier source kept beside it): A stacked, B block-diagonal (a per-projection adapter's
    blocks, each update in its rows), scale in B. float32: the layer's input is cast up for it."""
    As, Bs = [], []
    if isinstance(module, LoRALinear):  # another source's, kept beside already: this one joins it
        As.append(module.lora_A.weight.float())
        Bs.append(module.lora_scale * module.lora_B.weight.float())
    for rows, A, B, scale in updates:
        n, r = A.shape[0] // B.shape[1], B.shape[1]
        rows = rows if rows is not None else slice(None)
        full = torch.zeros(module.out_features, n * r)
        block = torch.zeros(full[rows].shape)
        for i, b in enumerate(B.float().chunk(n)):  # projection i: its rows of B, its r entries of A x
            block[i * b.shape[0] : (i + 1) * b.shape[0], i * r : (i + 1) * r] = scale * b
        full[rows] = block
        As.append(A.float())
        Bs.append(full)
    A, B = torch.cat(As), torch.cat(Bs, dim=1)
    device = module.weight.device
    module.__class__ = LoRALinear
    module.lora_A = nn.Linear(A.shape[1], A.shape[0], bias=False, device=device).requires_grad_(False)
    module.lora_B = nn.Linear(B.shape[1], B.shape[0], bias=False, device=device).requires_grad_(False)
    module.lora_A.weight.copy_(A)
    module.lora_B.weight.copy_(B)
    module.lora_dropout, module.lora_scale, module.lora_groups = nn.Identity(), 1.0, 1


def is_under(name: str, prefixes) -> bool:
    """Whether module `name` is one of `prefixes` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def deltas_of(adapters: dict) -> dict:
    """{module name: [(None, scale B A)]} in float32 (for merge_deltas) of adapters {name: (A, B, scale)}."""
    return {name: [(None, scale * lora_delta(A, B))] for name, (A, B, scale) in adapters.items()}


def factors_of(adapters: dict) -> dict:
    """deltas_of's, factored: {module name: [(None, A, B, scale)]} (merge_deltas makes each as it merges)."""
    return {name: [(None, A, B, scale)] for name, (A, B, scale) in adapters.items()}


def adapter_deltas(model: nn.Module) -> dict:
    """deltas_of a model's own adapters."""
    return deltas_of(
        {name: (m.lora_A.weight, m.lora_B.weight, m.lora_scale) for name, m in adapted_modules(model).items()}
    )


@torch.no_grad()
def fold_adapters(model: nn.Module) -> nn.Module:
    """Merge every adapter into its base weight and turn the LoRALinear layers back into nn.Linear."""
    merge_deltas(model, adapter_deltas(model))
    for m in adapted_modules(model).values():
        del m.lora_A, m.lora_B, m.lora_dropout, m.lora_scale, m.lora_groups
        for name in ("critic_A", "critic_B"):
            if hasattr(m, name):
                delattr(m, name)
        m.__class__ = nn.Linear
    return model
