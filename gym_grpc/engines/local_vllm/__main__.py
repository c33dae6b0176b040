"""python -m gym_grpc.engines.local_vllm prepare | start | stop — the local CPU vLLM from a shell.

    python -m gym_grpc.engines.local_vllm prepare   # build or reuse the virtualenv and the model
    python -m gym_grpc.engines.local_vllm start     # prints the engine as JSON: base_url, pid, log_path, model
    python -m gym_grpc.engines.local_vllm start --grpc  # vLLM's gRPC server instead (base_url grpc://host:port)
    python -m gym_grpc.engines.local_vllm start --vision  # a vision-language model (vision_model.py) instead
    python -m gym_grpc.engines.local_vllm start --kv-cache-blocks 32 --max-model-len 1024  # a small KV cache
    python -m gym_grpc.engines.local_vllm stop      # stops the one `start` wrote in its run file (or --pid PID)

`start` writes the engine's run file, CACHE/run/vllm.json (or GYM_GRPC_ENGINE_RUN_FILE),
and leaves it running; `stop` checks that the PID is still a vLLM before
signalling it, so a stale run file never ends an unrelated process that reused
the PID. `gym-grpc engine start|stop|status` does the same through the same
functions (gym_grpc.engines.local_vllm.run_file), and writes env.yaml.
"""

from __future__ import annotations

import argparse
import sys
import time

from gym_grpc.engines.local_vllm.installation import PrepareError, prepare
from gym_grpc.engines.local_vllm.process import Capacity, EngineStartError
from gym_grpc.engines.local_vllm.run_file import RunFileError, start_tracked, stop_tracked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gym_grpc.engines.local_vllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    preparing = commands.add_parser("prepare", help="build or reuse the engine's virtualenv and model")
    preparing.add_argument("--vision", action="store_true", help="and the vision-language model (vision_model.py)")
    starting = commands.add_parser("start", help="start vLLM, wait until it serves, print it as JSON")
    starting.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    starting.add_argument("--max-model-len", type=int, default=4096)
    starting.add_argument("--port", type=int, help="serve on this port (default: a free one)")
    starting.add_argument("--grpc", action="store_true", help="vLLM's gRPC server, not its HTTP one")
    starting.add_argument("--vision", action="store_true", help="serve the vision-language model (vision_model.py)")
    starting.add_argument(
        "--kv-cache-blocks", type=int, help="KV cache size in blocks of 128 tokens (vLLM's --num-gpu-blocks-override)"
    )
    starting.add_argument("--max-num-seqs", type=int, help="most requests in one batch (vLLM's --max-num-seqs)")
    starting.add_argument(
        "--otlp-traces-endpoint",
        help="send the spans of its requests to this OTLP collector (vLLM's option; docs/observability.md#traces)",
    )
    stopping = commands.add_parser("stop", help="stop the tracked vLLM, or --pid")
    stopping.add_argument("--pid", type=int, help="the PID that start printed")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            began = time.monotonic()
            prepared = prepare(vision=args.vision)
            print(f"prepared in {time.monotonic() - began:.1f} s: {prepared.python}, {prepared.model_dir}")
        elif args.command == "start":
            began = time.monotonic()
            engine = start_tracked(
                prepare(vision=True) if args.vision else None,
                ready_timeout=args.ready_timeout,
                max_model_len=args.max_model_len,
                port=args.port,
                grpc=args.grpc,
                capacity=Capacity(args.kv_cache_blocks, args.max_num_seqs),
                extra_args=["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else (),
            )
            print(engine.to_json())
            print(f"[engine] serving at {engine.base_url} after {time.monotonic() - began:.1f} s", file=sys.stderr)
        else:
            print(stop_tracked(args.pid), file=sys.stderr)
    except RunFileError as e:
        print(f"error: {e}; give --pid", file=sys.stderr)
        return 1
    except (PrepareError, EngineStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
