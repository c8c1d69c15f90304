"""Imported by the entry points before torch loads. PyTorch's C++ warnings each carry a dozen stack
frames, and when a node is lost every failed store call logs one: they would bury the `error:` line
that names the cause. TORCH_CPP_LOG_LEVEL is read once, when torch loads; a value set by the user is
kept (TORCH_CPP_LOG_LEVEL=WARNING shows them again). C++ errors are still printed."""

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
