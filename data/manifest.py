"""Manifests: JSONL files with one sample per line, and plain folders of media with `.txt` captions.

A line: {"path": "clips/0001.mp4", "caption": "...", "width": 640, "height": 360, "num_frames": 97,
"fps": 24, "audio": true, "audio_rate": 48000, "audio_channels": 2}. Paths are relative to the
manifest's folder. The size keys let bucketing assign samples without opening a file; lines without
them are probed at start-up (in parallel), and `scripts/index_folder.py` writes them once for a folder.
"""

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, probe_media
from models.family import REFERENCES

SIZE_KEYS = ("width", "height", "num_frames")
# The sound track, from the headers (probe_media): "audio" true/false, its sample rate and channel count
# (null without sound). Manifests indexed before these keys lack them; data.audio then asks for a re-index.
AUDIO_KEYS = ("audio", "audio_rate", "audio_channels")


# Image-to-video (model.task=i2v / flf2v): the first (last) frame a line may name instead of its clip's.
IMAGE_KEYS = ("image", "last_image")
# Editing (Qwen-Image-Edit): the input images a line's target is made from (models/family.py REFERENCES), a
# list; kept as one text of paths joined by NUL (no path holds one), the entries' columns holding text and
# numbers only


def reference_paths(entry: dict) -> list:
    """The reference images' paths of an entry (read_manifest's), [] when it names none."""
    return entry[REFERENCES].split("\0") if entry.get(REFERENCES) else []


def read_manifest(path, left_out: dict | None = None, references: bool = False) -> list[dict]:
    """The entries of a JSONL manifest, or of a folder of captioned media (what a folder's indexing
    leaves out goes into `left_out`, {path: why}, when given; `references`: an edit family's folder, whose
    numbered images beside a target are its input images: index_folder)."""
    path = Path(path)
    if path.is_dir():
        entries, skipped = index_folder(path, references=references)
        if not entries:
            raise ValueError(
                f"data.manifest='{path}' is a folder without captioned media (a .txt beside each file)"
            )
        if left_out is not None:
            left_out.update(skipped)
        return entries
    if not path.is_file():
        raise FileNotFoundError(
            f"data.manifest='{path}' does not exist: name your folder of captioned files, or a manifest, "
            "with data.manifest=..."
        )
    entries = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # file names need not be UTF-8
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({e})") from None
            problem = _check_line(entry)
            if problem:
                raise ValueError(f"{path}:{line_number}: {problem}")
            entry["path"] = os.path.join(path.parent, entry["path"])
            for key in IMAGE_KEYS:  # image-to-video: a frame to condition on instead of the clip's own
                if entry.get(key) is not None:
                    entry[key] = os.path.join(path.parent, entry[key])
            if entry.get(REFERENCES) is not None:
                entry[REFERENCES] = "\0".join(os.path.join(path.parent, r) for r in entry[REFERENCES])
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: the manifest has no samples")
    return entries


def _check_line(entry) -> str:
    """What is wrong with one manifest line ('' if nothing)."""
    if not isinstance(entry, dict):
        return "a line must be a JSON object"
    missing = [k for k in ("path", "caption") if k not in entry]
    if missing:
        return f"missing key(s) {missing}; every line needs 'path' and 'caption'"
    for key in ("path", "caption"):
        if not isinstance(entry[key], str):
            return f"'{key}' must be text, got {entry[key]!r}"
    for key in IMAGE_KEYS:
        if entry.get(key) is not None and not isinstance(entry[key], str):
            return f"'{key}' must be an image file's path, got {entry[key]!r}"
    references = entry.get(REFERENCES)
    if references is not None and (
        not isinstance(references, list) or not references or not all(isinstance(r, str) for r in references)
    ):
        return f"'{REFERENCES}' must be a list of image files' paths, got {references!r}"
    for key in SIZE_KEYS:
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"'{key}' must be a positive whole number or null, got {value!r}"
    if entry.get("audio") is not None and not isinstance(entry["audio"], bool):
        return f"'audio' must be true, false or null, got {entry['audio']!r}"
    for key in AUDIO_KEYS[1:]:
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"'{key}' must be a positive whole number or null, got {value!r}"
    fps = entry.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        return f"'fps' must be a positive number or null, got {fps!r}"
    return ""


def write_manifest(path, entries: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for entry in entries:
            if entry.get(REFERENCES):  # held joined in memory; a list in the file, as read_manifest reads it
                entry = {**entry, REFERENCES: reference_paths(entry)}
            f.write(json.dumps(entry) + "\n")
    os.replace(tmp, path)  # a manifest is complete or absent


def _probe(path: str) -> dict:
    try:
        return probe_media(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported by name, not raised
        return {"error": f"{type(e).__name__}: {e}".strip()}


def probe_all(paths: list[str], workers: int | None = None, desc: str = "probe") -> list[dict]:
    """probe_media over many files in parallel; failures come back as {'error': reason}."""
    workers = workers or min(16, os.cpu_count() or 1)
    if workers <= 1 or len(paths) < 32:
        return [_probe(p) for p in tqdm(paths, desc=desc, disable=len(paths) < 200)]
    with ProcessPoolExecutor(workers) as pool:
        return list(tqdm(pool.map(_probe, paths, chunksize=16), total=len(paths), desc=desc))


def complete_metadata(
    entries: list[dict], workers: int | None = None, need_fps: bool = False
) -> tuple[list[dict], dict[str, str]]:
    """Probe the entries whose size keys are missing (and, with need_fps, videos without an fps: the
    frames a clip holds at data.fps depend on it). Returns (entries with sizes, {path: why} of those
    left out: an unsupported file type, or a file that could not be probed)."""
    failed = {}
    for e in entries:
        ext = os.path.splitext(e["path"])[1].lower()
        if ext not in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
            failed[e["path"]] = f"unsupported file type '{ext}'"
    todo = [
        e
        for e in entries
        if e["path"] not in failed
        and (
            any(e.get(k) is None for k in SIZE_KEYS)
            or (
                need_fps
                and e.get("fps") is None
                and os.path.splitext(e["path"])[1].lower() in VIDEO_EXTENSIONS
            )
        )
    ]
    if len(todo) > 1000:
        print(
            f"[tessera] probing {len(todo)} files without width/height/num_frames/fps in the manifest; "
            f"scripts/index_folder.py writes them once",
            flush=True,
        )
    for entry, info in zip(todo, probe_all([e["path"] for e in todo], workers)):
        if "error" in info:
            failed[entry["path"]] = info["error"]
        else:
            entry.update({k: v for k, v in info.items() if entry.get(k) is None})
    return [e for e in entries if e["path"] not in failed], failed


STAT_SAMPLE = 4096  # lines with sizes whose files are checked at start-up (every rank, each start)


def missing_files(entries: list[dict], sample: int = STAT_SAMPLE, workers: int = 32) -> tuple[list[str], int]:
    """(the missing paths among the files of `entries` checked, how many were checked): all of them up to
    `sample`, else a fixed sample of `sample` (the same on every rank), so that a manifest whose lines carry
    sizes, never opened at start-up, counts its missing files as one without sizes does, at a bounded cost
    (one stat a file, in threads: on a network file system each waits on the server; 10 million files
    times every rank at every start would load it)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    paths = [e["path"] for e in entries]
    if len(paths) > sample:
        paths = [paths[i] for i in sorted(random.Random(0).sample(range(len(paths)), sample))]
    if len(paths) < 256:
        return [p for p in paths if not os.path.exists(p)], len(paths)
    chunks = [paths[i : i + 256] for i in range(0, len(paths), 256)]
    with ThreadPoolExecutor(workers) as pool:
        absent = pool.map(lambda chunk: [p for p in chunk if not os.path.exists(p)], chunks)
        return [p for chunk in absent for p in chunk], len(paths)


def index_folder(
    folder, workers: int | None = None, references: bool = False
) -> tuple[list[dict], dict[str, str]]:
    """Every image or video under `folder` with a sidecar caption (a.mp4 + a.txt), probed in parallel;
    with `references` (an edit family's folder), an edit pair's input images are the uncaptioned images
    beside its target named a_0.png, a_1.png, ... (musubi-tuner's numbering; the manifest's `references`).
    Returns (entries with absolute paths, {path: why it was left out})."""
    folder = Path(folder)
    media = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    captioned = {p for p in media if p.with_suffix(".txt").is_file()}
    numbered = folder_references([p for p in media if p not in captioned]) if references else {}
    inputs = {p: numbered.get((p.parent, p.stem), []) for p in captioned}
    taken = {r for refs in inputs.values() for r in refs}
    entries, skipped = [], {}
    for p in media:
        caption = p.with_suffix(".txt")
        if p not in captioned:
            if p not in taken:
                skipped[str(p)] = f"no caption file {caption.name}"
            continue
        try:
            entry = {"path": str(p), "caption": caption.read_text(encoding="utf-8").strip()}
        except UnicodeDecodeError as e:
            skipped[str(p)] = f"caption file {caption.name} is not UTF-8 text ({e.reason} at byte {e.start})"
            continue
        if inputs[p]:
            entry[REFERENCES] = "\0".join(str(r) for r in inputs[p])
        entries.append(entry)
    entries, failed = complete_metadata(entries, workers)
    return entries, {**skipped, **failed}


def folder_references(uncaptioned: list) -> dict:
    """{(folder, a target's stem): its input images}: the images named <stem>_<number>.<ext>, in their
    numbers' order."""
    found = {}
    for p in uncaptioned:
        match = re.match(r"^(.+)_(\d+)$", p.stem)
        if match and p.suffix.lower() in IMAGE_EXTENSIONS:
            found.setdefault((p.parent, match.group(1)), []).append((int(match.group(2)), p))
    return {key: [p for _, p in sorted(pairs)] for key, pairs in found.items()}
