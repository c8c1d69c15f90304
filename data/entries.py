"""Manifest entries stored as columns, for datasets of millions of samples.

A list of dicts costs about 1 KB per sample, and every DataLoader worker forked from the trainer
slowly copies those pages as it touches the objects' reference counts: resident memory grows
over an epoch in every worker, the "leak" users of big datasets report. Here each string column
is one byte buffer plus offsets and each number column one numpy array, so there are no Python
objects per sample and the workers share the pages instead of copying them.
"""

import hashlib

import numpy as np

_MISSING_INT = np.iinfo(np.int64).min


class _Strings:
    def __init__(self, values: list[str | None]):
        # surrogateescape: a file name that is not UTF-8 survives the round trip unchanged
        encoded = [b"" if v is None else v.encode(errors="surrogateescape") for v in values]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.present = np.array([v is not None for v in values], dtype=bool)

    def __getitem__(self, i: int) -> str | None:
        if not self.present[i]:
            return None
        return self.buffer[self.offsets[i] : self.offsets[i + 1]].tobytes().decode(errors="surrogateescape")

    def arrays(self):
        return self.buffer, self.offsets, self.present


class _Numbers:
    def __init__(self, values: list, integer: bool):
        if integer:
            self.data = np.array([_MISSING_INT if v is None else v for v in values], dtype=np.int64)
        else:
            self.data = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
        self.integer = integer

    def __getitem__(self, i: int):
        v = self.data[i]
        if self.integer:
            return None if v == _MISSING_INT else int(v)
        return None if np.isnan(v) else float(v)

    def arrays(self):
        return (self.data,)


class _Flags(_Numbers):
    """true/false (the manifest's "audio"): one int8 a sample, -1 where missing."""

    def __init__(self, values: list):
        self.data = np.array([-1 if v is None else int(v) for v in values], dtype=np.int8)

    def __getitem__(self, i: int):
        return None if self.data[i] < 0 else bool(self.data[i])


class Entries:
    """Read-only, indexable like the list of dicts it was built from: `entries[i]` is a fresh dict (a
    key missing from a line reads as None). Keys whose values are not all text, all numbers or all
    true/false (lists, mixed types: metadata tessera does not read) are not kept; data/manifest.py has
    already checked the keys it reads."""

    def __init__(self, dicts: list[dict]):
        keys = sorted({k for d in dicts for k in d})
        self.columns = {}
        for key in keys:
            values = [d.get(key) for d in dicts]
            present = [v for v in values if v is not None]
            if present and all(isinstance(v, str) for v in present):
                self.columns[key] = _Strings(values)
            elif present and all(isinstance(v, bool) for v in present):
                self.columns[key] = _Flags(values)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
                try:  # all missing (images have no fps) is a number column of NaN
                    self.columns[key] = _Numbers(
                        values, integer=bool(present) and all(isinstance(v, int) for v in present)
                    )
                except OverflowError:  # a whole number beyond int64: metadata tessera does not read
                    pass
        self.length = len(dicts)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if not -self.length <= i < self.length:
            raise IndexError(i)
        i %= self.length
        return {key: column[i] for key, column in self.columns.items()}

    def __iter__(self):
        return (self[i] for i in range(self.length))

    def numbers(self, key: str) -> np.ndarray:
        """A number column as one array (missing values: NaN for decimals, the int64 minimum for whole
        numbers; true/false columns are int8 1/0, -1 where missing)."""
        return self.columns[key].data

    def digest(self, exclude: tuple[str, ...] = ()) -> str:
        """A hash of every column but `exclude`: equal on two ranks only if they read the same samples."""
        h = hashlib.sha1()
        for key, column in self.columns.items():
            if key not in exclude:
                h.update(key.encode())
                for array in column.arrays():
                    h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()[:16]
