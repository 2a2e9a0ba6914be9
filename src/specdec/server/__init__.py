"""OpenAI-compatible HTTP server over a specdec ``Engine`` (see docs/server.md)."""

from specdec.server.app import create_app
from specdec.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
