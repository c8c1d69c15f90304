"""README.md says what the code does: its cheap commands run as written, and the rest name real things.

The commands are the lines of README.md's ```bash blocks (a trailing backslash joins lines, `#` starts a
comment, `&&` separates commands, leading VAR=value words are the environment).

Which commands run here: a command is *cheap* when `python` itself runs it (not torchrun, bash or sbatch)
and `--help` or `--print-config` is among its arguments. Those parse their arguments (and the recipe) and
stop before any model, data or process group exists: a few seconds on a CPU each. Every other command
trains, samples, installs or needs GPUs, a dataset or SLURM; it is checked without being run:

- the recipe it names (`--config`, or the demo's) loads with its `key=value` overrides through
  configs.load_config, the schema's own check;
- the parallel layout of a train.py or infer.py command is valid for its process count (torchrun's
  --nproc_per_node x --nnodes; 1 for python), as ParallelLayout checks it before any collective;
- every --flag it gives train.py, infer.py or a scripts/*.py is in that program's --help, and every
  launcher flag is in torchrun's --help (sbatch's are in scripts/slurm.sh's #SBATCH lines).

And for the prose: every --flag in inline code is in the --help of one of those programs (in the
"Sample" section, in infer.py's), every `section.key` in inline code is a schema key, every configs/,
scripts/ and docs/ path exists, and every timing or percentage is one BENCHMARKS.md holds.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 300
TIMEOUT_S = 120  # per command; they take a few seconds, but the CI machine may be busy
CHEAP_ARGS = ("--help", "--print-config")
RECIPE_PROGRAMS = ("train.py", "infer.py", "scripts/precompute_latents.py", "scripts/eval_demo.py")
TORCHRUN = "torchrun"
SCHEMA_SECTIONS = "run model vae text_encoder data flow train sample parallel lora logging".split()
FILE_SUFFIXES = ("py", "sh", "yaml", "md", "json", "jsonl", "png", "mp4", "gif", "npy")


@dataclass
class Command:
    text: str
    env: dict = field(default_factory=dict)
    launcher: str = ""  # python | torchrun | bash | sbatch | ...
    launcher_args: list = field(default_factory=list)
    program: str = ""  # train.py, scripts/x.py, scripts/x.sh, or "-m module"
    args: list = field(default_factory=list)

    @property
    def cheap(self) -> bool:
        return self.launcher == "python" and any(a in CHEAP_ARGS for a in self.args)

    def argv(self) -> list[str]:
        program = self.program.split() if self.program.startswith("-m ") else [self.program]
        return [sys.executable, *program, *self.args]


def parse(tokens: list[str], text: str) -> Command:
    cmd = Command(text)
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        cmd.env[key] = value
    cmd.launcher, rest = tokens[0], tokens[1:]
    if cmd.launcher == "python" and rest[:1] == ["-m"]:
        cmd.program, cmd.args = f"-m {rest[1]}", rest[2:]
        return cmd
    at = next((i for i, t in enumerate(rest) if t.endswith((".py", ".sh"))), None)
    if at is not None:
        cmd.launcher_args, cmd.program, cmd.args = rest[:at], rest[at], rest[at + 1 :]
    else:
        cmd.args = rest
    return cmd


def readme_commands() -> list[Command]:
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                end = tokens.index("&&") if "&&" in tokens else len(tokens)
                if end:
                    commands.append(parse(tokens[:end], shlex.join(tokens[:end])))
                tokens = tokens[end + 1 :]
    return commands


COMMANDS = readme_commands()


def option(args: list[str], *names: str, default=None):
    """The value of an option (`--name value` or `--name=value`)."""
    for i, a in enumerate(args):
        key, _, value = a.partition("=")
        if key in names:
            return value if value else args[i + 1]
    return default


def flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


# Each program's --help runs in a child forked from one process that has imported torch and the other
# heavy libraries once: a few seconds in all, where a process per program takes a few seconds each.
HELP_SERVER = r"""
import json, os, runpy, sys
import diffusers, torch, torch._dynamo, torch.distributed.run, torch.distributed.tensor  # noqa
results = {}
for program in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the program with --help, its stdout into the pipe, then gone
        os.close(read)
        os.dup2(write, 1)
        sys.argv, code = [program, "--help"], 1
        try:
            if program == "torchrun":
                runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(program)))  # as `python program` does
                runpy.run_path(program, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            import traceback
            traceback.print_exc(file=sys.stdout)
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as out:
        text = out.read()
    results[program] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), text]
print(json.dumps(results))
"""


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    offline = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    full_env = {**os.environ, **offline, **(env or {})}
    return subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)


def programs_with_flags() -> set[str]:
    """train.py, infer.py, scripts/*.py given flags in a command, and torchrun when it is given any."""
    needed = {"train.py", "infer.py"}
    for cmd in COMMANDS:
        if cmd.program.endswith(".py") and not cmd.program.startswith("-m ") and flags(cmd.args):
            needed.add(cmd.program)
        if cmd.launcher == TORCHRUN:
            needed.add(TORCHRUN)
    return needed


@pytest.fixture(scope="module")
def outputs() -> dict:
    """Every cheap command, as written, and the --help of every program that README gives flags to,
    two at a time (the CI machine has 2 cores)."""
    cheap = {cmd.text: cmd for cmd in COMMANDS if cmd.cheap}
    programs = sorted(programs_with_flags())
    with ThreadPoolExecutor(max_workers=2) as pool:
        helps = pool.submit(run, [sys.executable, "-c", HELP_SERVER, *programs])
        futures = {text: pool.submit(run, cmd.argv(), cmd.env) for text, cmd in cheap.items()}
        results = {text: f.result() for text, f in futures.items()}
        server = helps.result()
    assert server.returncode == 0, f"the --help runs failed:\n{server.stderr[-2000:]}"
    for program, (code, text) in json.loads(server.stdout).items():
        results[f"help:{program}"] = subprocess.CompletedProcess([program, "--help"], code, text, "")
    return results


def help_flags(outputs: dict, program: str) -> set[str]:
    result = outputs[f"help:{program}"]
    assert result.returncode == 0, f"{program} --help exited {result.returncode}:\n{result.stdout[-2000:]}"
    return set(re.findall(r"--[\w-]+", result.stdout))


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the limit is {MAX_LINES}"


def test_quick_start_commands_are_kept():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]  # its last line runs the tests
    texts = [cmd.text for cmd in COMMANDS]
    assert shlex.join(shlex.split(ci)) in texts, f".ci/run runs `{ci}`, which README.md does not show"
    assert "bash scripts/install.sh" in texts and "bash scripts/demo.sh" in texts


def test_cheap_commands_run(outputs):
    cheap = [cmd for cmd in COMMANDS if cmd.cheap]
    assert len(cheap) >= 2, "the rule picked almost no command: did the README's bash blocks change form?"
    for cmd in cheap:
        result = outputs[cmd.text]
        assert result.returncode == 0, f"`{cmd.text}` exited {result.returncode}:\n{result.stderr[-2000:]}"


def recipe_and_overrides(cmd: Command):
    """(recipe, overrides) of a command that takes a recipe, else None."""
    from configs import DEFAULT_RECIPE, split_overrides

    if cmd.program in RECIPE_PROGRAMS:
        others, overrides = split_overrides(cmd.args)
        return option(others, "--config", default=str(DEFAULT_RECIPE)), overrides
    if cmd.program == "scripts/demo.sh":
        return str(DEFAULT_RECIPE), cmd.args
    if cmd.program == "scripts/slurm.sh":
        return cmd.args[0], cmd.args[1:]
    return None


def test_recipes_and_overrides_load():
    from configs import load_config

    checked = 0
    for cmd in COMMANDS:
        found = recipe_and_overrides(cmd)
        if found is None:
            continue
        recipe, overrides = found
        assert (ROOT / recipe).is_file(), f"`{cmd.text}`: no recipe {recipe}"
        load_config(ROOT / recipe, overrides)  # raises ConfigError naming the key
        checked += 1
    assert checked >= 5


def test_parallel_layouts_are_valid():
    from configs import load_config, split_overrides
    from models.dit import DiT_models
    from parallel.layout import ParallelLayout

    for cmd in COMMANDS:
        if cmd.program not in ("train.py", "infer.py"):
            continue
        nproc = int(option(cmd.launcher_args, "--nproc_per_node", "--nproc-per-node", default=1))
        world = nproc * int(option(cmd.launcher_args, "--nnodes", default=1))
        others, overrides = split_overrides(cmd.args)
        cfg = load_config(ROOT / option(others, "--config", default="configs/demo.yaml"), overrides)
        size = DiT_models[cfg.model.size]
        if cmd.program == "train.py":
            ParallelLayout.from_config(cfg.parallel, world, size["num_heads"], "train", nproc)
        else:
            guidance = float(option(others, "--guidance", default=cfg.sample.guidance))
            heads, depth = size["num_heads"], size["depth"]
            ParallelLayout.from_config(
                cfg.parallel, world, heads, "sample", nproc, depth=depth, guided=guidance != 1
            )


def test_command_flags_exist(outputs):
    slurm = (ROOT / "scripts" / "slurm.sh").read_text()
    for cmd in COMMANDS:
        if cmd.launcher == TORCHRUN:
            missing = flags(cmd.launcher_args) - help_flags(outputs, TORCHRUN)
            assert not missing, f"`{cmd.text}`: torchrun has no {sorted(missing)}"
        if cmd.launcher == "sbatch":
            missing = {f for f in flags(cmd.launcher_args) if f not in slurm}
            assert not missing, f"`{cmd.text}`: scripts/slurm.sh sets no {sorted(missing)}"
        if cmd.program.endswith(".py") and not cmd.program.startswith("-m ") and flags(cmd.args):
            missing = flags(cmd.args) - help_flags(outputs, cmd.program)
            assert not missing, f"`{cmd.text}`: {cmd.program} has no {sorted(missing)}"


def sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", README, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_prose_flags_exist(outputs):
    known = set().union(*(help_flags(outputs, p) for p in programs_with_flags()))
    known |= set(re.findall(r"--[\w-]+", (ROOT / "scripts" / "slurm.sh").read_text()))
    infer = help_flags(outputs, "infer.py")
    for title, text in sections().items():
        allowed = infer if title == "Sample" else known
        for span in re.findall(r"`([^`\n]+)`", prose(text)):
            missing = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", span)) - allowed
            assert not missing, f"README section '{title}', `{span}`: no program documents {sorted(missing)}"


def test_recipe_keys_exist():
    from configs import SCHEMA_KEYS

    pattern = rf"\b(?:{'|'.join(SCHEMA_SECTIONS)})\.\w+(?:\.\w+)*"
    for span in re.findall(r"`([^`\n]+)`", prose(README)):
        for key in re.findall(pattern, span):
            if key.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # train.py, data.jsonl: files, not keys
                continue
            assert key in SCHEMA_KEYS, f"README names `{key}` (in `{span}`), which configs/schema.py lacks"


def test_paths_exist():
    for path in sorted(set(re.findall(r"(?<![\w/.])(?:configs|scripts|docs)/[\w.*/-]+", README))):
        path = path.rstrip("./,")
        matches = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        assert matches, f"README names {path}, which does not exist"


def test_figures_match_benchmarks():
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    for figure in re.findall(r"\d+ min \d+ s|\d+(?:\.\d+)?%", README):
        assert figure in benchmarks, f"README gives {figure}, which BENCHMARKS.md does not hold"
