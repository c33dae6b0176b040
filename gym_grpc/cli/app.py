"""The `gym-grpc` command: every verb wired in one place, and the one handler of its errors.

Each verb group lives in its own module of this package (run, collect, report,
training, status, quickstart, authoring, engine, data, envs); the work they
do lives in the layers below (launch, batch, report, datasets, ...). A verb
raises what those layers raise: every gym-grpc error (`errors.FrameworkError`)
reaches `GymCommand.invoke`, which prints its public message, and any notes
a verb added for context, as one error line (exit status 1). A traceback
means a bug.
"""

from __future__ import annotations

from typing import Any

import click
import grpc

from gym_grpc import errors
from gym_grpc.cli import authoring, collect, data, engine, envs, quickstart, report, run, status, training
from gym_grpc.server import open_files


def _explain(error: BaseException) -> str:
    """The error line of a gym-grpc error or a failed call: its message, then its notes."""
    if isinstance(error, grpc.aio.AioRpcError):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = str(error)
    return "\n".join([text, *getattr(error, "__notes__", ())])


class GymCommand(click.Group):
    """The top-level group: turns what the layers raise into click's one-line errors."""

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


for command in (
    run.run,
    run.dump_config_command,
    quickstart.quickstart,
    collect.collect_command,
    collect.reverify_command,
    report.report_command,
    training.samples_command,
    training.set_policy_version_command,
    training.update_weights_command,
    status.status_command,
    status.profile_command,
    authoring.init_env_command,
    authoring.test_command,
    authoring.conformance_command,
    engine.engine,
    data.prepare_data_command,
    data.dataset,
    envs.envs,
):
    main.add_command(command)
