"""Loom: a reward-and-rollout platform for reinforcement learning of reasoning language models."""

__version__ = "0.1.0"
