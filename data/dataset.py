"""Bucketed datasets: media from a manifest, the synthetic demo generator, and precomputed latents.

Each sample is assigned to a bucket once, at start-up, from its size alone (no decoding); samples
that fit no bucket are left out and counted. `dataset[(index, epoch)]` loads sample `index` into
its bucket (the epoch varies which part of a long clip is taken). A sample that is missing,
corrupt or too short is replaced by another sample of the same bucket, chosen from (seed, epoch,
index), so the batch keeps its shape and the step count never changes; when none of the bucket
is left, a sample of another bucket that holds enough frames is resized into it. The replaced
file and the reason travel with the batch, for the trainer to log once, count, and list in the run's
data_report.jsonl beside every file left out at start-up.
"""

import hashlib
from collections import Counter

import numpy as np
import torch

from data.buckets import Bucket, BucketTable
from data.entries import Entries
from data.manifest import IMAGE_KEYS, reference_paths
from data.media import frames_at_rate
from models.family import REFERENCES


class DataError(ValueError):
    """The data is broken beyond replacing a sample (a user error: the message names the files)."""


def _reason(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) < 300 else text[:297] + "..."


def check_finite(item: dict, where: str = "") -> None:
    """A ValueError naming the tensor of a loaded sample that holds NaN or inf (a precomputed latent or text
    embedding written from a diverged encoder, a float image): such a sample is replaced like an unreadable
    one and listed in the data report, where training on it would stop the run as a divergence at the same
    step on every resume."""
    for key, value in item.items():
        if isinstance(value, dict):
            check_finite(value, f"{where}{key}.")
        elif torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(f"{where}{key} holds {bad} NaN or inf values of {value.numel()}")


class BucketedDataset:
    max_replacements = 8  # a bucket this broken is a data problem worth stopping for
    named_in_summary = 10  # left-out files named in the start-up summary; data_report.jsonl lists them all
    broken_first = (
        "missing",
        "unreadable",
    )  # named before the files left out by choice (no caption, size...)

    def __init__(self, entries: list[dict], table: BucketTable, seed: int = 0):
        self.table, self.seed = table, seed
        kept, buckets, self.dropped, self.left_out = [], [], Counter(), []
        self.gone = []  # listed with sizes but missing at start-up: kept, each replaced when loaded
        self.gone_checked = 0  # how many of the files listed with sizes were checked (a sample, if many)
        for entry in entries:
            bucket, why = self.assign(entry)
            if bucket is None:
                self.leave_out(entry["path"], why)
            else:
                kept.append(entry)
                buckets.append(bucket)
        if not kept:
            raise ValueError(
                f"no sample fits a bucket ({dict(self.dropped)}); check data.resolutions, "
                f"data.aspect_ratios, data.frame_counts and data.max_upscale"
            )
        self.entries = Entries(kept)  # columns: no Python object per sample for loader workers to copy
        self.bucket_of = np.asarray(buckets, dtype=np.int64)
        self.members = [np.flatnonzero(self.bucket_of == b) for b in range(len(table))]

    def assign(self, entry: dict) -> tuple[int | None, str]:
        raise NotImplementedError

    def can_fill(self, bucket: Bucket) -> np.ndarray:
        """Which samples (a boolean per sample) can stand in for this bucket's, resized into it."""
        return np.zeros(len(self), dtype=bool)

    def digest(self) -> str:
        """What every rank must agree on besides the plan: the samples (captions, sizes; not the paths,
        which may differ between machines that mount the data elsewhere), their buckets, the buckets'
        sizes and batch sizes."""
        h = hashlib.sha1(self.entries.digest(exclude=("path", "source")).encode())
        h.update(self.bucket_of.tobytes())
        h.update(repr([(b.name, n) for b, n in zip(self.table.buckets, self.table.batch_sizes)]).encode())
        return h.hexdigest()[:16]

    def load(self, entry: dict, bucket: Bucket, rng: np.random.Generator) -> dict:
        """The sample's tensors in the bucket's size; raises if the file cannot give them."""
        raise NotImplementedError

    def __len__(self):
        return len(self.entries)

    def leave_out(self, path: str, category: str, detail: str = "") -> None:
        """Count and keep a sample left out at start-up (a category such as 'missing', 'unreadable',
        'no caption' or a bucket rule, and the detailed reason)."""
        self.dropped[category] += 1
        self.left_out.append((path, category, detail or category))

    def left_out_files(self) -> list[tuple[str, str, str]]:
        """(path, category, reason) of every sample left out at start-up, missing and unreadable files
        first."""
        rank = {category: i for i, category in enumerate(self.broken_first)}
        return sorted(
            self.left_out, key=lambda left: rank.get(left[1], len(rank))
        )  # stable: file order within

    def summary(self, listed_in=None) -> str:
        """Samples per bucket, and what was left out: counted by category, the first few named (missing and
        unreadable files first), and where the full list is (`listed_in`, the run's data_report.jsonl)."""
        counts = Counter(self.bucket_of.tolist())
        first = {category: i for i, category in enumerate(self.broken_first)}
        categories = sorted(self.dropped.items(), key=lambda item: first.get(item[0], len(first)))
        dropped = (
            f"; left out {sum(self.dropped.values())}: " + ", ".join(f"{n} {why}" for why, n in categories)
            if self.dropped
            else ""
        )
        if self.gone:
            of = f" of the {self.gone_checked} checked" if self.gone_checked < len(self.entries) else ""
            dropped += f"; {len(self.gone)}{of} listed with sizes but missing (replaced when loaded)"
        left_out = self.left_out_files()
        named = "".join(f"\n  left out {path}: {why}" for path, _, why in left_out[: self.named_in_summary])
        if len(left_out) > self.named_in_summary:
            named += f"\n  ... and {len(left_out) - self.named_in_summary} more"
        if left_out and listed_in is not None:
            named += (
                f"\n  every file left out, and every file replaced during training, is listed in {listed_in}"
            )
        return (
            f"{len(self)} samples in {len(counts)} of {len(self.table)} buckets{self.sound()}{dropped}"
            f"{named}\n" + self.table.describe(counts)
        )

    def sound(self) -> str:
        """How many samples carry sound, from the manifest's "audio" key (scripts/index_folder.py writes
        it): " (412 of 500 carry sound, 48 kHz)"; "" for a manifest indexed without it."""
        if "audio" not in self.entries.columns:
            return ""
        flags = self.entries.numbers("audio")
        indexed, with_sound = int((flags >= 0).sum()), int((flags == 1).sum())
        rates = self.entries.numbers("audio_rate") if "audio_rate" in self.entries.columns else np.array([])
        rates = sorted({int(r) for r in rates[flags == 1] if r > 0}) if len(rates) else []
        khz = " / ".join(f"{r / 1000:g}" for r in rates[:4]) + (" / ..." if len(rates) > 4 else "")
        unknown = f"; {len(self) - indexed} not indexed for sound" if indexed < len(self) else ""
        return f" ({with_sound} of {indexed} carry sound{f', {khz} kHz' if rates else ''}{unknown})"

    def __getitem__(self, key) -> dict:
        index, epoch = key
        bucket_id = int(self.bucket_of[index])
        bucket = self.table.buckets[bucket_id]
        failures, tried, candidate = [], set(), index
        while True:
            entry = self.entries[candidate]
            try:
                item = self.load(entry, bucket, np.random.default_rng([self.seed, epoch, candidate]))
                check_finite(item)
                break
            except Exception as e:  # noqa: BLE001 - any unreadable sample is replaced, named and counted
                failures.append((entry["path"], _reason(e)))
                tried.add(candidate)
            others = [m for m in self.members[bucket_id].tolist() if m not in tried] or self._stand_ins(
                bucket, tried
            )
            if not others or len(failures) > self.max_replacements:
                listed = "; ".join(f"{p} ({why})" for p, why in failures)
                raise DataError(
                    f"bucket {bucket.name}: {len(failures)} samples in a row could not be loaded and "
                    f"{'none is left to replace them' if not others else 'the data looks broken'}: "
                    f"{listed}"
                )
            pick = np.random.default_rng([self.seed, epoch, index, len(failures)]).integers(len(others))
            candidate = others[pick]
        item.update(caption=entry["caption"], index=index, bucket=bucket_id, failures=failures)
        return item

    def _stand_ins(self, bucket: Bucket, tried: set) -> list[int]:
        """Samples of other buckets that can fill this one, for a bucket none of whose samples loads
        (a bucket of one sample whose file was deleted must not stop a run)."""
        return [i for i in np.flatnonzero(self.can_fill(bucket)).tolist() if i not in tried]


# A bucket's sound must have one length: frames / data.fps seconds is the same for every clip of a bucket,
# frames at each clip's own rate are not.
AUDIO_NEEDS_FPS = (
    "data.audio=true needs data.fps: a clip's sound spans its frames' time, and only at one frame rate "
    "does every clip of a frame-count bucket carry the same number of sound samples (frames / data.fps "
    "seconds); set data.fps, e.g. data.fps=24"
)


class MediaDataset(BucketedDataset):
    """Images and videos listed in a manifest (see data/manifest.py). `audio`: (sample rate, channels) of
    the sound each sample carries beside its frames (data.audio), which needs `fps`; `frames`: the
    manifest's image keys (image, last_image) whose frames the training reads (Family.given_frames)."""

    def __init__(self, entries, table, fps=None, seed: int = 0, audio=None, frames: tuple = IMAGE_KEYS):
        if audio is not None and not fps:
            raise ValueError(AUDIO_NEEDS_FPS)
        self.fps, self.audio, self.frames = fps, audio, tuple(frames)
        super().__init__(entries, table, seed)

    def assign(self, entry):
        return self.table.assign(
            entry["width"], entry["height"], entry["num_frames"], entry.get("fps"), self.fps
        )

    def can_fill(self, bucket):
        fps = self.entries.numbers("fps") if "fps" in self.entries.columns else None
        return frames_at_rate(self.entries.numbers("num_frames"), fps, self.fps) >= bucket.frames

    def read_references(self, entry, bucket) -> list:
        """An edit pair's input images as they are; one of the target's own size (a pixel-aligned before
        and after) cropped and resized as the target is, so that the pair stays aligned in its bucket."""
        from data.media import fit_to_bucket, probe_media
        from models.image_condition import open_image

        out, target = [], None
        for path in reference_paths(entry):
            image = np.asarray(open_image(path), dtype=np.uint8)
            if target is None:  # the target file's displayed size (its header), not what a line states
                probed = probe_media(entry["path"])
                target = (probed["height"], probed["width"])
            if image.shape[:2] == target:
                image = fit_to_bucket(image[None], 1, bucket.height, bucket.width)[0]
            out.append(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).contiguous())
        return out

    def load(self, entry, bucket, rng):
        from data.media import fit_to_bucket, read_image, read_timed_clip

        clip, start = read_timed_clip(
            entry["path"], bucket.frames, bucket.height, bucket.width, self.fps, rng, entry["num_frames"]
        )
        sample = {"video": torch.from_numpy(clip).permute(3, 0, 1, 2).contiguous()}  # (3, T, H, W) uint8
        if self.audio is not None:
            sample["audio"] = self.read_sound(entry["path"], start, bucket.frames)
        if REFERENCES in self.frames:  # editing: the line's input images, (3, H, W) uint8 each
            sample[REFERENCES] = self.read_references(entry, bucket)
        for key, frame in zip(IMAGE_KEYS, (0, -1)):
            if key in self.entries.columns and key in self.frames:  # each sample carries its named frame
                path = entry[key]
                pixels = (
                    fit_to_bucket(read_image(path), 1, bucket.height, bucket.width)[0]
                    if path
                    else clip[frame]
                )
                sample[key] = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()
        return sample

    def read_sound(self, path, start: float, frames: int) -> torch.Tensor:
        """(channels, round(frames / fps * rate)) float32: the sound of the `frames` frames from `start`
        (the first frame's time), at self.audio's rate and channels (data/media.py mix_channels)."""
        from data.media import mix_channels, read_audio

        rate, channels = self.audio
        return torch.from_numpy(mix_channels(read_audio(path, start, frames / self.fps, rate), channels))


class SyntheticDataset(BucketedDataset):
    """The demo generator (data/synthetic.py) through the same buckets as real media."""

    def __init__(self, generator, table, seed: int = 0):
        self.generator = generator
        entries = []
        for i in range(len(generator)):
            d = generator.describe(i)
            entries.append(
                {
                    "path": f"synthetic:{i}",
                    "caption": d["caption"],
                    "width": d["width"],
                    "height": d["height"],
                    "num_frames": d["frames"],
                    "synthetic_index": i,
                }
            )
        super().__init__(entries, table, seed)

    def assign(self, entry):
        return self.table.assign(entry["width"], entry["height"], entry["num_frames"])

    def can_fill(self, bucket):
        return self.entries.numbers("num_frames") >= bucket.frames

    def load(self, entry, bucket, rng):
        from data.media import fit_to_bucket

        clip, _ = self.generator.render(entry["synthetic_index"])
        clip = fit_to_bucket(clip, bucket.frames, bucket.height, bucket.width)
        return {"video": torch.from_numpy(clip).permute(3, 0, 1, 2).contiguous()}


class LatentDataset(BucketedDataset):
    """Latents and prompt embeddings written by scripts/precompute_latents.py; each keeps the bucket
    it was encoded in. The stored conditioning comes as it is, under "stored" (the family pads a batch's:
    Family.load_conditioning)."""

    def assign(self, entry):
        bucket = Bucket(entry["frames"], entry["height"], entry["width"])
        if bucket not in self.table.index:
            return None, f"encoded at {bucket.name}, not a bucket of this recipe"
        return self.table.index[bucket], ""

    def load(self, entry, bucket, rng):
        from safetensors.torch import load_file

        tensors = load_file(entry["path"])
        expected = tuple(self.table.latent_shapes[self.table.index[bucket]])
        if tuple(tensors["latent"].shape) != expected:  # a stale file: replaced like an unreadable one
            raise ValueError(
                f"latent of shape {tuple(tensors['latent'].shape)}, bucket {bucket.name} needs {expected}"
            )
        stored = {k: v.float() for k, v in tensors.items() if k != "latent"}
        return {"latent": tensors["latent"].float(), "stored": stored}


def collate(samples: list[dict]) -> dict:
    """Stack the tensors of one bucket's samples; keep captions, indices and failures as lists."""
    batch = {
        key: torch.stack([s[key] for s in samples]) for key in samples[0] if torch.is_tensor(samples[0][key])
    }
    for key in ("stored", REFERENCES):  # a family's conditioning of its own length; images of their sizes
        if key in samples[0]:
            batch[key] = [s[key] for s in samples]
    batch.update(
        caption=[s["caption"] for s in samples],
        index=[s["index"] for s in samples],
        bucket=samples[0]["bucket"],
        failures=[f for s in samples for f in s["failures"]],
    )
    return batch
