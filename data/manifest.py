"""Real data: a JSONL manifest of images and videos with captions.

One JSON object per line: {"path": "clips/0001.mp4", "caption": "..."}; optional keys (width,
height, num_frames, fps) are kept for later use by bucketing. Paths are relative to the manifest's
folder. Every sample is decoded, resized and centre-cropped to the recipe's fixed size.
"""

import json
from pathlib import Path

from data.media import read_media, to_training_clip


def read_manifest(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.manifest='{path}' does not exist")
    entries = []
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({e})") from None
            missing = [k for k in ("path", "caption") if k not in entry]
            if missing:
                raise ValueError(f"{path}:{line_number}: missing key(s) {missing}; every line needs 'path' and 'caption'")
            entry["path"] = str((path.parent / entry["path"]).resolve())
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: the manifest has no samples")
    return entries


class ManifestDataset:
    def __init__(self, manifest, frames: int, height: int, width: int, fps: float | None = None):
        self.entries = read_manifest(manifest)
        self.frames, self.height, self.width, self.fps = frames, height, width, fps

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, index: int) -> dict:
        entry = self.entries[index]
        pixels = read_media(entry["path"], max_frames=self.frames, fps=self.fps)
        return {"video": to_training_clip(pixels, self.frames, self.height, self.width), "caption": entry["caption"], "index": index}


def write_manifest(path, entries: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
