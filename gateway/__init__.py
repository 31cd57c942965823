"""Loom gateway service. Public API: auth, jobs and RL runs; drives pipelines over the queues."""
