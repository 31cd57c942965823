"""Component name -> reward function (docs/algorithms.md §1.6, composition). The names and each
component's params model are the contract's (``loom.contracts.rewards.COMPONENT_PARAMS``)."""

from __future__ import annotations

from reward_svc.accuracy import accuracy
from reward_svc.code import code_all, code_pass
from reward_svc.context import ComponentFn
from reward_svc.efficiency import efficiency
from reward_svc.format import format_deep, format_spawn, format_stream, format_think
from reward_svc.length import length_deep, length_kimi, length_refined, length_stream
from reward_svc.reflection import reflection

REGISTRY: dict[str, ComponentFn] = {
    "accuracy": accuracy,
    "format_stream": format_stream,
    "format_deep": format_deep,
    "format_think": format_think,
    "format_spawn": format_spawn,
    "length_kimi": length_kimi,
    "length_refined": length_refined,
    "length_stream": length_stream,
    "length_deep": length_deep,
    "efficiency": efficiency,
    "reflection": reflection,
    "code_pass": code_pass,
    "code_all": code_all,
}
