"""gym-grpc: a gRPC protocol and Python framework for LLM reinforcement-learning environments.

Write an environment by subclassing `gym_grpc.resources.ResourcesServer`;
the generated protocol messages and stubs are in `gym_grpc.v1`.
"""

import os

# gRPC core ships with its fork handlers switched on while gRPC Python treats them
# as off (grpc/grpc#41455). With both, a child forked while another thread is in
# gRPC restarts gRPC's threads before it execs and aborts about one time in ten
# ("Check failed: next_worker->state == KICKED"). Ray forks this way to start its
# raylet, so `ray.init` from a serving process failed at random. gym-grpc forks only
# to exec (subprocess, multiprocessing's spawn, Ray), the case gRPC's fork-support
# docs say to turn the handlers off for; a value the user set is kept. gRPC reads it when it is
# imported: a program that imports grpc before gym_grpc keeps gRPC's default.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
