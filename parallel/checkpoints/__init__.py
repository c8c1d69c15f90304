"""Checkpoints that never lose work: save and load (DCP), the folder on disk and its `latest` pointer, safe
reading (sizes, crc32s, DCP's metadata without running code), what a checkpoint records of its recipe."""
