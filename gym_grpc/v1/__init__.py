"""Generated stubs of the gym.v1 protocol. Do not edit: run dev/codegen.py."""
