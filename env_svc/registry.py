"""The environment registry: name -> factory (docs/environments.md "Registry").

The built-ins are written here (their names, for the contracts' validation, are
``loom.contracts.modes.ENVIRONMENTS``); an adapter of an environment library registers its own with
``register``. A deployment's own environments are ``module:factory`` names of a module listed in
``LOOM_ENV_MODULES``, imported by the env worker when first named: a request can name a factory
only there, never a module of its choosing.
"""

from __future__ import annotations

import importlib

from env_svc.adapters import skyrl_gym, verifiers
from env_svc.base import Factory, replayable
from env_svc.countdown import CountdownEnv
from env_svc.python import PythonEnv
from loom.contracts.modes import ENVIRONMENTS, LIBRARIES, REPLAYABLE, known_environment

REGISTRY: dict[str, Factory] = {"countdown": CountdownEnv, "python": PythonEnv}
assert set(ENVIRONMENTS) <= set(REGISTRY), "every built-in name of the contracts has its factory"
assert {n for n in ENVIRONMENTS if replayable(REGISTRY[n])} == set(REPLAYABLE), "the contracts' replayable"


class UnknownEnvironment(LookupError):
    """No factory for that name here: the episode's ``unknown_env``."""


def register(name: str, factory: Factory) -> None:
    """Add ``factory`` under ``name`` (an adapter's environments); a taken name is refused."""
    if name in REGISTRY and REGISTRY[name] is not factory:
        raise ValueError(f"environment {name!r} is registered already")
    REGISTRY[name] = factory


def factory_of(name: str, modules: list[str]) -> Factory:
    """The factory of ``name``: registered, or ``module:factory`` of one of ``modules``."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name or not known_environment(name, modules):
        raise UnknownEnvironment(f"unknown environment {name[:128]!r}; registered: {sorted(REGISTRY)}")
    module, _, attr = name.partition(":")
    if module in LIBRARIES:  # an adapter's name this interpreter did not register (env_svc/adapters/)
        raise UnknownEnvironment(
            f"environment {name[:128]!r} is not served here; registered: {sorted(REGISTRY)}"
        )
    found = getattr(importlib.import_module(module), attr, None)
    if not callable(found):
        raise UnknownEnvironment(f"{module} has no environment factory {attr!r}")
    return found  # type: ignore[no-any-return]


REGISTRY.update(skyrl_gym.registrations())  # skyrl:<id>, where skyrl-gym is installed
REGISTRY.update(verifiers.registrations())  # verifiers:<name>, in the side interpreter (.venv/side-envs)
