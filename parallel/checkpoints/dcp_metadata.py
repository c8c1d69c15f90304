"""DCP's `.metadata` read without letting the file do anything but describe a checkpoint.

DCP's own reader unpickles `.metadata` with a plain pickle.load, which calls whatever a crafted file names.
An allow-list of classes is not enough either: pickle's BUILD instruction sets attributes on whatever sits
on its stack, a class named by the allow-list included (bf7d40d's reader let a file replace
`pathlib.PosixPath.is_absolute` for the whole process, and its storage paths then passed the check). So
here the unpickler never hands the file a real class or function. Each name it may use resolves to a
stand-in made for this one read, that only records how the file builds it; nothing the file does
reaches a class of the process. The records are then turned into DCP's metadata dataclasses by
`_build`, which knows each class's fields and accepts only plain values (str, int, float, bool, None,
lists, tuples and dicts of them), torch.Size of ints, dtypes, layouts and DCP's memory-format enum.
"""

import gc
import importlib
import pickle
from pathlib import PurePosixPath

import torch

# What DCP's .metadata is made of (torch/distributed/checkpoint/metadata.py and filesystem.py): the only
# names a file may use. torch's dtypes are allowed besides.
_DATACLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_OTHERS = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),  # torch.strided (and the other layouts) by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}
_PLAIN = (str, int, float, bool, type(None), bytes)


class Forbidden(Exception):
    """What the file tried that no DCP metadata does: the text names it."""


class _StandInClass(type):
    """The stand-ins' type: BUILD on a stand-in class itself (what attacked the real classes: pickle then
    setattr()s its state on the class) finds this `__setstate__` first, which refuses."""

    @property
    def __setstate__(cls):
        def on_the_class(state):
            raise Forbidden(f"{'.'.join(cls.target)} with attributes set on the class itself")

        return on_the_class


class _Stand(metaclass=_StandInClass):
    """The base of the stand-ins: an instance records the arguments it was made with (NEWOBJ, REDUCE) and
    the state BUILD gives it."""

    target: tuple = ("", "")
    __slots__ = ("args", "state")

    def __new__(cls, *args, **kwargs):
        if kwargs:
            raise Forbidden(f"{'.'.join(cls.target)} made with keyword arguments")
        made = object.__new__(cls)
        made.args, made.state = args, None
        return made

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if self.state is not None:
            raise Forbidden(f"{'.'.join(self.target)} built twice")
        self.state = state


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.real: dict = {}  # stand-in class -> the real class or function it stands for

    def find_class(self, module, name):
        allowed = name in _DATACLASSES.get(module, ()) or (module, name) in _OTHERS
        if not allowed and not (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            raise Forbidden(f"{module}.{name}")
        for stand in self.real:
            if stand.target == (module, name):
                return stand
        stand = _StandInClass(f"StandIn_{name}", (_Stand,), {"target": (module, name), "__slots__": ()})
        self.real[stand] = getattr(importlib.import_module(module), name)
        return stand

    def persistent_load(self, pid):
        raise Forbidden("a persistent id")


def load(file) -> object:
    """The object a .metadata file (an open binary file) describes, built from plain data; Forbidden if the
    file does what no DCP metadata does, any other exception if it is not a pickle."""
    unpickler = _Unpickler(file)
    collecting = gc.isenabled()
    gc.disable()  # a large checkpoint's metadata is a million small objects: the collector's passes over
    try:  # them (none is garbage) cost more than the reading
        return _Builder(unpickler.real).build(unpickler.load())
    finally:
        if collecting:
            gc.enable()


_PLAIN = frozenset((str, int, float, bool, type(None), bytes))
_DEPTH = 64  # DCP's metadata nests a few levels; a deeper file is no metadata


class _Builder:
    """The real objects the stand-ins record, from validated plain data."""

    def __init__(self, real: dict):
        self.real = real
        # what each object of the file (by id: the file's objects stay alive while they are built) became:
        # an object the pickle's memo shares is built once, as pickle would, and a crafted chain of
        # shared lists ([x, x], N times over) costs N builds, not 2^N
        self.built: dict[int, object] = {}

    def build(self, value, depth: int = 0):
        kind = type(value)
        if kind in _PLAIN:
            return value
        if (kind is tuple or kind is list) and _PLAIN.issuperset(map(type, value)):
            return value if kind is tuple else list(value)  # most are: a chunk's offsets, a planner's names
        if depth > _DEPTH:
            raise Forbidden("nesting deeper than DCP's metadata")
        done = self.built.get(id(value), self)
        if done is not self:
            return done
        self.built[id(value)] = made = self._build(value, kind, depth + 1)
        return made

    def _build(self, value, kind, depth: int):
        if kind is tuple or kind is list:
            return kind(self.build(v, depth) for v in value)
        if kind is dict:
            return {self.build(k, depth): self.build(v, depth) for k, v in value.items()}
        if kind is _StandInClass:  # a name used as a value: a dtype
            real = self.real[value]
            if isinstance(real, torch.dtype):
                return real
            raise Forbidden(f"{'.'.join(value.target)} used as a value")
        if isinstance(value, _Stand):
            return self.made(value, depth)
        raise Forbidden(f"a {kind.__name__}")

    def made(self, stand: _Stand, depth: int):
        module, name = stand.target
        real = self.real[type(stand)]
        args = tuple(self.build(a, depth) for a in stand.args)
        if name in _DATACLASSES.get(module, ()):
            if args:
                raise Forbidden(f"{module}.{name} called with arguments")
            return _dataclass(real, self.build(stand.state, depth) if stand.state is not None else {})
        if stand.state is not None:
            raise Forbidden(f"{module}.{name} given a state")
        if (
            name == "Size"
            and len(args) == 1
            and type(args[0]) is tuple
            and all(type(n) is int for n in args[0])
        ):
            return torch.Size(args[0])
        if name == "_get_layout" and len(args) == 1 and isinstance(args[0], str):
            layout = vars(torch).get(args[0].removeprefix("torch."))
            if isinstance(layout, torch.layout):
                return layout
        if name == "_MEM_FORMAT_ENCODING" and len(args) == 1 and type(args[0]) is int:
            return real(args[0])
        if name in ("PosixPath", "PurePosixPath") and all(isinstance(a, str) for a in args):
            return PurePosixPath(*args)
        raise Forbidden(f"{module}.{name} made from {args!r:.80}")


_FIELDS_SEEN: set = set()  # (class, field names) already checked: thousands of chunks share a few


def _dataclass(cls, state):
    """An instance of DCP's dataclass `cls` with `state` as pickle's BUILD would give it: its fields (a dict,
    its keys plain names: a field this torch's class lacks, written by another torch version, is kept as
    plain data, as pickle would), or the tuple its own __setstate__ reads (TensorProperties)."""
    made = cls.__new__(cls)
    if isinstance(state, tuple) and "__setstate__" in vars(cls):
        made.__setstate__(state)  # the class's own code, on plain values
        return made
    if not isinstance(state, dict):
        raise Forbidden(f"{cls.__name__} with a state that is not its fields")
    names = (cls, frozenset(state))
    if names not in _FIELDS_SEEN:
        if not all(isinstance(k, str) and k.isidentifier() for k in state):
            raise Forbidden(f"{cls.__name__} with a state that is not its fields")
        special = sorted(k for k in state if k.startswith("__"))
        if special:
            raise Forbidden(f"{cls.__name__} with the special attributes {special}")
        _FIELDS_SEEN.add(names)
    vars(made).update(state)
    return made
