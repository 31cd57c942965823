"""Adapters that run the field's environment libraries' own environments behind Loom's protocol
(``env_svc/base.py``): prime's ``verifiers`` and NovaSky's ``skyrl-gym`` (docs/environments.md,
"Environment libraries")."""
