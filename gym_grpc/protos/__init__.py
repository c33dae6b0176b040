"""The .proto files a client in another language needs, shipped inside the package.

    python -m gym_grpc.protos DIR     # copy them into DIR, then: protoc -I DIR ...

`gym/v1/*.proto` is the protocol (dev/codegen.py copies it here from proto/).
Beside it, as their projects publish them: `grpc/health/v1/health.proto` and
`grpc/reflection/v1/reflection.proto` (gRPC's grpc-proto), which every server
serves, and `google/rpc/status.proto` and `error_details.proto` (googleapis),
for the `google.rpc.BadRequest` detail an INVALID_ARGUMENT error carries. The
`google/protobuf/*.proto` files they import (struct, any, duration) come with
every protoc.
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: The directory that holds the tree (`gym/v1/...`, `grpc/...`, `google/rpc/...`): a protoc -I root.
ROOT = Path(__file__).resolve().parent


def files() -> list[str]:
    """Every shipped .proto, as protoc imports it ("gym/v1/task.proto"), sorted."""
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.proto"))


def copy_to(directory: Path) -> list[Path]:
    """Copy every shipped .proto into `directory` (created if need be), keeping the tree."""
    written = []
    for name in files():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
        written.append(target)
    return written
