"""The testing kit's own promises: every name it exports resolves, and its checks run without pytest."""

from __future__ import annotations

import subprocess
import sys

import gym_grpc.testing as kit


def test_every_exported_name_resolves_to_its_module():
    assert sorted(kit.__all__) == sorted(kit._HOMES)
    for name in kit.__all__:
        value = getattr(kit, name)
        assert value.__module__ == f"gym_grpc.testing.{kit._HOMES[name]}", name


def test_the_checks_and_the_cli_load_without_pytest_or_the_fake_engine():
    code = (
        "import sys, gym_grpc.cli.app, gym_grpc.testing.checks; "
        "loaded = [m for m in ('pytest', 'pytest_asyncio', 'gym_grpc.testing.fake_engine') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
