"""Typed HTTP clients of Loom's services, and adapters for external trainers."""

from loom.clients.base import LoomHTTPError, ServiceClient

__all__ = ["LoomHTTPError", "ServiceClient"]
