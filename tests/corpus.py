"""Data other people produced, for tests: taken from the package registry at test
time, never committed.

NeMo Gym's wheel on PyPI (`nemo-gym==0.7.0`, Apache-2.0) ships its environments'
example tasks and recorded rollouts (real OpenAI and vLLM models) as JSONL files:
`environments/<env>/data/example.jsonl` and `example_rollouts.jsonl`, and the same
under `benchmarks/`. `pip download --no-deps` fetches the wheel (its metadata asks
for Python 3.13, hence `--ignore-requires-python`; nothing is installed) into a
cache directory (`GYM_GRPC_TEST_CACHE`, default ~/.cache/gym-grpc-tests), and the
files are read from the zip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

NEMO_GYM = "nemo-gym==0.7.0"
CACHE = Path(os.environ.get("GYM_GRPC_TEST_CACHE", Path.home() / ".cache" / "gym-grpc-tests"))


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Held while something is made in the cache: the tests run in several processes
    (pytest-xdist), and two of them must not download or build the same thing at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@cache
def nemo_gym_wheel() -> Path:
    """The NeMo Gym wheel, downloaded once into the cache."""
    name, version = NEMO_GYM.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    with cache_lock("nemo-gym-wheel"):
        found = sorted(CACHE.glob(pattern))
        if found:
            return found[0]
        command = [sys.executable, "-m", "pip", "download", "-q", NEMO_GYM, "--no-deps", "--ignore-requires-python"]
        done = subprocess.run([*command, "-d", CACHE], capture_output=True, text=True)
        found = sorted(CACHE.glob(pattern))
        assert done.returncode == 0 and found, f"could not download {NEMO_GYM} from the registry:\n{done.stderr}"
        return found[0]


def nemo_gym_files(suffix: str) -> list[str]:
    """Names of the JSONL files in the wheel that end with `suffix` ("example.jsonl", "example_rollouts.jsonl")."""
    with zipfile.ZipFile(nemo_gym_wheel()) as wheel:
        return sorted(n for n in wheel.namelist() if n.endswith("/" + suffix))


def nemo_gym_lines(suffix: str) -> Iterator[tuple[str, int, bytes]]:
    """(file, line number, raw line) of every non-blank line of the wheel's files ending with `suffix`."""
    with zipfile.ZipFile(nemo_gym_wheel()) as wheel:
        for name in nemo_gym_files(suffix):
            for number, line in enumerate(wheel.read(name).splitlines(), 1):
                if line.strip():
                    yield name, number, line


def nemo_gym_file(name: str) -> bytes:
    """One file of the wheel, by its path inside it ("environments/pi_math/data/example.jsonl")."""
    with zipfile.ZipFile(nemo_gym_wheel()) as wheel:
        return wheel.read(name)
