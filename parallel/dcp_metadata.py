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

import pickle

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


class _Stand:
    """The base of the stand-ins: an instance records the arguments it was made with (NEWOBJ, REDUCE) and
    the state BUILD gives it; a BUILD on the stand-in class itself (what attacked the real classes) is
    refused."""

    target: tuple = ("", "")

    def __new__(cls, *args, **kwargs):
        if kwargs:
            raise Forbidden(f"{'.'.join(cls.target)} made with keyword arguments")
        made = object.__new__(cls)
        made.args, made.state = args, None
        return made

    def __init__(self, *args, **kwargs):
        pass

    class _SetState:
        def __get__(self, instance, owner):
            if instance is None:

                def on_the_class(state):
                    raise Forbidden(f"{'.'.join(owner.target)} with attributes set on the class itself")

                return on_the_class

            def record(state):
                if instance.state is not None:
                    raise Forbidden(f"{'.'.join(owner.target)} built twice")
                instance.state = state

            return record

    __setstate__ = _SetState()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.stand_ins: dict = {}

    def find_class(self, module, name):
        allowed = name in _DATACLASSES.get(module, ()) or (module, name) in _OTHERS
        if not allowed and not (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            raise Forbidden(f"{module}.{name}")
        key = (module, name)
        if key not in self.stand_ins:  # a class of its own per name and per read
            self.stand_ins[key] = type(f"StandIn_{name}", (_Stand,), {"target": key})
        return self.stand_ins[key]

    def persistent_load(self, pid):
        raise Forbidden("a persistent id")


def load(file) -> object:
    """The object a .metadata file (an open binary file) describes, built from plain data; Forbidden if the
    file does what no DCP metadata does, any other exception if it is not a pickle."""
    return _build(_Unpickler(file).load())


def _real(target: tuple):
    import importlib

    return getattr(importlib.import_module(target[0]), target[1])


def _build(value, depth: int = 0):
    if depth > 64:
        raise Forbidden("nesting deeper than DCP's metadata")
    down = lambda v: _build(v, depth + 1)  # noqa: E731
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [down(v) for v in value]
    if isinstance(value, tuple):
        return tuple(down(v) for v in value)
    if isinstance(value, dict):
        return {down(k): down(v) for k, v in value.items()}
    if isinstance(value, type) and issubclass(value, _Stand):  # a name used as a value: a dtype
        real = _real(value.target)
        if isinstance(real, torch.dtype):
            return real
        raise Forbidden(f"{'.'.join(value.target)} used as a value")
    if isinstance(value, _Stand):
        return _made(value, down)
    raise Forbidden(f"a {type(value).__name__}")


def _made(stand: _Stand, down):
    """The real object a stand-in records, from validated plain data."""
    module, name = stand.target
    args = tuple(down(a) for a in stand.args)
    if name in _DATACLASSES.get(module, ()):
        if args:
            raise Forbidden(f"{module}.{name} called with arguments")
        return _dataclass(_real(stand.target), down(stand.state) if stand.state is not None else {})
    if stand.state is not None:
        raise Forbidden(f"{module}.{name} given a state")
    if name == "Size" and len(args) == 1 and all(type(n) is int for n in args[0]):
        return torch.Size(args[0])
    if name == "_get_layout" and len(args) == 1 and isinstance(args[0], str):
        layout = vars(torch).get(args[0].removeprefix("torch."))
        if isinstance(layout, torch.layout):
            return layout
    if name == "_MEM_FORMAT_ENCODING" and len(args) == 1 and type(args[0]) is int:
        return _real(stand.target)(args[0])
    if name in ("PosixPath", "PurePosixPath") and all(isinstance(a, str) for a in args):
        from pathlib import PurePosixPath

        return PurePosixPath(*args)
    raise Forbidden(f"{module}.{name} made from {type(args).__name__} {args!r:.80}")


def _dataclass(cls, state):
    """An instance of DCP's dataclass `cls` with `state` as pickle's BUILD would give it: its fields (a dict,
    its keys plain names: a field this torch's class lacks, written by another torch version, is kept as
    plain data, as pickle would), or the tuple its own __setstate__ reads (TensorProperties)."""
    made = cls.__new__(cls)
    if isinstance(state, tuple) and "__setstate__" in vars(cls):
        made.__setstate__(state)  # the class's own code, on plain values
        return made
    if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier() for k in state):
        raise Forbidden(f"{cls.__name__} with a state that is not its fields")
    special = sorted(k for k in state if k.startswith("__"))
    if special:
        raise Forbidden(f"{cls.__name__} with the special attributes {special}")
    vars(made).update(state)
    return made
