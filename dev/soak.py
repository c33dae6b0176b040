"""Run the test suite N times in a row and report every failure: flaky is failing.

    python dev/soak.py 20                 # the README's suite, 20 times
    python dev/soak.py 5 -- tests/test_pauses.py -k paused   # any pytest arguments after --

Each run's failures (test id and the first line of the reason) are printed as
they happen and tallied at the end; the full output of a failed run is kept in
`--keep DIR` (default: a temporary directory, printed). Exit status 1 when any
run failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _failures(junit: Path) -> list[tuple[str, str]]:
    """(test id, first line of the reason) of each failed or erroring test in a JUnit XML report."""
    if not junit.exists():
        return [("(no report: pytest did not finish)", "")]
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            element = case.find(outcome)
            if element is not None:
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                reason = (element.get("message") or "").strip().splitlines()
                found.append((test, reason[0][:200] if reason else outcome))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=int, help="how many times to run the suite")
    parser.add_argument("--keep", type=Path, help="where to keep the output of failed runs")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="gym-grpc-soak-"))
    keep.mkdir(parents=True, exist_ok=True)
    tally: collections.Counter[str] = collections.Counter()
    failed_runs = 0
    began = time.monotonic()
    for run in range(1, args.runs + 1):
        junit = keep / f"run{run}.xml"
        started = time.monotonic()
        with open(keep / f"run{run}.log", "w") as log:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={junit}",
                    *args.pytest_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        failures = _failures(junit) if done.returncode else []
        load = os.getloadavg()[0]
        print(
            f"run {run}/{args.runs}: {'ok' if not done.returncode else f'FAILED (exit {done.returncode})'} "
            f"in {time.monotonic() - started:.0f} s, load {load:.1f}",
            flush=True,
        )
        if done.returncode:
            failed_runs += 1
            for test, reason in failures or [("(pytest failed without a failing test)", "")]:
                tally[test] += 1
                print(f"    {test}: {reason}", flush=True)
        else:
            (keep / f"run{run}.log").unlink()
            junit.unlink(missing_ok=True)
    minutes = (time.monotonic() - began) / 60
    print(f"{args.runs} runs in {minutes:.0f} min, {failed_runs} failed")
    for test, count in tally.most_common():
        print(f"  {count} x {test}")
    if failed_runs:
        print(f"output of the failed runs: {keep}")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
