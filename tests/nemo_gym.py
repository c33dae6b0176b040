"""NeMo Gym's own code, for tests that check our files with it: installed at test time, never committed.

NeMo Gym 0.7.0 needs Python 3.13 (its metadata asks for a newer patch than
pyenv's 3.13.0, hence `--ignore-requires-python`). Its full dependency set
(MLflow, Ray with its dashboard, datasets, ...) is not needed to read rollout
rows: the wheel goes in with `--no-deps`, then only what `nemo_gym.openai_utils`,
`nemo_gym.base_resources_server` and `nemo_gym.reward_profile` import. The
virtualenv is kept in the test cache (tests/corpus.py's CACHE) and built once:
about 850 MB and, with a warm pip cache, about a minute.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

from tests.corpus import CACHE, NEMO_GYM, cache_lock, nemo_gym_wheel

#: What the modules above import, at the versions they were tried with.
DEPENDENCIES = (
    "openai==2.44.0",
    "pydantic==2.14.4",
    "orjson==3.13.0",
    "requests==2.34.2",
    "aiohttp==3.14.5",
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "httptools==0.9.0",
    "itsdangerous==2.2.0",
    "omegaconf==2.3.1",
    "hydra-core==1.3.8",
    "rich==15.0.0",
    "ray==2.60.0",
    "yappi==1.7.6",
    "pydot==4.0.1",
    "pandas==3.1.1",
    "scipy==1.18.1",
    "wandb==0.31.0",
)
VENV = CACHE / f"{NEMO_GYM.replace('==', '-')}-venv"
IMPORTS = "import nemo_gym.openai_utils, nemo_gym.base_resources_server, nemo_gym.reward_profile"


def python313() -> str | None:
    """A Python 3.13 interpreter: $GYM_GRPC_PYTHON313, one on PATH that runs, or pyenv's."""
    candidates = [os.environ.get("GYM_GRPC_PYTHON313"), shutil.which("python3.13")]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.13*/bin/python3.13")))
    for candidate in filter(None, candidates):
        probe = [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 13)"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    return None


def _run(*command: str | Path) -> None:
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stderr[-3000:]}"


@cache
def nemo_gym_python(interpreter: str) -> Path:
    """The Python of a virtualenv where NeMo Gym's modules above import; built on first use."""
    python = VENV / "bin" / "python"
    ready = VENV / "ready"
    wheel = nemo_gym_wheel()
    with cache_lock("nemo-gym-venv"):
        if not ready.exists():
            shutil.rmtree(VENV, ignore_errors=True)
            _run(interpreter, "-m", "venv", VENV)
            _run(python, "-m", "pip", "install", "-q", *DEPENDENCIES)
            _run(python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python", wheel)
            _run(python, "-c", IMPORTS)
            ready.touch()
    return python
