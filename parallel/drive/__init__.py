"""Driving train.py and infer.py: a family's training step and its sampling across the layout (and the
DiT's loader for the scripts that sample it directly)."""
