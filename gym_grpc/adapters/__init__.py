"""Training frameworks over gym-grpc servers, and their environments in gym-grpc.

Each adapter is its own module and needs its framework; this package imports
none of them, so `import gym_grpc.adapters` works without. Importing an
adapter without its framework raises an ImportError that says what to install:

- `gym_grpc.adapters.skyrl` (`pip install 'gym-grpc[skyrl]'`): any gym-grpc
  resources server as a SkyRL-Gym text environment, registered as "gym-grpc".
- `gym_grpc.adapters.gymnasium_env` (`pip install 'gym-grpc[gymnasium]'`):
  any gym-grpc resources server as a `gymnasium.Env`, registered as
  "gym_grpc/Env-v0". It and the SkyRL adapter play the same episode,
  `gym_grpc.adapters.text_episode` (which needs no framework).
- `gym_grpc.adapters.verifiers` (`pip install 'gym-grpc[verifiers]'`): a
  gym-grpc resources server as a verifiers taskset, and a verifiers taskset
  served as a gym-grpc resources server.
- `gym_grpc.adapters.trl`: TRL GRPOTrainer's `rollout_func` and a reward
  function over a running gym-grpc agent.
- `gym_grpc.adapters.openenv_server`: a gym-grpc resources server served to
  OpenEnv clients over OpenEnv's HTTP/WebSocket protocol (no extra: aiohttp).
- `gym_grpc.adapters.tinker`: tinker-cookbook's RL `Env` and `EnvGroupBuilder`
  over a resources server's sessions.

The trainers (TRL, tinker-cookbook) need torch, which gym-grpc does not
install: docs/training.md says how (`.ci/trainers`).
"""

from __future__ import annotations


def missing_extra(framework: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError an adapter raises when its framework is not installed."""
    return ImportError(
        f"this adapter needs {framework} ({error.name or error}): pip install 'gym-grpc[{extra}]'",
        name=error.name,
    )
