"""The wheel carries what `pip install gym-grpc` needs to run the quickstart and
init-env with no checkout: the servers and configs, under gym_grpc.bundled.

.ci/wheel_check installs the wheel in a fresh virtualenv and runs them; here the
wheel is built and its file list checked, which is fast enough for every run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> set[str]:
    """The file names in a wheel built from a copy of the sources (no stale build/ of the checkout)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    for name in ("gym_grpc", "servers", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(work / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (work / "dist").glob("gym_grpc-*.whl")
    with zipfile.ZipFile(built) as z:
        return set(z.namelist())


def _source_files(root: str, pattern: str) -> list[str]:
    return sorted(
        str(p.relative_to(REPO)) for p in (REPO / root).rglob(pattern) if "tests" not in p.parts and p.is_file()
    )


def test_the_wheel_has_every_server_and_config_under_gym_grpc_bundled(wheel):
    expected = [
        *_source_files("servers", "*.py"),
        *_source_files("servers", "config.yaml"),
        *_source_files("servers", "*.jsonl"),
        *_source_files("configs", "*.yaml"),
    ]
    assert expected, "no servers or configs found in the checkout"
    missing = [name for name in expected if f"gym_grpc/bundled/{name}" not in wheel]
    assert missing == []


def test_the_wheel_claims_no_top_level_name_but_gym_grpc_and_leaves_the_tests_out(wheel):
    tops = {name.split("/")[0] for name in wheel if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"gym_grpc"}
    assert [name for name in wheel if "/tests/" in name] == []


def test_every_entrypoint_of_the_bundled_configs_is_a_file_in_the_wheel(wheel):
    """Relative entrypoints (`../servers/...`, `server.py:X`) resolve inside gym_grpc/bundled as in the checkout."""
    configs = [REPO / name for name in _source_files("configs", "*.yaml")]
    configs += [REPO / name for name in _source_files("servers", "config.yaml")]
    checked = 0
    for config in configs:
        text = yaml.safe_load(config.read_text())
        for spec in (text.get("servers") or {}).values():
            target = spec["entrypoint"].rpartition(":")[0]
            if target.endswith(".py"):
                resolved = (config.parent / target).resolve().relative_to(REPO)
                assert f"gym_grpc/bundled/{resolved}" in wheel, (config, spec["entrypoint"])
                checked += 1
    assert checked >= 10
