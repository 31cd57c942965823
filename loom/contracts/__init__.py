"""Typed contracts every service and the gateway share (docs/architecture.md "Contracts"):

- ``wire.py``: the wire models, the only types that cross a process boundary;
- ``settings.py``: the process settings (``LOOM_*``); ``reward_settings.py``: ``LOOM_REWARD_*``;
- ``modes.py``, ``rewards.py``, ``estimators.py``: one params model per rollout mode, reward component
  and advantage estimator, each default written once.

The core imports no service; the gateway validates submissions with these models alone.
"""
