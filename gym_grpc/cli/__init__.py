"""The `gym-grpc` command: configuration, `run`, `status`, `prepare-data`, `init-env`."""
