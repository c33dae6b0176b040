"""Checkpoints for the weight-update tests: a copy of the engine's model with one tensor changed.

The model's safetensors are bfloat16, which numpy does not have: the tensor's bytes are read as
uint16, widened to float32 (a bfloat16 is the top half of a float32), changed, and cut back. The
header and every other byte stay as they were, so vLLM's reload_weights loads the copy in place.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

WEIGHTS = "model.safetensors"


def perturbed(model_dir: Path, directory: Path, tensor: str = "model.embed_tokens.weight", scale: float = 1.0) -> Path:
    """A copy of `model_dir` in `directory` whose `tensor` has seeded Gaussian noise added, of `scale`
    times the tensor's own standard deviation (enough to change what the model writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, directory / path.name)
    weights = directory / WEIGHTS
    with open(weights, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        entry = header[tensor]
        if entry["dtype"] != "BF16":
            raise ValueError(f"{tensor} is {entry['dtype']}, not BF16")
        start, end = entry["data_offsets"]
        f.seek(8 + size + start)
        raw = np.frombuffer(f.read(end - start), dtype=np.uint16)
        values = (raw.astype(np.uint32) << 16).view(np.float32)
        noise = np.random.default_rng(0).normal(0.0, scale * float(values.std()), values.shape).astype(np.float32)
        changed = ((values + noise).view(np.uint32) >> 16).astype(np.uint16)
        f.seek(8 + size + start)
        f.write(changed.tobytes())
    return directory
