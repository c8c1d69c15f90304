"""A checkpoint from elsewhere never runs code, an expert's checkpoint stays on its expert's timesteps, and
a garbage `latest` pointer names the checkpoint to resume from. In one process, on the tiny recipe.

The crafted files are what an attacker would share: a .metadata, or a non-tensor item of a .distcp, whose
pickle calls `exec` to create a marker file, with checksums.json updated to match. Unpickled by DCP's own
reader and planner (a plain pickle.load, torch.load(weights_only=False)), the marker appears."""

import io
import json
import pickle
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist

import infer
import train
from parallel.checkpoints import checkpoint, checkpoint_files, checkpoint_reading
from tests.conftest import TINY, ranks, run_main

COMMON = ["--config", str(TINY), "train.max_steps=2", "train.checkpoint_every=2"]  # one checkpoint: step_2
ITEM = "ema.final_layer.linear.bias"  # a weight that every load reads: training, sampling, model.pretrained


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert run_main(train, COMMON + [f"run.output_dir={run_dir}"]) == 0
    return run_dir


class Payload:
    """Unpickled, it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def reseal(step, *names) -> None:
    """Record the files' new sizes and crc32s in checksums.json, as an attacker would."""
    listing = json.loads((step / "checksums.json").read_text())
    for name in names:
        data = (step / name).read_bytes()
        listing["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (step / "checksums.json").write_text(json.dumps(listing))


def craft(step, where: str, marker) -> str:
    """Put a Payload in the checkpoint folder `step`: in its .metadata, or as the .distcp item ITEM
    (declared a non-tensor item, which DCP hands to its planner's load_bytes). Returns the file's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = pickle.loads((step / ".metadata").read_bytes())  # written by this test's own run
    if where == "metadata":
        metadata.storage_meta.save_id = Payload(marker)
        changed = [".metadata"]
    else:
        item = io.BytesIO()
        torch.save(Payload(marker), item)
        shard = step / "__0_0.distcp"
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(item.getvalue())
        metadata.state_dict_metadata[ITEM] = BytesStorageMetadata()
        for index in [i for i in metadata.storage_data if i.fqn == ITEM]:
            del metadata.storage_data[index]
        metadata.storage_data[MetadataIndex(ITEM)] = _StorageInfo(shard.name, offset, len(item.getvalue()))
        changed = [".metadata", shard.name]
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step, *changed)
    return changed[-1]


def first_error(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert lines and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


@pytest.mark.parametrize("where", ["metadata", "distcp"])
def test_a_crafted_checkpoint_is_refused_by_name_and_runs_nothing(trained, tmp_path, capsys, where):
    """train.py resuming it, infer.py --checkpoint and model.pretrained=<the run> all refuse it, naming
    the file and what it names; the marker is never created. A crafted .metadata is refused before any
    process group."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step = run_dir / "checkpoints" / "step_2"
    marker = tmp_path / "marker"
    file = craft(step, where, marker)
    checkpoint_reading.verify_checkpoint(step)  # the checksums match: only the contents can tell
    named = f"{file} (item {ITEM}) names exec" if where == "distcp" else ".metadata names builtins.exec"
    runs = {
        "resume": (train, ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4"]),
        "infer": (
            infer,
            ["--config", str(TINY), "--checkpoint", str(step), "--steps", "1"]
            + [f"run.output_dir={tmp_path / 'other'}", "--output", str(tmp_path / "v.npy")],
        ),
        "pretrained": (train, COMMON + [f"run.output_dir={tmp_path / 'new'}", f"model.pretrained={run_dir}"]),
    }
    for what, (module, argv) in runs.items():
        assert run_main(module, argv) == 2, what
        line = first_error(capsys.readouterr().err)
        assert (
            f"error: checkpoint {step} was not loaded: {named}, which no tessera checkpoint holds" in line
        ), (
            what,
            line,
        )
        assert "scripts/export.py" in line
        assert not marker.exists(), f"{what} ran the checkpoint's code"
        assert not dist.is_initialized()
    assert not (tmp_path / "v.npy").exists() and not (tmp_path / "new" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crafted_item_is_refused_on_every_rank(trained, tmp_path):
    """Two ranks (ulysses=2) resuming the crafted .distcp: every rank refuses it by name, nothing runs."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    marker = tmp_path / "marker"
    craft(run_dir / "checkpoints" / "step_2", "distcp", marker)
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4", "parallel.ulysses=2"]
    result = ranks(2, "train.py", *argv, timeout=240)
    assert result.returncode != 0
    named = f"was not loaded: __0_0.distcp (item {ITEM}) names exec, which no tessera checkpoint holds"
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: checkpoint {run_dir / 'checkpoints' / 'step_2'} {named}" in result.stderr
        ), result.stderr[-3000:]
    assert not marker.exists()


def test_a_crafted_metadata_is_refused_before_dcp_reads_it(trained, tmp_path, monkeypatch):
    """read_metadata refuses anything outside DCP's metadata classes (by module and name: pathlib.PosixPath
    is allowed, pathlib.Path.touch is not); the loaders refuse it even when nothing checked it first."""
    step = tmp_path / "step_2"
    shutil.copytree(trained / "checkpoints" / "step_2", step)
    assert checkpoint_reading.read_metadata(step).state_dict_metadata  # a real one reads
    metadata = pickle.loads((step / ".metadata").read_bytes())
    metadata.storage_meta.modules = [type(step).touch]  # pickled by reference, as pathlib.Path.touch
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(checkpoint_files.UnsafeCheckpoint, match=r"\.metadata names pathlib\.Path\.touch"):
        checkpoint_reading.read_metadata(step)
    (step / ".metadata").write_bytes(pickle.dumps({"storage_data": {}}))  # no class, and no metadata
    with pytest.raises(checkpoint_files.CheckpointError, match="holds a dict, not DCP's metadata"):
        checkpoint_reading.read_metadata(step)
    for outside in ("/etc/passwd", "../../elsewhere.distcp"):  # reads (or a FIFO's wait) outside the folder
        metadata = checkpoint_reading.read_metadata(trained / "checkpoints" / "step_2")  # a fresh copy
        info = next(iter(metadata.storage_data.values()))
        info.relative_path = outside
        (step / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(checkpoint_files.UnsafeCheckpoint, match="names the file .*outside the"):
            checkpoint_reading.read_metadata(step)

    shutil.rmtree(step)
    shutil.copytree(trained / "checkpoints" / "step_2", step)
    marker = tmp_path / "marker"
    craft(step, "metadata", marker)
    # DCP's reader alone: the check _load makes before DCP starts skipped, the reader still refuses
    real = checkpoint.read_metadata
    monkeypatch.setattr(checkpoint, "read_metadata", lambda path, file=None: file and real(path, file))
    with pytest.raises(checkpoint_files.UnsafeCheckpoint, match=r"\.metadata names builtins\.exec"):
        checkpoint.read_tensors(step, "ema", {"final_layer.linear.bias": (16,)}, verified=True)
    assert not marker.exists()


def test_real_checkpoints_load_every_item(trained):
    """The safe reader and planner load what tessera writes: every tensor and every non-tensor item
    (AdamW's param_groups) equal to what DCP's own loader reads from the same (trusted) files."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    step = trained / "checkpoints" / "step_2"
    expected = _load_state_dict_from_keys(checkpoint_id=str(step))
    state = {
        section: {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in part.items()}
        for section, part in expected.items()
        if section != "optimizer"
    }
    groups = expected["optimizer"]["param_groups"]
    state["optimizer"] = {
        "state": {
            n: {k: torch.empty_like(t) for k, t in s.items()}
            for n, s in expected["optimizer"]["state"].items()
        },
        "param_groups": [{k: None for k in g} for g in groups],
    }
    checkpoint._load(step, state)
    assert state["optimizer"]["param_groups"] == groups
    assert groups[0]["betas"] == (0.9, 0.999) and groups[0]["params"]
    for section in ("model", "ema"):
        for name, tensor in expected[section].items():
            assert torch.equal(state[section][name], tensor), name
    for name, moments in expected["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(state["optimizer"]["state"][name][key], tensor), (name, key)


def test_a_garbage_latest_pointer_names_the_checkpoint_to_resume_from(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    root = run_dir / "checkpoints"
    shutil.copytree(root / "step_2", root / "step_1")  # an older complete one: the newest must be named
    (root / "step_3").mkdir()  # incomplete: never named
    (root / "latest").write_text("garbage\n")
    resume = ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4"]
    assert run_main(train, resume) == 2
    line = first_error(capsys.readouterr().err)
    assert f"{root / 'latest'} is not a tessera `latest` pointer" in line, line
    assert (
        f"the newest complete checkpoint is {root / 'step_2'}: resume from it with "
        f"train.resume={root / 'step_2'} (infer.py --checkpoint {root / 'step_2'})" in line
    ), line
    assert run_main(train, resume + [f"train.resume={root / 'step_2'}"]) == 0  # the advice works
    assert (root / "latest").read_text() == "step_4\n"

    (tmp_path / "notes.txt").write_text("hello\n")  # no checkpoint beside it
    with pytest.raises(checkpoint_files.CheckpointError, match="no other complete checkpoint is left beside"):
        checkpoint_files.resolve_checkpoint(str(tmp_path / "notes.txt"), tmp_path)


EXPERT = ["--config", str(TINY), "train.max_steps=2", "train.checkpoint_every=2", "model.expert=high"]


@pytest.fixture(scope="module")
def expert_run(tmp_path_factory):
    """A model.expert=high run of the tiny recipe (no Wan folder: sample.boundary set), with step_2."""
    run_dir = tmp_path_factory.mktemp("expert") / "run"
    assert run_main(train, EXPERT + ["sample.boundary=0.5", f"run.output_dir={run_dir}"]) == 0
    return run_dir


def never_started(*args, **kwargs):
    raise AssertionError("the run started: a process group was made")


@pytest.mark.parametrize(
    "run, overrides, theirs, ours",
    [
        (
            "expert",
            ["model.expert=low", "sample.boundary=0.5"],
            "high sample.boundary=0.5",
            "low sample.boundary=0.5",
        ),
        ("expert", ["model.expert=none"], "high sample.boundary=0.5", "none"),
        (
            "expert",
            ["model.expert=high", "sample.boundary=0.6"],
            "high sample.boundary=0.5",
            "high sample.boundary=0.6",
        ),
        ("plain", ["model.expert=high", "sample.boundary=0.5"], "none", "high sample.boundary=0.5"),
    ],
)
def test_an_expert_checkpoint_resumes_only_as_that_expert(
    expert_run, trained, tmp_path, monkeypatch, capsys, run, overrides, theirs, ours
):
    run_dir = tmp_path / "run"
    shutil.copytree(expert_run if run == "expert" else trained, run_dir)
    monkeypatch.setattr(train, "init_runtime", never_started)
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4", *overrides]
    assert run_main(train, argv) == 2
    line = first_error(capsys.readouterr().err)
    step = run_dir / "checkpoints" / "step_2"
    assert f"checkpoint {step} trained model.expert={theirs}, this run has model.expert={ours}" in line, line
    assert f"Keep the checkpoint's values (model.expert={theirs})" in line
    assert "another run.output_dir, or train.resume=none" in line


def test_an_expert_checkpoint_resumes_as_its_expert_and_older_ones_as_before(expert_run, tmp_path, capsys):
    from configs import load_config
    from parallel.build.components import expert_recipe

    run_dir = tmp_path / "run"
    shutil.copytree(expert_run, run_dir)
    step = run_dir / "checkpoints" / "step_2"
    state = checkpoint_reading.read_trainer_state(step)
    assert state["expert"] == {"expert": "high", "boundary": 0.5}
    argv = ["--config", str(TINY), f"run.output_dir={run_dir}", "train.max_steps=4", "model.expert=high"]
    assert run_main(train, argv + ["sample.boundary=0.5"]) == 0
    assert f"resumed from {step} at step 2" in capsys.readouterr().out
    assert (
        checkpoint_reading.read_trainer_state(run_dir / "checkpoints" / "step_4")["expert"] == state["expert"]
    )

    del state["expert"]  # a checkpoint written before the record: it resumes as it did, unchecked
    torch.save(state, step / "trainer_rank0.pt")
    reseal(step, "trainer_rank0.pt")
    cfg = expert_recipe(
        load_config(TINY, ["model.expert=low", "sample.boundary=0.5", f"train.resume={step}"])
    )
    assert train.check_before_start(cfg).checkpoint == step


def test_a_resume_keeps_the_fused_adamw():
    """A checkpoint saved by the foreach AdamW (train.py's before it fused its AdamW) resumes into the fused
    one and stays fused (its saved param_groups would bring foreach back for good), and steps as the foreach
    optimizer continuing from the same state does."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from parallel.checkpoints.checkpoint import set_optimizer_state

    torch.manual_seed(0)
    old = torch.nn.Linear(8, 8)
    before = torch.optim.AdamW(old.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(4, 8)

    def step(model, optimizer):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    for _ in range(2):
        step(old, before)
    saved = copy.deepcopy(get_optimizer_state_dict(old, before))
    new = copy.deepcopy(old)
    resumed = torch.optim.AdamW(new.parameters(), lr=1e-2, fused=True)
    set_optimizer_state(new, resumed, saved)
    assert resumed.param_groups[0]["fused"] is True and resumed.param_groups[0]["foreach"] is None
    assert all(s["step"].dtype == torch.float32 and s["step"].item() == 2 for s in resumed.state.values())
    step(old, before)
    step(new, resumed)
    for a, b in zip(old.parameters(), new.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def _class_state() -> dict:
    """Every attribute of the classes a .metadata may name (and their bases), to compare before and after."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path, pathlib.PurePath, torch.Size]
    classes += [
        getattr(metadata, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties")
    ]
    classes += [filesystem._StorageInfo]
    return {cls: dict(vars(cls)) for cls in classes}


def test_a_metadata_cannot_change_a_class_of_the_process(trained, tmp_path):
    """The probe of issue 50: a BUILD on the allowed class pathlib.PosixPath sets `is_absolute` for the
    whole process, after which storage paths outside the checkpoint pass the check. bf7d40d read it and
    the class was changed; now the file is refused by name and every class is as it was."""
    step = tmp_path / "step_2"
    shutil.copytree(trained / "checkpoints" / "step_2", step)
    real = (step / ".metadata").read_bytes()
    assert real[:2] == b"\x80\x04"
    name = b"is_absolute"
    evil = (
        b"cpathlib\nPosixPath\n"  # GLOBAL: the real class, on the stack
        + b"N}"  # (None, {...}): BUILD's slot state, which setattr()s on whatever is on the stack
        + b"X" + len(name).to_bytes(4, "little") + name + b"ctorch\nSize\n" + b"s"
        + b"\x86b0"  # TUPLE2, BUILD, POP: then the real metadata follows
    )  # fmt: skip
    (step / ".metadata").write_bytes(real[:2] + evil + real[2:])
    before = _class_state()
    try:
        with pytest.raises(checkpoint_files.UnsafeCheckpoint, match="pathlib.PosixPath with attributes set"):
            checkpoint_reading.read_metadata(step)
        assert _class_state() == before
    finally:  # were it changed, the rest of this process must not inherit it
        import pathlib

        for cls, attributes in before.items():
            for key in set(vars(cls)) - set(attributes):
                delattr(cls, key)
        assert "is_absolute" not in vars(pathlib.PosixPath)


def test_a_shard_that_links_out_of_the_checkpoint_is_refused(trained, tmp_path):
    """The same bytes behind a symbolic link to a file elsewhere: the checksums match, but the checkpoint
    would read a file outside its folder (bf7d40d loaded it)."""
    step = tmp_path / "run" / "step_2"
    shutil.copytree(trained / "checkpoints" / "step_2", step)
    elsewhere = tmp_path / "elsewhere.distcp"
    (step / "__0_0.distcp").rename(elsewhere)
    (step / "__0_0.distcp").symlink_to(elsewhere)
    for check in (checkpoint_reading.verify_checkpoint, checkpoint_reading.check_checkpoint_files):
        with pytest.raises(
            checkpoint_files.UnsafeCheckpoint, match="is a symbolic link to .*, outside the checkpoint"
        ):
            check(step)
    with pytest.raises(checkpoint_files.UnsafeCheckpoint, match="symbolic link"):
        checkpoint.read_tensors(step, "ema", {"final_layer.linear.bias": (16,)}, verified=True)


def test_files_a_checkpoint_does_not_list_make_it_incomplete(trained, tmp_path):
    """A step folder holding a file its checksums.json does not list (a second run's shard written into
    it) is no run's checkpoint: `latest` naming it is refused by name, not resumed from silently."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    step = run_dir / "checkpoints" / "step_2"
    (step / "__1_0.distcp").write_bytes(b"another run's shard")
    assert checkpoint_files.unlisted_files(step) == ["__1_0.distcp"]
    with pytest.raises(checkpoint_files.CheckpointError, match=r"does not list \(__1_0.distcp\)"):
        checkpoint_files.find_latest(run_dir)
    with pytest.raises(checkpoint_files.CheckpointError, match="not one run's complete checkpoint"):
        checkpoint_reading.verify_checkpoint(step)


def test_a_metadata_of_shared_lists_is_refused_at_once(tmp_path):
    """A crafted .metadata whose memo shares one list inside the next, 40 times over ([x, x], [[x, x],
    [x, x]], ...: 400 bytes): read by walking every reference, it would take 2^40 steps and as many bytes
    (the second review built 1 GiB at 22 levels). Each shared object is built once, and the file is
    refused as the no-metadata it is."""
    step = tmp_path / "step_1"
    step.mkdir()
    ops = bytearray(b"\x80\x04]\x94")  # an empty list, memoised
    for i in range(40):
        ops += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"  # (memo[i], memo[i]), memoised
    (step / ".metadata").write_bytes(bytes(ops) + b".")
    with pytest.raises(checkpoint_files.CheckpointError, match="holds a tuple, not DCP's metadata"):
        checkpoint_reading.read_metadata(step)


def test_a_metadata_without_its_fields_is_damaged_not_a_traceback(trained, tmp_path):
    """DCP's Metadata built with no state at all: refused as damaged (exit 2), not an AttributeError."""
    from torch.distributed.checkpoint.metadata import Metadata

    step = tmp_path / "step_2"
    shutil.copytree(trained / "checkpoints" / "step_2", step)
    (step / ".metadata").write_bytes(pickle.dumps(Metadata.__new__(Metadata)))
    with pytest.raises(checkpoint_files.CheckpointError, match="its state_dict_metadata is a NoneType"):
        checkpoint_reading.read_metadata(step)
