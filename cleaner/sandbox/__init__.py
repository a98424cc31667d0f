"""The Python tool's sandbox (docs/architecture.md, "Sandbox")."""

from cleaner.sandbox.config import SandboxConfig

__all__ = ["SandboxConfig"]
