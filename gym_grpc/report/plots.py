"""`gym-grpc report --png DIR / --html FILE`: the report's plots, drawn by matplotlib.

Three figures, each with a line or bars per agent and file: the reward
histogram, the pass@k curve, and throughput over time (rollouts finished per
second, from each rollout's `response.created_at`, since the first). The HTML
page holds the text report and the figures, embedded, in one file to share.

matplotlib is an extra (`pip install 'gym-grpc[report]'`): the terminal report
needs nothing more than gym-grpc.
"""

from __future__ import annotations

import base64
import bisect
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gym_grpc.errors import ConfigError
from gym_grpc.report import text
from gym_grpc.report.stats import FileReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The figures, by the name of their PNG file.
FIGURES = ("reward_histogram", "pass_at_k", "throughput")


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'gym-grpc[report]'") from None
    return Figure


def _series(reports: Sequence[FileReport]) -> list[tuple[str, FileReport, str]]:
    """(legend label, file, agent) of every agent of every file."""
    several = len(reports) > 1
    names = text.file_names(reports)
    return [
        (f"{agent} ({name})" if several else agent, report, agent)
        for name, report in zip(names, reports, strict=True)
        for agent in report.agents
    ]


def _reward_histogram(figure: Figure, reports: Sequence[FileReport]) -> None:
    axes = figure.subplots()
    series = [(label, list(report.agents[agent].rewards)) for label, report, agent in _series(reports)]
    series = [(label, rewards) for label, rewards in series if rewards]
    if series:
        low = min(min(rewards) for _, rewards in series)
        high = max(max(rewards) for _, rewards in series)
        bins = 20 if high > low else 1
        axes.hist(
            [rewards for _, rewards in series],
            bins=bins,
            range=(low, high) if high > low else (low - 0.5, low + 0.5),
            label=[label for label, _ in series],
        )
        axes.legend()
    axes.set(title="Reward", xlabel="reward", ylabel="rollouts")


def _pass_at_k(figure: Figure, reports: Sequence[FileReport], threshold: float) -> None:
    """pass@k against k, on a log-2 axis once k reaches 8."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axes = figure.subplots()
    top = 0
    for label, report, agent in _series(reports):
        curve = report.agents[agent].pass_curve(threshold)
        if curve:
            axes.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=label)
            top = max(top, max(curve))
    axes.set(title=f"pass@k (pass: reward ≥ {threshold:g})", xlabel="k", ylabel="pass@k", ylim=(0, 1.02))
    if top >= 8:
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if axes.lines:
        axes.legend(loc="lower right")


def _throughput(figure: Figure, reports: Sequence[FileReport]) -> None:
    """Rollouts ended per second, over a sliding window an eighth of the run long (a run of whole-second
    timestamps: at least a second), at 40 points."""
    axes = figure.subplots()
    for label, report, agent in _series(reports):
        times = sorted(report.agents[agent].finished_at)
        span = times[-1] - times[0] if times else 0.0
        if span <= 0:
            continue
        window = span / 8
        if all(t.is_integer() for t in times):
            window = max(window, 1.0)
        xs = [span * i / 39 for i in range(40)]
        rates = []
        for x in xs:
            low, high = max(x - window / 2, 0.0), min(x + window / 2, span)
            ended = bisect.bisect_right(times, times[0] + high) - bisect.bisect_left(times, times[0] + low)
            rates.append(ended / (high - low))
        axes.plot(xs, rates, label=label)
    axes.set(title="Throughput", xlabel="seconds since the first rollout ended", ylabel="rollouts/s")
    axes.set_ylim(bottom=0)
    if axes.lines:
        axes.legend()


def figures(reports: Sequence[FileReport], threshold: float) -> dict[str, Figure]:
    """The report's figures by name (FIGURES)."""
    figure_class = _figure_class()
    made = {name: figure_class(figsize=(7, 4), layout="constrained") for name in FIGURES}
    _reward_histogram(made["reward_histogram"], reports)
    _pass_at_k(made["pass_at_k"], reports, threshold)
    _throughput(made["throughput"], reports)
    return made


def write_png(reports: Sequence[FileReport], threshold: float, directory: Path) -> list[Path]:
    """The figures as DIRECTORY/<name>.png (the directory is made); the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in figures(reports, threshold).items():
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def write_html(reports: Sequence[FileReport], threshold: float, path: Path) -> None:
    """One self-contained page: the text report with every task, and the figures."""
    images = []
    for name, figure in figures(reports, threshold).items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        data = base64.b64encode(buffer.getvalue()).decode()
        images.append(f'<img alt="{name}" src="data:image/png;base64,{data}">')
    title = "gym-grpc report: " + ", ".join(html.escape(str(report.path)) for report in reports)
    body = html.escape(text.render(reports, threshold, tasks=True))
    path.write_text(
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title>\n'
        "<style>body{font-family:sans-serif;margin:2em} pre{font-size:13px} img{display:block;margin:1em 0}</style>"
        f"</head>\n<body><h1>{title}</h1>\n{''.join(images)}\n<pre>{body}</pre>\n</body></html>\n",
        encoding="utf-8",
    )
