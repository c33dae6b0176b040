"""python -m gym_grpc.protos DIR: copy the shipped .proto files into DIR."""

from __future__ import annotations

import argparse
from pathlib import Path

from gym_grpc import protos


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gym_grpc.protos",
        description="Copy the gym.v1 .proto files (with the health, reflection and google.rpc ones "
        "they go with) into DIR, to generate a client in another language.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR")
    args = parser.parse_args()
    for path in protos.copy_to(args.directory):
        print(path)


if __name__ == "__main__":
    main()
