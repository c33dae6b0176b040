"""`python -m gym_grpc` is the `gym-grpc` command."""

from gym_grpc.cli.app import main

main()
