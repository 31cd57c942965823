"""The environment tier: agent episodes' environments on their own workers (docs/environments.md)."""
