"""The `gym-grpc` command: every verb wired in one place, and the one handler of its errors.

Each verb group lives in its own module of this package (run, collect, report,
training, status, quickstart, authoring, engine, data, envs); the work they
do lives in the layers below (launch, batch, report, datasets, ...). A verb's
module is imported when that verb runs (or `--help` lists them all), not at
every start: importing all ten took about a tenth of a second of CPU more than
importing one, on each `gym-grpc` a user or a test starts. A verb
raises what those layers raise: every gym-grpc error (`errors.FrameworkError`)
reaches `GymCommand.invoke`, which prints its public message, and any notes
a verb added for context, as one error line (exit status 1). A traceback
means a bug.
"""

from __future__ import annotations

import importlib
from typing import Any

import click
import grpc

from gym_grpc import errors
from gym_grpc.server import open_files

#: Each verb: the module of this package that defines it, and the command's name there.
VERBS = {
    "run": ("run", "run"),
    "dump-config": ("run", "dump_config_command"),
    "quickstart": ("quickstart", "quickstart"),
    "collect": ("collect", "collect_command"),
    "reverify": ("collect", "reverify_command"),
    "report": ("report", "report_command"),
    "samples": ("training", "samples_command"),
    "set-policy-version": ("training", "set_policy_version_command"),
    "update-weights": ("training", "update_weights_command"),
    "status": ("status", "status_command"),
    "profile": ("status", "profile_command"),
    "init-env": ("authoring", "init_env_command"),
    "test": ("authoring", "test_command"),
    "conformance": ("authoring", "conformance_command"),
    "engine": ("engine", "engine"),
    "prepare-data": ("data", "prepare_data_command"),
    "dataset": ("data", "dataset"),
    "envs": ("envs", "envs"),
}


def _explain(error: BaseException) -> str:
    """The error line of a gym-grpc error or a failed call: its message, then its notes."""
    if isinstance(error, grpc.aio.AioRpcError):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = str(error)
    return "\n".join([text, *getattr(error, "__notes__", ())])


class GymCommand(click.Group):
    """The top-level group: its verbs imported when used (VERBS), and what the layers raise
    turned into click's one-line errors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in VERBS:
            return None
        module, name = VERBS[cmd_name]
        command: click.Command = getattr(importlib.import_module(f"gym_grpc.cli.{module}"), name)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as e:
            if not open_files.ran_out(e):
                raise
            raise click.ClickException(open_files.explain(f"opening {e.filename}" if e.filename else "")) from None
        except (errors.FrameworkError, grpc.aio.AioRpcError) as e:
            raise click.ClickException(_explain(e)) from None


@click.group(cls=GymCommand)
@click.version_option(package_name="gym-grpc")
@click.pass_context
def main(ctx: click.Context) -> None:
    """gRPC environments for LLM reinforcement learning."""
    open_files.raise_limit(f"gym-grpc {ctx.invoked_subcommand}")
