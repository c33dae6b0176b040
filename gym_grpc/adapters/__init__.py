"""Training frameworks' own environment interfaces over gym-grpc servers.

Each adapter is its own module and needs its framework, installed with the
extra of the same name; importing one without it raises an ImportError that
names the extra:

- `gym_grpc.adapters.skyrl` (`pip install 'gym-grpc[skyrl]'`): any gym-grpc
  resources server as a SkyRL-Gym text environment, registered as "gym-grpc".
- `gym_grpc.adapters.verifiers` (`pip install 'gym-grpc[verifiers]'`): a
  gym-grpc resources server as a verifiers taskset, and a verifiers taskset
  served as a gym-grpc resources server.
"""

from __future__ import annotations


def missing_extra(framework: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError an adapter raises when its framework is not installed."""
    return ImportError(
        f"this adapter needs {framework} ({error.name or error}): pip install 'gym-grpc[{extra}]'",
        name=error.name,
    )
