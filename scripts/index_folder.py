"""Index a folder of images/videos with sidecar captions (a.mp4 + a.txt) into a JSONL manifest.

    python scripts/index_folder.py /data/clips --out /data/clips/manifest.jsonl --workers 16
    torchrun --nproc_per_node 8 train.py --config configs/video.yaml data.manifest=/data/clips/manifest.jsonl

Sizes, frame counts and rates are probed from the headers in parallel, once, so that training assigns
buckets without opening a file; so is each clip's sound track ("audio": true/false, "audio_rate",
"audio_channels"), which data.audio=true requires. Files without a caption or that cannot be read are
left out and listed.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.manifest import index_folder, reference_paths, write_manifest  # noqa: E402
from models.family import REFERENCES  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--out", default=None, help="manifest to write (default: <folder>/manifest.jsonl)")
    p.add_argument("--workers", type=int, default=None, help="probing processes (default: up to 16)")
    p.add_argument(
        "--references",
        action="store_true",
        help="edit pairs: the uncaptioned images beside a target named <stem>_0.png, ... are its inputs",
    )
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else folder / "manifest.jsonl"
    entries, skipped = index_folder(folder, args.workers, references=args.references)
    for path, why in sorted(skipped.items()):
        print(f"left out {path}: {why}", file=sys.stderr)
    if not entries:
        print(f"error: no captioned media under {folder}", file=sys.stderr)
        return 2
    base = out.resolve().parent
    relative = lambda p: os.path.relpath(Path(p).resolve(), base)  # noqa: E731
    for e in entries:  # relative to the manifest, so the data folder can move with it
        e["path"] = relative(e["path"])
        if e.get(REFERENCES):
            e[REFERENCES] = "\0".join(relative(r) for r in reference_paths(e))
    write_manifest(out, entries)
    print(f"wrote {out}: {len(entries)} samples ({len(skipped)} left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
