"""A verifiers 0.4 taskset written with verifiers' own public classes, served by gym-grpc.

Capital cities: each task asks for a country's capital; a per-rollout toolset
offers `capital_of(country)`, which records every lookup in the rollout's
state; the `correct` reward checks the final answer, the `looked_up` metric
reads the state the tool wrote. Nothing here knows about gym-grpc:

    gym-grpc run examples/verifiers.yaml      # taskset: examples.verifiers_taskset:CapitalsTaskset
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf
from pydantic import Field

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo"}


class CapitalsState(vf.State):
    lookups: list[str] = Field(default_factory=list)


class CapitalsData(vf.TaskData):
    country: str
    answer: str


class CapitalsToolsetConfig(vf.ToolsetConfig):
    pass


class CapitalsToolset(vf.Toolset[CapitalsToolsetConfig, CapitalsState]):
    TOOL_PREFIX = None

    @vf.tool
    async def capital_of(self, country: str) -> str:
        """Look up the capital city of a country."""
        self.state.lookups.append(country)
        capital = CAPITALS.get(country.strip().title())
        if capital is None:
            raise ValueError(f"no capital known for {country!r}")
        return capital


class CapitalsTaskConfig(vf.TaskConfig):
    tools: CapitalsToolsetConfig = CapitalsToolsetConfig()


class CapitalsTask(vf.Task[CapitalsData, CapitalsState, CapitalsTaskConfig]):
    @classmethod
    def toolsets(cls, config: CapitalsTaskConfig) -> list[vf.Toolset]:
        return [CapitalsToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.answer.lower() in trace.last_reply.lower() else 0.0

    @vf.metric
    async def looked_up(self, trace: vf.Trace) -> float:
        return float(self.data.country in trace.state.lookups)


class CapitalsTasksetConfig(vf.TasksetConfig):
    countries: list[str] = Field(default_factory=lambda: list(CAPITALS))
    task: CapitalsTaskConfig = CapitalsTaskConfig()


class CapitalsTaskset(vf.Taskset[CapitalsTask, CapitalsTasksetConfig]):
    def load(self) -> Iterator[CapitalsTask]:
        for country in self.config.countries:
            data = CapitalsData(
                name=country,
                prompt=f"What is the capital of {country}? Look it up with the tool.",
                country=country,
                answer=CAPITALS[country],
            )
            yield CapitalsTask(data, self.config.task)
