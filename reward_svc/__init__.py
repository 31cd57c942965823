"""Loom reward service. Rewards: accuracy, format, length, reflection, efficiency; isolated verification."""
