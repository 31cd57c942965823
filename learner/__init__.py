"""Loom learner service. Advantages, losses, train steps and policy versions."""
