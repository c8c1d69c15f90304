"""Write the synthetic demo dataset to a folder as real files: mp4 clips (H.264) plus manifest.jsonl.

    python scripts/make_demo_data.py --out demo_data --samples 512
    python train.py data.manifest=demo_data/manifest.jsonl

Training from it exercises the same decoding path as a real video dataset.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from data.manifest import write_manifest  # noqa: E402
from data.media import write_video  # noqa: E402
from data.synthetic import SyntheticVideoDataset  # noqa: E402


def make_demo_data(out, samples: int, frames: int = 8, size: int = 32, seed: int = 0, fps: int = 8) -> Path:
    out = Path(out)
    dataset = SyntheticVideoDataset(samples, frames, size, size, seed=seed)
    entries = []
    for i in tqdm(range(samples), desc="clips", disable=samples < 50):
        clip, caption = dataset.render(i)
        name = f"clips/{i:06d}.mp4"
        write_video(out / name, clip, fps=fps)
        entries.append(
            {
                "path": name,
                "caption": caption,
                "num_frames": clip.shape[0],
                "height": clip.shape[1],
                "width": clip.shape[2],
                "fps": fps,
            }
        )
    write_manifest(out / "manifest.jsonl", entries)
    return out / "manifest.jsonl"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo_data")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument(
        "--size", type=int, default=32, help="the shorter side; clips come in several aspect ratios"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"wrote {make_demo_data(args.out, args.samples, args.frames, args.size, args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
