"""python -m gym_grpc.local_vllm prepare | start | stop — the local CPU vLLM from a shell.

    python -m gym_grpc.local_vllm prepare   # build or reuse the virtualenv and the model
    python -m gym_grpc.local_vllm start     # prints the engine as JSON: base_url, pid, log_path, model
    python -m gym_grpc.local_vllm stop      # stops the one `start` recorded (or --pid PID)

`start` records the engine in CACHE/run/vllm.json and leaves it running;
`stop` checks that the PID is still a vLLM before signalling it, so a stale
record never ends an unrelated process that reused the PID.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gym_grpc.local_vllm.installation import PrepareError, cache_dir, prepare
from gym_grpc.local_vllm.process import EngineStartError, start, stop


def _record() -> Path:
    return cache_dir() / "run" / "vllm.json"


def _is_vllm(pid: int) -> bool:
    try:
        return b"vllm.entrypoints" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _recorded_engine() -> dict | None:
    """The engine `start` recorded, if its process is still a running vLLM."""
    try:
        recorded = json.loads(_record().read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded.get("pid"), int) and _is_vllm(recorded["pid"]) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gym_grpc.local_vllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="build or reuse the engine's virtualenv and model")
    starting = commands.add_parser("start", help="start vLLM, wait until it serves, print it as JSON")
    starting.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    starting.add_argument("--max-model-len", type=int, default=4096)
    stopping = commands.add_parser("stop", help="stop the recorded vLLM, or --pid")
    stopping.add_argument("--pid", type=int, help="the PID that start printed")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            began = time.monotonic()
            prepared = prepare()
            print(f"prepared in {time.monotonic() - began:.1f} s: {prepared.python}, {prepared.model_dir}")
        elif args.command == "start":
            running = _recorded_engine()
            if running is not None:
                print(
                    f"a vLLM is already running at {running['base_url']} (pid {running['pid']}): stop it first",
                    file=sys.stderr,
                )
                return 1
            began = time.monotonic()
            engine = start(ready_timeout=args.ready_timeout, max_model_len=args.max_model_len)
            _record().parent.mkdir(parents=True, exist_ok=True)
            _record().write_text(engine.to_json())
            print(engine.to_json())
            print(f"[engine] serving at {engine.base_url} after {time.monotonic() - began:.1f} s", file=sys.stderr)
        else:
            pid = args.pid
            if pid is None:
                try:
                    pid = json.loads(_record().read_text())["pid"]
                except FileNotFoundError:
                    print(f"no engine recorded in {_record()}: nothing to stop", file=sys.stderr)
                    return 0
                except (OSError, ValueError, KeyError) as e:
                    print(f"cannot read {_record()} ({e}); give --pid", file=sys.stderr)
                    return 1
            if not _is_vllm(pid):
                print(f"process {pid} is not a running vLLM: nothing to stop", file=sys.stderr)
            else:
                stop(pid)
                print(f"stopped vLLM (pid {pid})", file=sys.stderr)
            if args.pid is None:
                _record().unlink(missing_ok=True)
    except (PrepareError, EngineStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
