"""What reading a checkpoint's .metadata safely costs (BENCHMARKS.md, "Checkpoints").

parallel/checkpoints/dcp_metadata.py reads DCP's .metadata without handing the file a real class: stand-ins
record it, and DCP's dataclasses are built afterwards from plain values, in Python. This times that read
against a plain pickle.loads (what DCP's own reader does, running whatever the file names) on a synthetic
metadata of
--tensors tensors in --chunks chunks each (the default: about Wan2.1-14B's weights, EMA and AdamW moments
saved by 64 ranks), checks both give equal metadata, and prints the two times and their ratio. A load
reads the file twice per rank (the start-up check, then the load that DCP's reader shares).

    python scripts/bench_metadata.py [--tensors 2400] [--chunks 64] [--repeat 3] [--json out.json]
    python scripts/bench_metadata.py --tiny      # 20 tensors of 4 chunks: seconds
"""

import io
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402


def synthetic(tensors: int, chunks: int) -> bytes:
    """A pickled DCP Metadata: `tensors` bf16 tensors of 1024 x 5120 split in `chunks` row chunks, each
    chunk with its storage entry, and the planner's names."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows = 1024 // chunks
    state, storage = {}, {}
    for t in range(tensors):
        name = f"model.blocks.{t}.weight"
        parts = [
            ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, 5120])) for r in range(chunks)
        ]
        state[name] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([1024, 5120]), parts
        )
        for r in range(chunks):
            storage[MetadataIndex(name, torch.Size([r * rows, 0]))] = _StorageInfo(f"__{r}_0.distcp", t, rows)
    metadata = Metadata(state, planner_data={k: ("model", k[6:]) for k in state}, storage_data=storage)
    metadata.storage_meta = StorageMeta()
    return pickle.dumps(metadata)


def main(argv=None) -> int:
    p = benchlib.parser(__doc__)
    p.add_argument("--tensors", type=int, default=2400)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = benchlib.parse_args(p, argv, tiny=dict(tensors=20, chunks=4, repeat=1))
    from parallel.checkpoints import dcp_metadata

    data = synthetic(args.tensors, args.chunks)
    times = {"pickle.loads (DCP's own reader)": [], "parallel/checkpoints/dcp_metadata.py": []}
    for _ in range(args.repeat):
        for label, read in zip(times, (pickle.loads, lambda d: dcp_metadata.load(io.BytesIO(d)))):
            started = time.perf_counter()
            got = read(data)
            times[label].append(time.perf_counter() - started)
        ours, theirs = dcp_metadata.load(io.BytesIO(data)), pickle.loads(data)
        assert (
            ours.state_dict_metadata == theirs.state_dict_metadata
            and ours.storage_data == theirs.storage_data
        )
        del got
    medians = {label: statistics.median(t) for label, t in times.items()}
    ratio = medians["parallel/checkpoints/dcp_metadata.py"] / medians["pickle.loads (DCP's own reader)"]
    megabytes = len(data) / 1e6
    print(f".metadata of {args.tensors} tensors x {args.chunks} chunks: {megabytes:.1f} MB")
    for label, seconds in medians.items():
        print(f"  {label}: {seconds:.2f} s (median of {args.repeat})")
    print(f"  safe / plain: {ratio:.2f}x")
    if args.json:
        benchlib.write_json(
            args.json, {"megabytes": megabytes, "seconds": medians, "ratio": ratio, **vars(args)}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
