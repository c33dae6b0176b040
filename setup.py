"""Which packages the wheel holds; everything else is in pyproject.toml.

Besides gym_grpc itself, the repository's servers/ and configs/ ship as
gym_grpc.bundled.servers and gym_grpc.bundled.configs (see gym_grpc/bundled),
so `pip install gym-grpc` can run the quickstart and `init-env` without a
checkout and adds no top-level `servers` package to site-packages. The
servers' tests stay out of the wheel. The protocol's .proto files, kept once in
proto/gym/v1, ship as gym_grpc/protos/gym/v1 (see gym_grpc/protos) the same way.
pyproject.toml cannot map directories found by `packages.find`, hence this file.
"""

from setuptools import find_packages, setup

SERVERS = [
    f"gym_grpc.bundled.servers{'.' + name if name else ''}"
    for name in ["", *find_packages("servers", exclude=["tests", "*.tests", "*.tests.*"])]
]

setup(
    packages=[
        *find_packages(include=["gym_grpc", "gym_grpc.*"]),
        *SERVERS,
        "gym_grpc.bundled.configs",
        "gym_grpc.protos.gym.v1",
    ],
    package_dir={
        "gym_grpc.bundled.servers": "servers",
        "gym_grpc.bundled.configs": "configs",
        "gym_grpc.protos.gym.v1": "proto/gym/v1",
    },
)
