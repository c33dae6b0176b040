"""What several verbs share: their options, free-argument checks, and reaching a running registry."""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from gym_grpc import errors
from gym_grpc.client.stubs import AdminClient
from gym_grpc.data.jsonl import count_rows
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security, TlsSettings

T = TypeVar("T")


def no_unknown_options(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """Refuse a mistyped option among the free arguments (configs, KEY=VALUE overrides),
    with click's did-you-mean: `--num-repeat 4` must not become an override or a path."""
    for value in values:
        if value.startswith("-") and value != "-":
            name = value.split("=", 1)[0]
            known = [opt for p in ctx.command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")]
            raise click.NoSuchOption(name, possibilities=difflib.get_close_matches(name, known), ctx=ctx)
    return values


def split_args(args: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """CONFIG files and KEY=VALUE overrides, in their order; at least one file."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if not files:
        raise click.UsageError("give at least one config file")
    return files, overrides


def given(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The options among `names` that the command line (not a default) set, as the user typed them."""
    found = []
    for name in names:
        if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT):
            param = next(p for p in ctx.command.params if p.name == name)
            found.append(param.opts[0])
    return found


env_file_option = click.option(
    "--env-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Secrets and variables, merged after the configs.  [default: ./env.yaml if it exists]",
)
registry_option = click.option(
    "--registry", default="127.0.0.1:50050", show_default=True, help="Registry of a `gym-grpc run`."
)
window_option = click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    help="Run exactly this many at once (with collect --admission engine: at most this many, default 256).  "
    "[default: as many as end well within --timeout, up to 4,096]",
)


def _reward_range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter("expected MIN,MAX such as 0,1") from None
    return low, high


range_option = click.option(
    "--reward-range",
    default="0,1",
    show_default=True,
    callback=_reward_range,
    help="Warn about rewards outside MIN,MAX.",
)
threshold_option = click.option(
    "--pass-threshold",
    type=float,
    default=1.0,
    show_default=True,
    help="A rollout passes (for pass@k) when its reward is at least this.",
)
progress_option = click.option("--no-progress", is_flag=True, help="No progress bar.")


def security_options(command: Callable) -> Callable:
    """--ca/--cert/--key/--server-name/--token (or GYM_GRPC_CA, ... in the environment) as `security`."""
    options = [
        click.option(
            "--ca",
            envvar="GYM_GRPC_CA",
            type=click.Path(exists=True, dir_okay=False),
            help="CA certificate of the servers (TLS).  [env: GYM_GRPC_CA]",
        ),
        click.option(
            "--cert",
            envvar="GYM_GRPC_CERT",
            type=click.Path(exists=True, dir_okay=False),
            help="Client certificate (mutual TLS).  [env: GYM_GRPC_CERT]",
        ),
        click.option(
            "--key",
            envvar="GYM_GRPC_KEY",
            type=click.Path(exists=True, dir_okay=False),
            help="Client private key (mutual TLS).  [env: GYM_GRPC_KEY]",
        ),
        click.option(
            "--server-name",
            envvar="GYM_GRPC_SERVER_NAME",
            help="Name in the servers' certificates, if not their host.  [env: GYM_GRPC_SERVER_NAME]",
        ),
        click.option(
            "--token",
            envvar="GYM_GRPC_TOKEN",
            help="Bearer token; prefer the environment variable.  [env: GYM_GRPC_TOKEN]",
        ),
    ]

    @functools.wraps(command)
    def wrapper(
        *args: Any,
        ca: str | None,
        cert: str | None,
        key: str | None,
        server_name: str | None,
        token: str | None,
        **kwargs: Any,
    ) -> Any:
        tls = TlsSettings(ca=ca, cert=cert, key=key, server_name=server_name) if ca or cert or key else None
        return command(*args, security=Security(tls=tls, token=token), **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


@contextlib.asynccontextmanager
async def connect(address: str, security: Security | None, name: str | None = None) -> AsyncIterator[Registry]:
    """A Registry client, once it answers (and knows `name`, and that server speaks our protocol's
    major version); an error that cannot reach it says where `gym-grpc run` was looked for."""
    registry = Registry(address, security=security)
    try:
        try:
            await registry.list()
            if name:
                await registry.info(name)
                await AdminClient(registry, name).check_protocol()
        except (errors.OutOfFiles, errors.IncompatibleServer):
            raise
        except errors.GymError as e:
            e.add_note(f"(is `gym-grpc run` up with its registry at {address}?)")
            raise
        yield registry
    finally:
        await registry.close()


async def with_registry(
    address: str,
    name: str | None,
    work: Callable[[Registry], Awaitable[T]],
    security: Security | None = None,
    *,
    rows: Path | None = None,
) -> T:
    """Run `work` against the registry of a `gym-grpc run`, checking first that it answers (see
    `connect`). An input file of `rows` with none needs no servers: nothing is checked."""
    if rows is not None and not count_rows(rows, limit=1):
        registry = Registry(address, security=security)
        try:
            return await work(registry)
        finally:
            await registry.close()
    async with connect(address, security, name) as registry:
        return await work(registry)
