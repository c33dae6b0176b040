"""Sandboxes that live for a session: the provider interface, bubblewrap, the fleet, and the environment base.

docs/sandboxes.md is the guide. (gym_grpc.sandbox, singular, is code_exec's: one program per check.)
"""

from .environment import SandboxEnvironment, SandboxSettings
from .fleet import SandboxFleet
from .provider import CommandResult, FileEntry, Sandbox, SandboxError, SandboxProvider, SandboxSpec

__all__ = [
    "CommandResult",
    "FileEntry",
    "Sandbox",
    "SandboxEnvironment",
    "SandboxError",
    "SandboxFleet",
    "SandboxProvider",
    "SandboxSettings",
    "SandboxSpec",
]
