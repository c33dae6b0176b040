"""The wheel carries what `pip install gym-grpc` needs to run the quickstart and
init-env with no checkout: the servers and configs, under gym_grpc.bundled; and the
protocol's .proto files, kept once in proto/gym/v1, under gym_grpc/protos/gym/v1, from a
checkout and from an sdist alike.

.ci/wheel_check installs the wheel in a fresh virtualenv and runs them; here the
wheel is built and its file list checked, which is fast enough for every run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from gym_grpc import protos

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = sorted(p.name for p in (REPO / "proto" / "gym" / "v1").glob("*.proto"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A copy of the sources (no stale build/ of the checkout), as .ci/wheel_check copies them."""
    src = tmp_path_factory.mktemp("sources")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("gym_grpc", "servers", "configs", "proto"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _wheel_names(source: Path, dist: Path, *options: str) -> set[str]:
    """Build a wheel from `source` (a directory or an sdist) into `dist`; the file names in it."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *options, "--wheel-dir", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = dist.glob("gym_grpc-*.whl")
    with zipfile.ZipFile(built) as z:
        return set(z.namelist())


@pytest.fixture(scope="module")
def wheel(sources, tmp_path_factory) -> set[str]:
    """The file names in a wheel built from a copy of the sources."""
    return _wheel_names(sources, tmp_path_factory.mktemp("wheel"))


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
    # The servers' own test suites stay out; a terminal task's tests/ is the task's verifier (task data).
    tasks = "gym_grpc/bundled/servers/resources/terminal/tasks/"
    assert [name for name in wheel if "/tests/" in name and not name.startswith(tasks)] == []
    assert f"{tasks}python-fix-slugify/tests/test.sh" in wheel


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


def test_the_wheel_carries_the_protocol_protos_under_gym_grpc_protos(wheel):
    assert len(PROTOCOL) >= 7
    assert [name for name in PROTOCOL if f"gym_grpc/protos/gym/v1/{name}" not in wheel] == []
    assert {"gym_grpc/protos/grpc/health/v1/health.proto", "gym_grpc/protos/google/rpc/status.proto"} <= wheel


def test_an_sdist_carries_proto_and_its_wheel_ships_the_protocol_protos(sources, tmp_path):
    """setup.py maps proto/gym/v1 into the package, so the sdist must hold proto/ for its own build."""
    made = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
        cwd=sources,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    sdist = tmp_path / made.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert [name for name in PROTOCOL if f"proto/gym/v1/{name}" not in names] == []
    built = _wheel_names(sdist, tmp_path / "dist", "--no-build-isolation")
    assert [name for name in PROTOCOL if f"gym_grpc/protos/gym/v1/{name}" not in built] == []


def test_a_checkout_reads_the_protocol_protos_from_proto_their_only_copy():
    """An editable install (or PYTHONPATH=.) has no gym_grpc/protos/gym: the package reads proto/."""
    assert not (REPO / "gym_grpc" / "protos" / "gym").exists()
    assert protos.path("gym/v1/task.proto") == REPO / "proto" / "gym" / "v1" / "task.proto"
    assert [f"gym/v1/{name}" for name in PROTOCOL] == [n for n in protos.files() if n.startswith("gym/v1/")]
    assert "grpc/health/v1/health.proto" in protos.files()
