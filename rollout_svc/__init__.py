"""Loom rollout service. Generation: engines (vLLM server, torch) and rollout modes."""
