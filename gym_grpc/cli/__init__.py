"""The `gym-grpc` command: a thin shell over the layers below, one module per verb group, wired in app.py."""
