"""The parallel layout: the one place that knows the degrees, validated before any process group exists.

Degrees: data parallel `dp` (FSDP2), classifier-free-guidance parallel `cfg` (sampling), PipeFusion
stages `pipefusion` (sampling), Ulysses `ulysses` and Ring `ring` sequence parallelism. Their product
must equal the world size. A refusal names the broken rule and lists the layouts that would work
for this world size and model, so a bad GPU count fails in seconds instead of hanging in a collective.
"""

import itertools
from dataclasses import dataclass

DEGREES = ("dp", "cfg", "pipefusion", "ulysses", "ring")
# The order of the axes in rank space, outermost first: consecutive ranks share a ulysses group (its
# all-to-alls want the fastest links, inside a node), ring groups stride across them, dp is outermost.
RANK_ORDER = ("dp", "cfg", "pipefusion", "ring", "ulysses")


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

    def replica_share(self, rank: int, count: int) -> range:
        """The indices of `count` prompts that `rank`'s data-parallel replica samples (one in dp)."""
        return range(self.dp_rank(rank), count, self.dp)

    def replica_leader(self, rank: int) -> int:
        """The first rank of `rank`'s data-parallel replica (the ranks that work on the same samples)."""
        return self.dp_rank(rank) * (self.world_size // self.dp)

    @property
    def sequence_parallel(self) -> int:
        """Processes that share one sample's tokens (ulysses x ring)."""
        return self.ulysses * self.ring

    def describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in DEGREES)

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (e.g. groups("ulysses", "ring") are the
        sequence-parallel groups). The one rank generator: every process builds every group from it, in
        the same order, so the groups always agree."""
        unknown = [a for a in axes if a not in DEGREES]
        if unknown:
            raise ValueError(f"unknown parallel axes {unknown}; axes are {', '.join(DEGREES)}")
        sizes = [getattr(self, a) for a in RANK_ORDER]
        kept = [a for a in RANK_ORDER if a not in axes]
        varied = [
            a for a in RANK_ORDER if a in axes
        ]  # in rank order, so each group lists its ranks ascending
        groups = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in kept)):
            coordinate = dict(zip(kept, fixed))
            group = []
            for moving in itertools.product(*(range(getattr(self, a)) for a in varied)):
                coordinate.update(zip(varied, moving))
                rank = 0
                for axis, size in zip(RANK_ORDER, sizes):
                    rank = rank * size + coordinate[axis]
                group.append(rank)
            groups.append(group)
        return groups

    def group_of(self, rank: int, *axes: str) -> list[int]:
        return next(g for g in self.groups(*axes) if rank in g)

    @classmethod
    def from_config(
        cls,
        parallel_cfg,
        world_size: int,
        num_heads: int,
        mode: str = "train",
        local_world_size: int | None = None,
        depth: int | None = None,
        guided: bool = True,
        slow_links: bool = False,
        tokens: int | None = None,
        takes=None,
    ) -> "ParallelLayout":
        """Validate the recipe's `parallel` section against the world size; dp=-1 takes what is left.
        With parallel.auto=true the degrees are chosen here (see `auto_layout`; `takes(layout)`: whether
        the model runs under a layout). For sampling, `depth` (the model's blocks) bounds pipefusion and
        `guided` (guidance != 1) allows cfg=2."""
        limits = dict(depth=depth, guided=guided)
        if getattr(parallel_cfg, "auto", False):
            given = [
                f"parallel.{name}={getattr(parallel_cfg, name)}"
                for name in DEGREES[1:]
                if int(getattr(parallel_cfg, name)) != 1
            ]
            if given:  # never silently replaced by auto's choice
                raise LayoutError(
                    f"parallel.auto=true chooses the degrees itself, but {' '.join(given)} is set: "
                    f"add parallel.auto=false to use your degrees, or drop them"
                )
            dp = int(parallel_cfg.dp)
            if dp != -1 and (dp < 1 or world_size % dp):
                raise LayoutError(
                    f"parallel.auto=true with parallel.dp={dp}: dp must divide the {world_size} "
                    f"processes (or be -1). {valid_layouts_message(world_size, num_heads, mode, **limits)}"
                )
            return auto_layout(
                world_size,
                num_heads,
                local_world_size or world_size,
                dp=1 if dp == -1 else dp,
                mode=mode,
                slow_links=slow_links,
                tokens=tokens,
                takes=takes,
                **limits,
            )
        degrees = {name: int(getattr(parallel_cfg, name)) for name in DEGREES}
        for name, value in degrees.items():
            if value < 1 and not (name == "dp" and value == -1):
                raise LayoutError(
                    f"parallel.{name}={value}: every degree must be at least 1 (dp may be -1: fill)"
                )
        others = degrees["cfg"] * degrees["pipefusion"] * degrees["ulysses"] * degrees["ring"]
        if degrees["dp"] == -1:
            if world_size % others:
                raise LayoutError(
                    f"{world_size} processes cannot be split as dp x cfg={degrees['cfg']} x pipefusion="
                    f"{degrees['pipefusion']} x ulysses={degrees['ulysses']} x ring={degrees['ring']}: "
                    f"{world_size} is not a multiple of {others}. "
                    f"{valid_layouts_message(world_size, num_heads, mode, **limits)}"
                )
            degrees["dp"] = world_size // others
        layout = cls(**degrees)
        layout.check(world_size, num_heads, mode, **limits)
        return layout

    def check(
        self, world_size: int, num_heads: int, mode: str, depth: int | None = None, guided: bool = True
    ) -> None:
        problems = []
        if self.world_size != world_size:
            problems.append(
                f"dp={self.dp} x cfg={self.cfg} x pipefusion={self.pipefusion} x ulysses={self.ulysses} "
                f"x ring={self.ring} = {self.world_size}, but there are {world_size} processes"
            )
        problems += _rule_violations(self, num_heads, mode, depth, guided)
        if problems:
            raise LayoutError(
                f"invalid parallel layout: {'; '.join(problems)}. "
                f"{valid_layouts_message(world_size, num_heads, mode, depth, guided)}"
            )

    def check_patches(self, parallel_cfg, grid) -> int:
        """PipeFusion's patch count for a token grid (t, h, w), or a LayoutError: at least one patch per
        stage (a stage with nothing to do each step would idle the pipeline), at most one per patch row."""
        if self.pipefusion == 1:
            return 1
        patches = parallel_cfg.pipefusion_patches or self.pipefusion
        rows = grid[0] * grid[1]
        if self.pipefusion > rows:
            raise LayoutError(
                f"pipefusion={self.pipefusion} needs at least {self.pipefusion} patches, but the latent "
                f"has only {rows} rows of patches ({grid[0]} x {grid[1]}, each {grid[2]} tokens wide): "
                f"use pipefusion <= {rows}, or more frames or a larger height"
            )
        if patches < self.pipefusion:
            raise LayoutError(
                f"parallel.pipefusion_patches={patches} is fewer than the pipefusion={self.pipefusion} "
                f"stages: use {self.pipefusion} to {rows} patches (default: one per stage)"
            )
        if patches > rows:
            raise LayoutError(
                f"parallel.pipefusion_patches={patches}: the latent has only {rows} rows of patches "
                f"({grid[0]} x {grid[1]}, each {grid[2]} tokens wide); use {self.pipefusion} to {rows}"
            )
        return patches  # parallel.pipefusion_warmup >= 0 is checked with the recipe (configs)


def _rule_violations(
    layout: ParallelLayout, num_heads: int, mode: str, depth: int | None = None, guided: bool = True
) -> list[str]:
    problems = []
    if num_heads % layout.ulysses:
        problems.append(f"the model's {num_heads} attention heads do not divide by ulysses={layout.ulysses}")
    if layout.cfg not in (1, 2):
        problems.append(f"cfg={layout.cfg}: guidance has two branches, so cfg is 1 or 2")
    if mode == "train" and (layout.cfg > 1 or layout.pipefusion > 1):
        problems.append("cfg and pipefusion parallelism are for sampling only; set them to 1 for training")
    if mode == "sample" and depth is not None and layout.pipefusion > depth:
        problems.append(
            f"pipefusion={layout.pipefusion} stages for the model's {depth} blocks: at most one "
            "stage per block"
        )
    if mode == "sample" and layout.cfg > 1 and not guided:
        problems.append(
            "cfg=2 runs the conditional and unconditional branches side by side, but guidance is 1 "
            "(no unconditional branch): use cfg=1, or a guidance scale other than 1"
        )
    return problems


# Below this many tokens ring's transfers on PCIe (25 GB/s) outlast the attention they overlap, and
# pipefusion x ring beats ring in the latency model (Wan2.1-14B dims on 8 GPUs: best at 4k tokens, 3%
# behind ring at 8k; docs/benchmarks_history.md, "Sampling across GPUs").
PIPEFUSION_TOKENS_ON_PCIE = 6144


def auto_layout(
    world_size: int,
    num_heads: int,
    local_world_size: int,
    dp: int = 1,
    mode: str = "train",
    depth: int | None = None,
    guided: bool = True,
    slow_links: bool = False,
    tokens: int | None = None,
    takes=None,
) -> ParallelLayout:
    """The latency model's layout (preferred_layout) if the model runs under it (`takes(layout)`, e.g. a
    family that splits under ulysses or ring but not both; None: every layout), else the first it runs
    under of the valid layouts with a multiple of `dp` (ulysses inside a node): the fewest replicas first
    (one sample's work spread widest; on slow links none with ulysses first), then cfg, ulysses, ring and
    pipefusion, as the latency model prefers them; the processes as replicas alone if none."""
    preferred = preferred_layout(world_size, num_heads, local_world_size, dp, mode, depth, guided, slow_links,
                                 tokens)  # fmt: skip
    if takes is None or takes(preferred):
        return preferred
    ranked = sorted(  # a ulysses group inside a node, as the latency model keeps it
        (
            o
            for o in valid_layouts(world_size, num_heads, mode, depth, guided)
            if o.dp % dp == 0 and local_world_size % o.ulysses == 0
        ),  # fmt: skip
        key=lambda o: (slow_links and o.ulysses > 1, o.dp, -o.cfg, -o.ulysses, -o.ring, -o.pipefusion),
    )
    return next((o for o in ranked if takes(o)), ParallelLayout(dp=world_size))


def preferred_layout(
    world_size: int,
    num_heads: int,
    local_world_size: int,
    dp: int = 1,
    mode: str = "train",
    depth: int | None = None,
    guided: bool = True,
    slow_links: bool = False,
    tokens: int | None = None,
) -> ParallelLayout:
    """The processes left after `dp`, as the sampling latency model (scripts/bench_sampling.py,
    docs/benchmarks_history.md) ranks them:
    - sampling with guidance: cfg=2 first (one small all-gather per step; every fastest layout has it);
    - ulysses inside a node, as large as the heads and the node allow, on fast links (NVLink); none on
      PCIe (`slow_links`), where its all-to-alls are the slowest choice;
    - inside a node, ring for the rest; on PCIe with a short sequence (an image: fewer than
      PIPEFUSION_TOKENS_ON_PCIE tokens, where ring's transfers no longer hide behind its attention),
      pipefusion and ring share it (pipefusion the smaller, so its warm-up steps, which run the stages
      one after another, stay cheap);
    - across nodes, pipefusion for sampling (O(tokens x hidden) per step, not per layer), ring for training.
    Training gets only ulysses and ring."""
    rest = world_size // dp
    sample = mode == "sample"
    cfg = 2 if sample and guided and rest % 2 == 0 else 1
    rest //= cfg
    divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    # d divides the node size, so no ulysses group straddles two nodes.
    ulysses = (
        1
        if sample and slow_links
        else max(d for d in divisors(rest) if num_heads % d == 0 and local_world_size % d == 0)
    )
    rest //= ulysses
    if not sample:
        return ParallelLayout(dp=dp, ulysses=ulysses, ring=rest)
    in_node = max(
        d for d in divisors(rest) if (local_world_size // ulysses) % d == 0
    )  # ulysses divides the node
    across = rest // in_node  # the part of the rest that crosses nodes
    short = tokens is None or tokens < PIPEFUSION_TOKENS_ON_PCIE
    inner_pipefusion = max(d for d in divisors(in_node) if d * d <= in_node) if slow_links and short else 1
    fits = [
        d
        for d in divisors(rest)
        if d <= (depth or rest) and d % across == 0 and d <= across * inner_pipefusion
    ]
    pipefusion = max(fits) if fits else max(d for d in divisors(rest) if d <= (depth or rest))
    return ParallelLayout(dp=dp, cfg=cfg, pipefusion=pipefusion, ulysses=ulysses, ring=rest // pipefusion)


def valid_layouts(
    world_size: int, num_heads: int, mode: str = "train", depth: int | None = None, guided: bool = True
) -> list[ParallelLayout]:
    layouts = []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for dp, cfg, pipefusion, ulysses in itertools.product(divisors, repeat=4):
        rest = dp * cfg * pipefusion * ulysses
        if world_size % rest:
            continue
        layout = ParallelLayout(dp, cfg, pipefusion, ulysses, world_size // rest)
        if not _rule_violations(layout, num_heads, mode, depth, guided):
            layouts.append(layout)
    # Most data parallelism first, then the cheapest sequence parallelism (ulysses before ring).
    return sorted(layouts, key=lambda o: (-o.dp, -o.cfg, -o.pipefusion, -o.ulysses))


def valid_layouts_message(
    world_size: int, num_heads: int, mode: str, depth: int | None = None, guided: bool = True, limit: int = 16
) -> str:
    options = valid_layouts(world_size, num_heads, mode, depth, guided)
    listed = ", ".join(
        "(" + ",".join(str(getattr(o, name)) for name in DEGREES) + ")" for o in options[:limit]
    )
    if len(options) > limit:
        listed += f" and {len(options) - limit} more"
    return (
        f"{world_size} processes, {num_heads} heads: valid ({', '.join(DEGREES)}) = {listed or 'none'}"
        f"{'' if mode == 'train' else ' (for sampling)'}."
    )
