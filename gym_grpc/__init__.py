"""gym-grpc: a gRPC protocol and Python framework for LLM reinforcement-learning environments.

Write an environment by subclassing `gym_grpc.resources.ResourcesServer`;
the generated protocol messages and stubs are in `gym_grpc.v1`.
"""
