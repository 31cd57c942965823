"""Loom reflect service. Reflection truncation of overthinking and revised samples (REA-RL)."""
