"""Component name -> reward function (docs/algorithms.md §1.6, composition).

A component's registration is its line in the contract's table
(``loom.contracts.rewards.COMPONENT_PARAMS``: name -> params model, which the gateway checks a spec
with); its function is the one of the same name in the module of its family, the name's first word
(``format_stream``: ``reward_svc/format.py``; ``efficiency``: ``reward_svc/efficiency.py``), and says
which verdicts it reads with ``reward_svc.context.reads``. A new component is that function (in its
family's file, or a file of its own) plus that line (docs/architecture.md, "One registration per
feature").
"""

from __future__ import annotations

import importlib

from loom.contracts.rewards import COMPONENT_PARAMS
from reward_svc.context import ComponentFn, reads_of


def component(name: str) -> ComponentFn:
    """The function of component ``name``: ``reward_svc.<family>.<name>``, family = the first word."""
    fn: ComponentFn = getattr(importlib.import_module(f"reward_svc.{name.split('_')[0]}"), name)
    return fn


REGISTRY: dict[str, ComponentFn] = {name: component(name) for name in COMPONENT_PARAMS}
# Components that read the accuracy verdicts (the verifier runs only when one is requested).
NEEDS_ACCURACY = frozenset(name for name, fn in REGISTRY.items() if "accuracy" in reads_of(fn))
# Components that read the code verdicts (the sandbox runs only when one is requested or the task is code).
NEEDS_CODE = frozenset(name for name, fn in REGISTRY.items() if "code" in reads_of(fn))
# Components that read the judge verdicts (the judge is asked only when one is requested).
NEEDS_JUDGE = frozenset(name for name, fn in REGISTRY.items() if "judge" in reads_of(fn))
# Components that read the PRM's step scores (the PRM is asked only when one is requested).
NEEDS_PROCESS = frozenset(name for name, fn in REGISTRY.items() if "process" in reads_of(fn))
