"""Typed contracts every service and the gateway share: one params model per rollout mode
(``modes.py``), per reward component (``rewards.py``) and per advantage estimator
(``estimators.py``), each default written once. The core imports no service; the gateway validates
submissions with these models alone (docs/architecture.md)."""
