"""The import layers, read from every module's imports (ast): scripts -> train.py/infer.py -> data ->
parallel -> configs -> models. An arrow may point down or stay in its layer, never up; models/ never
touches torch.distributed; and no modules import each other in a circle, counting the imports inside
functions too (a circle of lazy imports is a circle all the same: issue 51 found one hidden so). A lazy
(function-level) import that points up is allowed only if ALLOWED_UP names it, with its reason."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"scripts": 6, "train": 5, "infer": 5, "data": 4, "parallel": 3, "configs": 2, "models": 1}
# (importing file, imported module): why the arrow may point up. Keep this short.
ALLOWED_UP: dict[tuple[str, str], str] = {}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("tests", "build") or relative.parts[0].startswith("."):
            continue
        yield relative, ast.parse(path.read_text(), filename=str(relative))


def _layer(name: str) -> int | None:
    return LAYERS.get(name.split(".")[0])


def _imports(tree):
    """(imported module, lazy) for every import of the file; lazy: inside a function."""
    lazy_nodes = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in lazy_nodes
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            yield node.module, id(node) in lazy_nodes
            for name in names:  # `from parallel.compute import comm` imports parallel.compute.comm
                if (ROOT / (name.replace(".", "/") + ".py")).is_file():
                    yield name, id(node) in lazy_nodes


def test_arrows_only_point_down():
    up = []
    for relative, tree in _modules():
        mine = _layer(relative.parts[0] if len(relative.parts) > 1 else relative.stem)
        if mine is None:
            continue
        for module, lazy in _imports(tree):
            theirs = _layer(module)
            if theirs is None or theirs <= mine:
                continue
            if lazy and (str(relative), module) in ALLOWED_UP:
                continue
            up.append(f"{relative} imports {module} ({'lazily' if lazy else 'at the top'})")
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_models_are_single_device():
    found = []
    for relative, tree in _modules():
        if relative.parts[0] != "models":
            continue
        found += [f"{relative} imports {m}" for m, _ in _imports(tree) if m.startswith("torch.distributed")]
        found += [  # torch.distributed.<x> reached without an import of its own
            f"{relative}:{node.lineno} uses torch.distributed"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "distributed"
        ]
    assert not found, "\n".join(found)


def test_no_circles_between_modules():
    graph = {}
    for relative, tree in _modules():
        name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m, _ in _imports(tree) if _layer(m) is not None}  # lazy ones too
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "modules that import each other:\n" + "\n".join(circles)


def test_the_check_sees_an_upward_arrow():
    """The parser itself: an import of parallel from models is found (and a lazy one too)."""
    source = "import torch\nfrom parallel.compute import comm\ndef f():\n    from data.media import x\n"
    tree = ast.parse(source)
    found = dict(_imports(tree))
    assert found["parallel.compute"] is False and found["parallel.compute.comm"] is False
    assert found["data.media"] is True


def test_files_stay_small_and_say_what_they_are_for():
    """House rules (issue 20): no file in parallel/ over 450 lines; every module's docstring says what
    the file is for in at most 12 lines (the longer notes live in docs/internals.md)."""
    problems = []
    for relative, tree in _modules():
        lines = len((ROOT / relative).read_text().splitlines())
        if relative.parts[0] == "parallel" and lines > 450:
            problems.append(f"{relative}: {lines} lines (at most 450)")
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.strip("\n").splitlines()) > 12:
            problems.append(f"{relative}: a {len(doc.strip().splitlines())}-line docstring (at most 12)")
    assert not problems, "\n".join(problems)


def test_functions_read_at_once():
    """House rule (issue 33): no function or method over 80 lines in models/, parallel/, data/, configs/,
    train.py or infer.py (a longer one is split where its parts have names)."""
    long = []
    for relative, tree in _modules():
        if relative.parts[0] not in ("models", "parallel", "data", "configs", "train.py", "infer.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{relative}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_a_dit_command_imports_no_other_family():
    """Every family is imported when first asked for: importing all of them cost each command about 4 s
    (LTX-2's brings diffusers' autoencoders), paid by every start-up of the demo. Their keys.py modules
    (the schema's family keys) are read, and must stay light: their packages' __init__ import nothing."""
    code = (
        "import sys, tempfile; from models.families import FAMILIES, family_named; family_named('dit'); "
        # a tessera run as model.pretrained (demo_lora.sh) claims no family
        "from configs import load_config; "
        "load_config('configs/demo.yaml', ['model.pretrained=' + tempfile.mkdtemp()]); "
        "assert 'ltx2' in FAMILIES and len(FAMILIES) == 9; "
        "print(sorted(m for m in sys.modules if m.split('.')[1:2] in "
        "(['ltx2'], ['qwen_image'], ['sana'], ['hunyuan_video15'], ['z_image'], ['flux2']) "
        "and m.split('.')[2:] not in ([], ['keys'])))"  # their recipe keys alone (models/recipe_keys.py)
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
