"""The parallel layout: the one place that knows the degrees, validated before any process group exists.

Degrees: data parallel `dp` (FSDP2), classifier-free-guidance parallel `cfg` (sampling), PipeFusion
stages `pipefusion` (sampling), Ulysses `ulysses` and Ring `ring` sequence parallelism. Their product
must equal the world size. A refusal names the broken rule and lists the layouts that would work
for this world size and model, so a bad GPU count fails in seconds instead of hanging in a collective.
"""

import itertools
from dataclasses import dataclass

DEGREES = ("dp", "cfg", "pipefusion", "ulysses", "ring")
# Degrees above 1 that this version can run. Sequence parallelism and PipeFusion arrive with their
# own issues; until then a request for them is refused up front rather than ignored.
IMPLEMENTED = {"dp"}


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ulysses: int = 1
    ring: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ulysses * self.ring

    def dp_rank(self, rank: int) -> int:
        """dp is the outermost axis: consecutive blocks of world_size / dp ranks share a dp rank."""
        return rank // (self.world_size // self.dp)

    def describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in DEGREES)

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int, num_heads: int, mode: str = "train") -> "ParallelLayout":
        """Validate the recipe's `parallel` section against the world size; dp=-1 takes what is left."""
        degrees = {name: int(getattr(parallel_cfg, name)) for name in DEGREES}
        for name, value in degrees.items():
            if value < 1 and not (name == "dp" and value == -1):
                raise LayoutError(f"parallel.{name}={value}: every degree must be at least 1 (dp may be -1: fill)")
        others = degrees["cfg"] * degrees["pipefusion"] * degrees["ulysses"] * degrees["ring"]
        if degrees["dp"] == -1:
            if world_size % others:
                raise LayoutError(
                    f"{world_size} processes cannot be split as dp x cfg={degrees['cfg']} x pipefusion="
                    f"{degrees['pipefusion']} x ulysses={degrees['ulysses']} x ring={degrees['ring']}: {world_size} "
                    f"is not a multiple of {others}. {valid_layouts_message(world_size, num_heads, mode)}")
            degrees["dp"] = world_size // others
        layout = cls(**degrees)
        layout.check(world_size, num_heads, mode)
        return layout

    def check(self, world_size: int, num_heads: int, mode: str) -> None:
        problems = []
        if self.world_size != world_size:
            problems.append(f"dp={self.dp} x cfg={self.cfg} x pipefusion={self.pipefusion} x ulysses={self.ulysses} "
                            f"x ring={self.ring} = {self.world_size}, but there are {world_size} processes")
        problems += _rule_violations(self, num_heads, mode)
        if problems:
            raise LayoutError(f"invalid parallel layout: {'; '.join(problems)}. "
                              f"{valid_layouts_message(world_size, num_heads, mode)}")


def _rule_violations(layout: ParallelLayout, num_heads: int, mode: str) -> list[str]:
    problems = []
    for name in DEGREES:
        if getattr(layout, name) > 1 and name not in IMPLEMENTED:
            problems.append(f"parallel.{name}={getattr(layout, name)} is not implemented in this version of tessera")
    if num_heads % layout.ulysses:
        problems.append(f"the model's {num_heads} attention heads do not divide by ulysses={layout.ulysses}")
    if layout.cfg not in (1, 2):
        problems.append(f"cfg={layout.cfg}: guidance has two branches, so cfg is 1 or 2")
    if mode == "train" and (layout.cfg > 1 or layout.pipefusion > 1):
        problems.append("cfg and pipefusion parallelism are for sampling only; set them to 1 for training")
    return problems


def valid_layouts(world_size: int, num_heads: int, mode: str = "train") -> list[ParallelLayout]:
    layouts = []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for dp, cfg, pipefusion, ulysses in itertools.product(divisors, repeat=4):
        rest = dp * cfg * pipefusion * ulysses
        if world_size % rest:
            continue
        layout = ParallelLayout(dp, cfg, pipefusion, ulysses, world_size // rest)
        if not _rule_violations(layout, num_heads, mode):
            layouts.append(layout)
    return layouts


def valid_layouts_message(world_size: int, num_heads: int, mode: str) -> str:
    options = valid_layouts(world_size, num_heads, mode)
    listed = "; ".join(f"({o.describe()})" for o in options) or "none"
    return f"Valid layouts for {world_size} processes and {num_heads} heads: {listed}."
