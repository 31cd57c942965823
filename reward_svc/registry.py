"""Component name -> reward function (ALGORITHMS.md 1.6 composition)."""

from __future__ import annotations

from reward_svc.accuracy import AccuracyParams, accuracy
from reward_svc.context import ComponentFn, Params
from reward_svc.efficiency import EfficiencyParams, efficiency
from reward_svc.format import NoParams, format_deep, format_spawn, format_stream, format_think
from reward_svc.length import RefinedParams, length_deep, length_kimi, length_refined, length_stream
from reward_svc.reflection import ReflectionParams, reflection

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
}

# Components that read the accuracy verdicts (the verifier runs only when one is requested).
NEEDS_ACCURACY = frozenset({"accuracy", "length_kimi", "length_refined", "efficiency"})

PARAMS: dict[str, type[Params]] = {
    "accuracy": AccuracyParams,
    "format_stream": NoParams,
    "format_deep": NoParams,
    "format_think": NoParams,
    "format_spawn": NoParams,
    "length_kimi": NoParams,
    "length_refined": RefinedParams,
    "length_stream": NoParams,
    "length_deep": NoParams,
    "efficiency": EfficiencyParams,
    "reflection": ReflectionParams,
}
