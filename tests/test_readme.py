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
scripts/ and docs/ path exists, and each timing or percentage of a README table row is in the BENCHMARKS.md
row that measured it (the row that shares most of its words), with the row's other numbers.

docs/*.md, checked without running anything: every `section.key` is a schema key, every code name it
cites in backticks is the code's, every repository path,
`tests/x.py::test` and bare `x.py` exists, every --flag is declared by the argparse of the program the text
names, the commands of its ```bash blocks load their recipe and overrides, and every relative link (of
README.md and BENCHMARKS.md too) reaches a file and heading.
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
# file names that look like recipe keys (train.py, run.lock): no schema key ends so
FILE_SUFFIXES = "py sh yaml md json jsonl png mp4 gif npy lock log txt pt".split()


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
    from models.dit.transformer import size_of
    from models.families import family_named
    from parallel.compute.layout import ParallelLayout

    for cmd in COMMANDS:
        if cmd.program not in ("train.py", "infer.py"):
            continue
        nproc = int(option(cmd.launcher_args, "--nproc_per_node", "--nproc-per-node", default=1))
        world = nproc * int(option(cmd.launcher_args, "--nnodes", default=1))
        others, overrides = split_overrides(cmd.args)
        cfg = load_config(ROOT / option(others, "--config", default="configs/demo.yaml"), overrides)
        family = family_named(cfg.model.family)
        if family.loading.from_pretrained:  # its heads are its folder's (absent here): its degrees, the world
            given = {name for name in ("cfg", "ulysses", "ring", "pipefusion") if cfg.parallel[name] > 1}
            assert given <= set(family.capabilities.parallel), (
                f"`{cmd.text}`: {family.title} takes no {given}"
            )
            ParallelLayout.from_config(cfg.parallel, world, cfg.parallel.ulysses, "sample", nproc)
            continue
        size = size_of(cfg.model)
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

    for span in re.findall(r"`([^`\n]+)`", prose(README)):
        for key in recipe_keys(span):
            assert key in SCHEMA_KEYS, f"README names `{key}` (in `{span}`), which configs/schema.py lacks"


def test_paths_exist():
    for path in sorted(set(re.findall(r"(?<![\w/.])(?:configs|scripts|docs)/[\w.*/-]+", README))):
        path = path.rstrip("./,")
        matches = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        assert matches, f"README names {path}, which does not exist"


FIGURE = r"\d+ min \d+ s|\d+(?:\.\d+)?%"


def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table's rows of cells, header first (separator rows left out)."""
    found = []
    for block in re.findall(r"(?:^\|.*\n?)+", text, re.M):
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()]
        found.append([row for row in rows if not all(set(c) <= set("-: ") for c in row)])
    return found


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]


def measuring_row(label: str, rows: list[list[str]]) -> list[str]:
    """The BENCHMARKS.md row that measured README's row `label`: the one whose first cell (what was
    measured) shares the most of the label's words; a tie or a weak match is an error."""
    wanted = words(label)
    scored = sorted((len(wanted & words(row[0])) / len(wanted), i) for i, row in enumerate(rows))
    (second, _), (best, at) = scored[-2], scored[-1]
    assert best >= 0.5 and best > second, f"README's row '{label}': no BENCHMARKS.md row measures it"
    return rows[at]


def test_figures_match_benchmarks():
    """Each figure in a README table row is in the BENCHMARKS.md row that measured it, in the same order,
    with the row's other numbers (clip and prompt counts); its target is the one that row states."""
    rows = [row for table in tables((ROOT / "BENCHMARKS.md").read_text()) for row in table]
    checked = 0
    for header, *body in tables(README):
        for row in body:
            figures = re.findall(FIGURE, " | ".join(row[1:]))
            if not figures:
                continue
            measured = " | ".join(measuring_row(row[0], rows))
            theirs = iter(re.findall(FIGURE, measured))
            assert all(f in theirs for f in figures), f"README's {row}: not the figures of | {measured}"
            missing = set(numbers(" ".join(row))) - set(numbers(measured))
            assert not missing, f"README's {row}: {sorted(missing)} not in BENCHMARKS' | {measured}"
            target = row[header.index("target")] if "target" in header else ""
            stated = re.search(r"targets? ([^)|]*)", measured)
            assert not numbers(target) or (stated and numbers(stated[1]) == numbers(target)), (
                f"README's {row}: target {target!r}, BENCHMARKS' | {measured}"
            )
            checked += 1
    assert checked >= 3, "README's figure table changed form: the rule checks almost nothing"
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    outside = re.sub(r"^\|.*$", "", README, flags=re.M)  # figures in prose: BENCHMARKS.md holds them
    for figure in re.findall(FIGURE, outside):
        assert figure in benchmarks, f"README gives {figure}, which BENCHMARKS.md does not hold"


# --- docs/*.md name real keys, files, tests, flags and links ----------------------------------------

DOCS = sorted((ROOT / "docs").glob("*.md"))
REPO_DIRS = "configs|scripts|docs|tests|models|parallel|data"
PROGRAMS = [ROOT / "train.py", ROOT / "infer.py", *sorted((ROOT / "scripts").glob("*.py"))]


def bash_lines(text: str) -> list[str]:
    """The commands of a Markdown text's ```bash blocks, one a line (a trailing backslash joins lines)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def doc_spans(text: str):
    """(span, paragraph) for each inline code span of the prose, and each line of a ```bash block."""
    for para in re.split(r"\n\s*\n", prose(text)):
        for span in re.findall(r"`([^`\n]+)`", para):
            yield span, para
    for line in bash_lines(text):
        yield line, line


def test_doc_commands_load():
    """The recipe and key=value overrides of each command in a doc's ```bash block load through
    configs.load_config, the schema's own check (keys, types and the recipe's rules)."""
    from configs import load_config

    checked = 0
    for doc in DOCS:
        for line in bash_lines(doc.read_text()):
            found = recipe_and_overrides(parse(shlex.split(line, comments=True), line))
            if found is not None:
                load_config(ROOT / found[0], found[1])
                checked += 1
    assert checked >= 2, "the docs' commands changed form: the rule checks almost nothing"


def recipe_keys(span: str) -> list[str]:
    """The `section.key` names in a span, without file names (train.py) and module paths (data.media.x)."""
    from configs import SCHEMA_KEYS

    sections = sorted({key.split(".")[0] for key in SCHEMA_KEYS})
    found = re.findall(rf"(?<![\w./-])(?:{'|'.join(sections)})\.\w+(?:\.\w+)*", span)
    return [key for key in found if key.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not is_module_path(key)]


def is_module_path(name: str) -> bool:
    """Whether a dotted name starts with one of the repository's modules (data.synthetic.read_clip)."""
    parts = name.split(".")
    return any((ROOT / "/".join(parts[:i])).with_suffix(".py").is_file() for i in range(2, len(parts) + 1))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_recipe_keys_exist(doc):
    from configs import SCHEMA_KEYS

    for span, _ in doc_spans(doc.read_text()):
        for key in recipe_keys(span):
            assert key in SCHEMA_KEYS, f"{doc.name} names `{key}` (in `{span}`): configs/schema.py lacks it"


def test_recipe_keys_knows_every_section():
    """recipe_keys knows every schema section (image_encoder too), and leaves files and modules out."""
    from configs import SCHEMA_KEYS

    span = "image_encoder.pretrained, lora.rank=4 train.py run.lock data.synthetic.read_clip"
    assert recipe_keys(span) == ["image_encoder.pretrained", "lora.rank"]
    assert not {key.rsplit(".", 1)[-1] for key in SCHEMA_KEYS} & set(FILE_SUFFIXES)  # no key is left out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_paths_and_tests_exist(doc):
    """Every repository path a doc names exists (a `tests/x.py::name` has that test), and so does every
    bare `x.py` / `x.sh` it names in code."""
    text = doc.read_text()
    for path in sorted(set(re.findall(rf"(?<![\w/.-])(?:{REPO_DIRS})/[\w.*/-]*(?:::\w+)?", text))):
        path, _, test = path.rstrip("./,").partition("::")
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        assert found, f"{doc.name} names {path}, which does not exist"
        if test:
            assert re.search(rf"^def {test}\(", found[0].read_text(), re.M), f"{doc.name}: no {path}::{test}"
    files = {p.name for p in ROOT.rglob("*.[ps][yh]") if ".git" not in p.parts}
    for span, _ in doc_spans(text):
        for name in re.findall(r"(?<![\w/.-])\w+\.(?:py|sh)\b", span):
            assert name in files, f"{doc.name} names {name} (in `{span}`), which no folder holds"


def argparse_flags(program: Path) -> set[str]:
    """The --flags a program's argparse declares (read from its source, and from the modules of its own
    folder that it imports: scripts/benchlib.py)."""
    import ast

    found = {"--help"}
    for node in ast.walk(ast.parse(program.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            found |= {name for name in names if str(name).startswith("--")}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in filter(None, modules):
                local = program.parent / f"{module}.py"
                if local.is_file() and local != program:
                    found |= argparse_flags(local)
    return found


def programs_named(text: str) -> list[Path]:
    return [p for p in PROGRAMS if re.search(rf"(?<![\w.-]){re.escape(p.name)}\b", text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_flags_exist(doc):
    """A --flag in a doc's code is declared by the program the same span names, else by one the paragraph
    names, else by one of train.py, infer.py and scripts/*.py."""
    declared = {p: argparse_flags(p) for p in PROGRAMS}
    for span, para in doc_spans(doc.read_text()):
        given = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", span))
        if span.lstrip().startswith(TORCHRUN):  # the launcher's own flags, before its program
            launcher = re.split(r"\S+\.(?:py|sh)\b", span, maxsplit=1)[0]
            given -= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", launcher))
        if not given:
            continue
        programs = programs_named(span) or programs_named(para) or PROGRAMS
        missing = given - set().union(*(declared[p] for p in programs))
        names = [p.name for p in programs] if len(programs) < len(PROGRAMS) else "any program"
        assert not missing, f"{doc.name}, `{span}`: {sorted(missing)} not declared by {names}"


# Backticked names that are not tessera's code: fault specs composed from parallel/checkpoints/checkpoint.py's
# FAULT_POINTS, and diffusers' own API that a doc tells users to call
NOT_OURS = {"save_before_shards", "save_after_shards", "save_after_rename", "fuse_lora", "save_lora_weights"}
CODE_SUFFIXES = tuple(FILE_SUFFIXES) + ("safetensors", "distcp", "pth")


@pytest.mark.parametrize(
    "doc", [ROOT / "README.md", *(p for p in DOCS if p.name != "benchmarks_history.md")], ids=lambda p: p.name
)
def test_doc_code_names_exist(doc):
    """Every code name a doc cites in backticks is in the code (its .py and .sh files, tests aside): each
    part of a dotted name (`Family.read_lora`, `models.sampler.generate_images`), a CamelCase or UPPER_CASE
    name, a snake_case one, a `call()`; `section.key` recipe keys and file names are other tests'. A renamed
    function leaves no stale name behind. benchmarks_history.md is a record of its day."""
    from configs import SCHEMA_KEYS

    files = [
        p
        for p in (*ROOT.rglob("*.py"), *ROOT.rglob("*.sh"))
        if p.relative_to(ROOT).parts[0] not in ("tests", ".git")
    ]
    source = "\n".join(p.read_text() for p in files)
    sections = {key.split(".")[0] for key in SCHEMA_KEYS}
    code = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z]\w*)?|[A-Z][A-Z0-9_]{3,}|[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
    missing = set()
    for token in re.findall(r"`([A-Za-z_][\w.]*?)(?:\(\))?`", doc.read_text()):
        parts = token.split(".")
        if parts[0] in sections or parts[-1] in CODE_SUFFIXES:
            continue
        missing |= {p for p in parts if code.fullmatch(p) and not re.search(rf"\b{re.escape(p)}\b", source)}
    assert not missing - NOT_OURS, (
        f"{doc.name} cites names the code does not have: {sorted(missing - NOT_OURS)}"
    )


def test_argparse_flags_reads_declarations():
    flags = argparse_flags(ROOT / "infer.py")
    assert {"--config", "--lora", "--last-image", "--no-ema"} <= flags and "--pipeline" not in flags
    assert "--pipeline" in argparse_flags(ROOT / "scripts" / "export.py")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    titles = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS], ids=lambda p: p.name)
def test_doc_links_resolve(doc):
    """Every relative link of README.md, BENCHMARKS.md and docs/*.md reaches a file, and its #anchor a
    heading there."""
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc.read_text())):
        if re.match(r"\w+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name} links {target}, which does not exist"
        if anchor:
            assert anchor in anchors(linked.read_text()), f"{doc.name} links {target}: no such heading"


def typed(text: str):
    """A recipe value as a doc writes it (1e-4, null, true, runs/default)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"null": None, "true": True, "false": False}.get(text, text)


def documented_defaults(keys: list[str], cell: str) -> list:
    """The defaults a `key | default` table cell gives its keys: one per key, comma-separated; a single
    key's list default as its code spans (lora.targets). A parenthesis is a comment: null (= rank)."""
    cell = re.sub(r"\s*\(.*?\)", "", cell)
    if len(keys) > 1:
        return [typed(value.strip()) for value in cell.split(",")]
    spans = re.findall(r"`([^`]+)`", cell)
    return [spans if len(spans) > 1 else typed(spans[0] if spans else cell)]


def documented_keys():
    """(doc name, key, default it gives) of every `key | default | meaning` table of README.md, docs/*.md."""
    for doc in [ROOT / "README.md", *DOCS]:
        for header, *body in tables(doc.read_text()):
            for row in body if header[:2] == ["key", "default"] else []:
                keys = re.findall(r"`([^`]+)`", row[0])
                given = documented_defaults(keys, row[1])
                assert len(given) == len(keys), f"{doc.name}: {row[:2]} gives not one default per key"
                yield from ((doc.name, key, value) for key, value in zip(keys, given))


def test_documented_defaults_are_the_schemas():
    from omegaconf import OmegaConf

    from configs.schema import TesseraConfig

    schema = OmegaConf.to_container(OmegaConf.structured(TesseraConfig))
    checked = list(documented_keys())
    for name, key, value in checked:
        default = schema
        for part in key.split("."):
            default = default[part]
        assert value == default, f"{name} gives {key} the default {value!r}; the schema has {default!r}"
    assert len(checked) >= 20, "the docs' key tables changed form: the rule checks almost nothing"


def test_named_test_runs_select_tests():
    """Each `pytest tests/x.py[::test] [-k word]` of BENCHMARKS.md, README.md and docs/*.md selects a test:
    a figure's test that was renamed or removed would leave the figure claiming what nothing runs."""
    texts = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *DOCS]
    runs = [(doc.name, m) for doc in texts for m in re.finditer(PYTEST_RUN, doc.read_text())]
    for name, run in runs:
        path = ROOT / run["path"]
        assert path.is_file(), f"{name}: `{run[0]}`, no {run['path']}"
        tests = re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)
        wanted = run["test"] or run["k"]
        assert not wanted or any(wanted in test for test in tests), f"{name}: `{run[0]}` selects no test"
    assert len(runs) >= 10, "the pytest commands changed form: the rule checks almost nothing"


PYTEST_RUN = r"pytest (?:-\w+ )*(?P<path>tests/[\w/]+\.py)(?:::(?P<test>\w+))?(?: -k (?P<k>\w+))?"


def test_multi_node_launches_quiet_torchruns_own_agent():
    """Issue 32, item 11: tessera's processes set TORCH_CPP_LOG_LEVEL for themselves, but torchrun's agent
    is not one of them; when the store's node is lost it may print ~30 C++ frames per failed store call
    before the ranks' `error:` line. The README's launch line and scripts/slurm.sh set it for the agent
    (tests/test_failures.py's store-host-lost scenario runs that way and finds no frame)."""
    block = sections()["Several nodes and SLURM"].split("```")[1]  # the commands
    launches = [line for line in block.splitlines() if "torchrun" in line]
    assert launches and all(line.startswith("TORCH_CPP_LOG_LEVEL=ERROR torchrun ") for line in launches)
    slurm = (ROOT / "scripts" / "slurm.sh").read_text()
    assert "export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}" in slurm
    assert slurm.index("TORCH_CPP_LOG_LEVEL") < slurm.index("torch.distributed.run")  # before the agent
