"""`gym-grpc engine start|stop|status`: a real model on this machine's CPU (vLLM's CPU build)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from gym_grpc.launch.config import ConfigError, load_env, set_env_values

#: The env.yaml keys that configs/vllm.yaml reads: where the engine is, the tokenizer and chat
#: template it serves, with which the model server renders prompts itself, and how long the model
#: server keeps an idle connection to it (the local engine keeps one longer than vLLM's 5 s).
ENGINE_KEYS = (
    "policy_base_url",
    "policy_api_key",
    "policy_model_name",
    "policy_tokenizer_dir",
    "policy_chat_template",
    "policy_keepalive_seconds",
)


@click.group()
def engine() -> None:
    """A real model on CPU: vLLM's CPU build serving SmolLM2-135M-Instruct, for trying environments.

    `start` prepares it (the first time: a virtualenv and a model under
    ~/.cache/gym-grpc-engine, or GYM_GRPC_ENGINE_CACHE), starts it on a free
    loopback port (`--grpc`: vLLM's gRPC server), writes its run file and
    env.yaml for configs/vllm.yaml;
    `stop` and `status` find it through the run file."""


@engine.command("start")
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("env.yaml"),
    show_default=True,
    help="Where policy_base_url, policy_api_key and policy_model_name are written; its other keys are kept.",
)
@click.option(
    "--max-model-len", type=click.IntRange(min=1), default=4096, show_default=True, help="Prompt + output, in tokens."
)
@click.option(
    "--ready-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds to wait for vLLM to serve.",
)
@click.option(
    "--grpc",
    is_flag=True,
    help="Serve with vLLM's gRPC server (token ids in and out; policy_base_url grpc://...) instead of its HTTP one.",
)
def engine_start_command(env_file: Path, max_model_len: int, ready_timeout: float, grpc: bool) -> None:
    """Prepare and start the local CPU vLLM, and point env.yaml at it."""
    from gym_grpc.engines import local_vllm

    running = local_vllm.tracked()
    if running is not None:
        raise click.ClickException(
            f"a vLLM is already running at {running.base_url} (pid {running.pid}): `gym-grpc engine stop` first"
        )
    if env_file.exists():
        load_env(env_file)  # a broken env.yaml fails before vLLM starts, not after
    if not local_vllm.is_prepared():
        click.echo(
            f"first start: building vLLM's CPU virtualenv and the model in {local_vllm.cache_dir()} "
            f"(about 1 GB to download, 3.5 GB on disk, 2-3 minutes; later starts reuse them)",
            err=True,
        )
    prepared = local_vllm.prepare()
    click.echo(f"starting vLLM with {prepared.model_name} on CPU (about 30 s, more on a busy machine)", err=True)
    began = time.monotonic()
    started = local_vllm.start_tracked(prepared, ready_timeout=ready_timeout, max_model_len=max_model_len, grpc=grpc)
    click.echo(
        f"vLLM serves {started.model} at {started.base_url} (pid {started.pid}) after {time.monotonic() - began:.0f} s"
    )
    click.echo(f"log: {started.log_path}")
    served = (
        started.base_url,
        "EMPTY",
        started.model,
        str(prepared.model_dir),
        str(local_vllm.CHAT_TEMPLATE),
        str(local_vllm.CLIENT_KEEPALIVE_SECONDS),
    )
    values = dict(zip(ENGINE_KEYS, served, strict=True))
    try:
        kept = set_env_values(env_file, values)
    except ConfigError as e:
        e.add_note(f"vLLM is running; set {', '.join(ENGINE_KEYS)} yourself")
        raise
    comments = (
        "other keys and comments kept" if kept else "other keys kept, comments dropped: the file's layout was not plain"
    )
    click.echo(f"wrote {', '.join(ENGINE_KEYS)} to {env_file} ({comments})")
    env_arg = "" if env_file == Path("env.yaml") else f" --env-file {env_file}"
    click.echo(
        f"next:\n"
        f"  gym-grpc run{env_arg} configs/vllm.yaml servers/resources/weather/config.yaml\n"
        f"  gym-grpc collect --agent weather_agent --input servers/resources/weather/data/example.jsonl "
        f"--output weather_vllm.jsonl --limit 5 temperature=0 max_output_tokens=256\n"
        f"  gym-grpc engine stop"
    )


@engine.command("stop")
def engine_stop_command() -> None:
    """Stop the engine that `gym-grpc engine start` wrote in its run file."""
    from gym_grpc.engines import local_vllm

    click.echo(local_vllm.stop_tracked())


@engine.command("status")
def engine_status_command() -> None:
    """Whether the tracked engine runs: its base URL, pid, model and log (exit status 1 when it does not run)."""
    from gym_grpc.engines import local_vllm

    running = local_vllm.tracked()
    if running is None:
        try:
            stale = local_vllm.read_run_file()
        except local_vllm.RunFileError as e:
            stale, why = None, f" ({e})"
        else:
            why = f" (the run file of pid {stale.pid} is stale)" if stale is not None else ""
        click.echo(f"not running{why}; start it with `gym-grpc engine start`")
        sys.exit(1)
    click.echo(
        f"running\nbase_url: {running.base_url}\npid: {running.pid}\nmodel: {running.model}\nlog: {running.log_path}"
    )
    click.echo(f"run file: {local_vllm.run_file_path()}")
