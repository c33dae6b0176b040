"""CPU profiling of a server process with yappi, for its whole lifetime.

When `profiling_enabled` is set, each server process runs yappi (CPU clock)
from start to stop and then writes `<profiling_results_dirpath>/<name>.log`,
replacing the previous log of that server: one line per function, `name ncall
tsub ttot tavg`, sorted by `ttot`, each name as "file:line QualifiedName".
When it is off, yappi is never started and costs nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gym_grpc.v1 import admin_service_pb2 as admin_pb

log = logging.getLogger("gym_grpc.server.profiling")


def _short(path: str) -> str:
    """A file path relative to the working directory when it is under it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def table(entries: list[admin_pb.ProfileEntry]) -> str:
    """Entries as a text table with the columns name ncall tsub ttot tavg."""
    width = max([len(e.name) for e in entries] + [4])
    lines = [f"{'name':<{width}}  {'ncall':>9}  {'tsub':>10}  {'ttot':>10}  {'tavg':>10}"]
    for e in entries:
        lines.append(f"{e.name:<{width}}  {e.ncall:>9}  {e.tsub:>10.6f}  {e.ttot:>10.6f}  {e.tavg:>10.6f}")
    return "\n".join(lines) + "\n"


class Profiler:
    """yappi for one server process, or nothing when profiling is off."""

    def __init__(self, directory: str | Path | None = None, log_name: str = "server") -> None:
        self.directory = Path(directory) if directory is not None else None
        self.log_name = log_name
        self.running = False

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def start(self) -> None:
        if not self.enabled or self.running:
            return
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
        self.running = True

    def entries(self, limit: int | None = None) -> list[admin_pb.ProfileEntry]:
        """The statistics so far, by total time, highest first."""
        if not self.running:
            return []
        import yappi

        stats = yappi.get_func_stats()
        stats.sort("ttot", "desc")
        found = []
        for stat in stats:
            found.append(
                admin_pb.ProfileEntry(
                    name=f"{_short(stat.module)}:{stat.lineno} {stat.name}",
                    ncall=stat.ncall,
                    tsub=stat.tsub,
                    ttot=stat.ttot,
                    tavg=stat.tavg,
                )
            )
            if limit is not None and len(found) >= limit:
                break
        return found

    def stop(self) -> Path | None:
        """Stop profiling and write the log; its path (None when profiling was off)."""
        if not self.running:
            return None
        import yappi

        entries = self.entries()
        yappi.stop()
        self.running = False
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.log_name}.log"
        path.write_text(table(entries))
        yappi.clear_stats()
        log.info("profile written to %s", path)
        return path
