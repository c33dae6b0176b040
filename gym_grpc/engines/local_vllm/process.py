"""Start vLLM on a free (or a given) loopback port, wait until it serves, stop it by its PID.

`grpc=True` starts vLLM's gRPC server instead of its OpenAI-compatible HTTP one (the same engine
and options; token ids in and out, see gym_grpc/engines/vllm_grpc.py); it is ready when its
standard health service answers SERVING.

vLLM takes a port number, not a bound socket, so port 0 is not possible: a
free port is picked by binding 127.0.0.1:0 and closing it, and if another
process takes it before vLLM binds it (vLLM then dies with "address already in
use"), start() picks another, a bounded number of times.

vLLM runs in its own session (process group) because it forks an engine-core
process: stop() signals the whole group it started, SIGTERM first, SIGKILL
after a grace period, so no child outlives it.

The model runs inside that engine-core process, on one thread per core but one. vLLM's CPU
backend would run it in a worker process of its own, and the engine core waits for each step of
that worker by spinning on shared memory (sched_yield in a loop, for up to a second after each
read): a second core kept busy for every core that generates. On two cores that halved the
speed of two engines side by side, and doubled an engine's CPU (bench/local_engine.py). vLLM's
uniprocess executor avoids it; its CPU platform allows it only with VLLM_ENABLE_V1_MULTIPROCESSING
off, which its OpenAI and gRPC servers do not read: their engine core still runs in a process of
its own. `worker_process=True` starts vLLM's own layout instead, to compare.

vLLM's processes talk over ZeroMQ sockets that it makes in VLLM_RPC_BASE_PATH (the
system's temporary directory unless told), several per start, and it does not remove
them when it stops: a machine that starts engines all day collects thousands. Each
engine started here gets a directory of its own for them (unless VLLM_RPC_BASE_PATH
is set), which stop() removes once the engine has ended, with those of engines that
ended without a stop() (killed with their owner, say).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.engines.local_vllm.installation import Prepared, cache_dir, prepare
from gym_grpc.engines.settings import GRPC_SCHEME
from gym_grpc.rpc import ports

CHAT_TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
# Without these vLLM reaches for the Hub, and reserves 4 GiB for its KV cache on CPU.
_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# The gRPC server's warm-up runs 75 prefills (minutes on a CPU) to tune GPU kernels: not here.
_GRPC_ENV = {"SMG_VLLM_SERVICER_WARMUP": "off"}
#: Seconds the local HTTP engine keeps an idle connection open (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
#: 5 s by default): longer than a trainer's step, so that the batch after it finds the last batch's
#: connections open instead of opening one a rollout (0.1-0.15 ms of a model server's CPU each).
KEEPALIVE_SECONDS = 300
#: What a model server of the local engine keeps them for (its keepalive_seconds): under the engine's,
#: so that it never sends a request on a connection the engine is closing.
CLIENT_KEEPALIVE_SECONDS = KEEPALIVE_SECONDS - 10
# The HTTP server's RL control API (pause, resume, reload weights: ModelService.UpdateWeights) is
# served only in vLLM's dev mode. It is on loopback here; an engine reachable by others needs care.
_HTTP_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEPALIVE_SECONDS)}
#: The model inside the engine core (see the module's docstring).
_IN_PROCESS_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_IN_PROCESS_WORKER_ARGS = ("--distributed-executor-backend", "uni")
_ADDRESS_IN_USE = ("address already in use", "failed to bind")
#: The name of an engine's directory for its sockets, in the temporary directory: this, then random
#: characters. It holds a file "pid", the engine's PID, once the engine is started. Short: a Unix
#: socket's path has at most 107 bytes, and vLLM's are this directory and a UUID.
_SOCKETS_PREFIX = "gym-vllm-"


class EngineStartError(errors.FrameworkError, RuntimeError):
    """vLLM died or did not answer in time; the message quotes the end of its log."""

    reason = errors.Reason.ENGINE_START_FAILED


@dataclasses.dataclass(frozen=True)
class Engine:
    """A running vLLM: where it answers, its PID (also its process group) and its log."""

    base_url: str  # ends with /v1, as OpenAI clients and gym-grpc's engine settings want it; or grpc://host:port
    pid: int
    log_path: Path
    model: str

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "log_path": str(self.log_path)})


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _answers(url: str) -> bool:
    """Whether the engine serves: GET /v1/models answers 200, or its gRPC health says SERVING."""
    if url.startswith(GRPC_SCHEME):
        with grpc.insecure_channel(url.removeprefix(GRPC_SCHEME)) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _prune(logs: Path, keep: int) -> None:
    """Delete all but the newest `keep` logs of earlier starts (the names sort by time)."""
    for old in sorted(logs.glob("vllm-*.log"))[:-keep]:
        old.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """How much the engine holds at once, when it should hold less than vLLM's defaults: to make its
    KV cache fill (and preempt) at a load a CPU can serve, as the admission benchmark does.

    `kv_cache_blocks`: the KV cache's size in blocks (vLLM's --num-gpu-blocks-override; a block
    is 128 tokens on vLLM 0.32's CPU backend, and the cache must hold one max_model_len request).
    `max_num_seqs`: the most requests in one batch (vLLM's --max-num-seqs)."""

    kv_cache_blocks: int | None = None
    max_num_seqs: int | None = None

    def args(self) -> list[str]:
        args = []
        if self.kv_cache_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.kv_cache_blocks)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        return args


#: vLLM's own defaults.
DEFAULTS = Capacity()


def _command(
    prepared: Prepared,
    port: int,
    max_model_len: int,
    grpc: bool = False,
    capacity: Capacity = DEFAULTS,
    worker_process: bool = False,
) -> list[str]:
    server = "vllm.entrypoints.launchers.grpc_server" if grpc else "vllm.entrypoints.openai.api_server"
    # The HTTP server's own options: the gRPC one takes token ids, and neither renders nor parses.
    # --enable-scale-out serves /inference/v1/generate (ids in and out, each token's weight version).
    chat = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(CHAT_TEMPLATE)]
    chat.append("--enable-scale-out")
    return [
        str(prepared.python),
        "-m",
        server,  # the `vllm` command fails under the vllm-cpu name
        "--model",
        str(prepared.model_dir),
        "--served-model-name",
        prepared.model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        # vLLM 0.32's CPU runner crashes its engine core ("CPU Generator does not use offset") when a
        # request with a seed is prefilled in chunks, which happens as soon as concurrent prompts
        # exceed one step's token budget: whole prefills only, with a budget that holds the longest.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(max(max_model_len, 8192)),
        "--max-model-len",
        str(max_model_len),
        *([] if grpc else chat),
        *capacity.args(),
        *([] if worker_process else _IN_PROCESS_WORKER_ARGS),
    ]


def _threads() -> int:
    """The model's threads in the engine core: one per core this process may run on, but one, as
    vLLM's own layout binds its worker (VLLM_CPU_OMP_THREADS_BIND=auto reserves a core for the rest);
    at least one."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def die_with_parent() -> None:
    """For `preexec_fn` (Linux): the child gets SIGTERM when the process that started it dies, even by
    SIGKILL, when no `finally` runs. A test session killed on a time-out leaves no 3 GB engine behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


_PR_SET_PDEATHSIG = 1


def start(
    prepared: Prepared | None = None,
    *,
    log_path: Path | None = None,
    ready_timeout: float = 600.0,
    max_model_len: int = 4096,
    port_attempts: int = 3,
    port: int | None = None,
    tied: bool = False,
    grpc: bool = False,
    extra_args: Sequence[str] = (),
    capacity: Capacity = DEFAULTS,
    worker_process: bool = False,
) -> Engine:
    """Start vLLM and return once GET /v1/models answers (with `grpc`, its gRPC server, once its health
    answers SERVING); raise EngineStartError if it dies or times out. `extra_args`: more options for
    vLLM's server (`--otlp-traces-endpoint URL`, say).

    With `port` (say, an engine's again after a restart) vLLM binds that port or fails: a
    port in use is an error, not a reason to try another. `tied`: the engine ends when this
    process does (see die_with_parent); `gym-grpc engine start` leaves it running instead.
    `capacity`: a smaller KV cache or batch than vLLM's defaults (Capacity). `worker_process`: the
    model in a worker process of its own, vLLM's layout on CPU, not in the engine core (see the
    module's docstring)."""
    prepared = prepared or prepare()
    if port is not None:
        port_attempts = 1
    if log_path is None:
        logs = cache_dir() / "logs"
        _prune(logs, keep=9)
        log_path = logs / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, port_attempts + 1):
        bound = port if port is not None else ports.free_port()
        env = {**os.environ, **_ENV, **(_GRPC_ENV if grpc else _HTTP_ENV)}
        if not worker_process:
            env.update(_IN_PROCESS_WORKER_ENV)
            env.setdefault("OMP_NUM_THREADS", str(_threads()))
        sockets = None
        if "VLLM_RPC_BASE_PATH" not in env:
            sockets = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix=_SOCKETS_PREFIX)
        with open(log_path, "w" if attempt == 1 else "a") as log:  # a retry keeps the failed attempt's log
            log.write(f"--- gym_grpc.engines.local_vllm: attempt {attempt}, port {bound}\n")
            log.flush()
            process = subprocess.Popen(
                [*_command(prepared, bound, max_model_len, grpc, capacity, worker_process), *extra_args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent if tied and sys.platform == "linux" else None,
            )
        if sockets is not None:
            Path(sockets, "pid").write_text(str(process.pid))
        url = f"{GRPC_SCHEME}127.0.0.1:{bound}" if grpc else f"http://127.0.0.1:{bound}/v1"
        engine = Engine(url, process.pid, log_path, prepared.model_name)
        deadline = time.monotonic() + ready_timeout
        try:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    break
                if _answers(engine.base_url):
                    return engine
                time.sleep(0.5)
        except BaseException:  # Ctrl-C while waiting: leave no 3 GB engine behind
            stop(process.pid)
            raise
        if process.poll() is None:
            stop(process.pid)
            raise EngineStartError(
                f"vLLM (pid {process.pid}) did not serve at {engine.base_url} within {ready_timeout:.0f} s; "
                f"the end of {log_path}:\n{_tail(log_path)}"
            )
        stop(process.pid)  # its engine-core child may still be alive
        if any(marker in _tail(log_path).lower() for marker in _ADDRESS_IN_USE) and attempt < port_attempts:
            continue  # another process took the port between our check and vLLM's bind
        raise EngineStartError(
            f"vLLM (pid {process.pid}) exited with status {process.returncode} before serving; "
            f"the end of {log_path}:\n{_tail(log_path)}"
        )
    raise AssertionError("unreachable")


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(pid: int, grace: float = 15.0) -> None:
    """End the vLLM started as pid (and its process group): SIGTERM, then SIGKILL after grace seconds.
    Then remove the socket directories of the engines that have ended, this one's included."""
    _end(pid, grace)
    _remove_sockets()


def _remove_sockets() -> None:
    """Remove each engine's socket directory (see the module's docstring) whose engine has ended."""
    for directory in Path(tempfile.gettempdir()).glob(_SOCKETS_PREFIX + "*"):
        try:
            pid = int((directory / "pid").read_text())
        except (OSError, ValueError):
            continue  # its engine is being started: the pid is not written yet
        if not _alive(pid):
            shutil.rmtree(directory, ignore_errors=True)


def _end(pid: int, grace: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(pid)
        if not _alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)


def _reap(pid: int) -> None:
    """Collect the exit status if pid is our child, so that it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def running(
    prepared: Prepared | None = None,
    *,
    log_path: Path | None = None,
    ready_timeout: float = 600.0,
    port: int | None = None,
    grpc: bool = False,
    extra_args: Sequence[str] = (),
) -> Iterator[Engine]:
    """A vLLM for the duration of a block (a test session): started, then stopped whatever happens,
    this process's death by a signal included."""
    engine = start(
        prepared, log_path=log_path, ready_timeout=ready_timeout, port=port, tied=True, grpc=grpc, extra_args=extra_args
    )
    try:
        yield engine
    finally:
        stop(engine.pid)
