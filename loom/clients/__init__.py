"""Typed HTTP clients of Loom's services, and adapters for external trainers."""

from loom.clients.base import LoomHTTPError, ServiceClient
from loom.clients.rollouts import AsyncRollouts, Rollouts

__all__ = ["AsyncRollouts", "LoomHTTPError", "Rollouts", "ServiceClient"]
