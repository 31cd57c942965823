"""Loom sandbox service: model-written programs (Python, bash) run in bubblewrap with rlimits and
cgroups, warm runner slots, admission control and typed outcomes (docs/sandbox.md)."""
