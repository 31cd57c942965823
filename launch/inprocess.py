"""The RL step's stages in this process (gateway.step.Stages): the services' core functions called
directly, no broker, no HTTP. The paper benches (bench/rl_loop.py) and the tests run the product's step
through it; it lives in launch/ because only the launcher may import every service (docs/architecture.md
"The walls").

- generate: the rollout core (``rollout_svc.rollout.generate_group``, each mode's real code path) on
  one torch engine; the groups of a step run concurrently, so the engine batches them;
- score / match: the reward core (``reward_svc.core.ascore_group``, ``reward_svc.match``), math-verify in
  its isolated pool, started only when an item needs it (Countdown and arithmetic are exact); the
  ``judge`` and ``process`` components ask the judges of ``LOOM_REWARD_JUDGES`` through one
  ``loom.clients.JudgeClient`` (its limits and cache), made when a spec first asks;
- cut / revised: the reflect core (``reflect_svc.revise``) with the engine's tokenizer;
- train: one ``learner.train.Learner`` step; a batch without a lineage (a bench's) has its published
  version loaded at once (the engine is the only replica), a run's lineage is loaded when its next
  requests name it, from the policy store, as a replica catches up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from loom.clients.judge import JudgeAsk, JudgeClient, JudgeReply
from loom.contracts.settings import get_settings
from loom.contracts.wire import (
    Group,
    ReflectParams,
    RevisionPlan,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
)


class Scorer:
    """The reward service's core in-process; its verifier pool starts only if an item needs
    math-verify, its judge client (``judges``, else one over ``LOOM_REWARD_JUDGES``) only if a spec
    asks a judge or a PRM."""

    def __init__(self, judges: JudgeClient | None = None) -> None:
        self._pool: Any = None
        self._judges = judges

    def _get_pool(self) -> Any:
        if self._pool is None:
            from reward_svc.pool import VerifierPool

            self._pool = VerifierPool(1)
        return self._pool

    def judges(self) -> JudgeClient:
        if self._judges is None:
            from loom.contracts.reward_settings import get_reward_settings

            self._judges = JudgeClient(get_reward_settings().judges)
        return self._judges

    def verify(self, items: Sequence[Any], timeout_s: int) -> list[Any]:
        return list(self._get_pool().check_many(items, timeout_s))

    async def averify(self, items: Sequence[Any], timeout_s: int) -> list[Any]:
        return list(await self._get_pool().acheck_many(items, timeout_s))

    async def ask_judge(self, asks: Sequence[JudgeAsk]) -> list[JudgeReply]:
        return await self.judges().ask_batch(asks)

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        """``ascore`` outside an event loop (a bench's evaluation)."""
        return asyncio.run(self.ascore(group, spec))

    async def ascore(self, group: Group, spec: RewardSpec) -> RewardResult:
        from reward_svc.core import ascore_group

        return await ascore_group(group, spec, self.averify, ask_judge=self.ask_judge)

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        from reward_svc.match import MatchRequest, finish_matches, plan_matches

        req = MatchRequest(label=group.label, task=group.task, meta=dict(group.meta), texts=texts)
        decided, math_items = plan_matches(req)
        verdicts = self.verify([m for _, m in math_items], req.timeout_s) if math_items else []
        return [
            v.status == "ok" and v.correct for v in finish_matches(decided, math_items, verdicts).verdicts
        ]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._judges is not None:
            self._judges.close()


class InProcessStages:
    """``gateway.step.Stages`` over ``engine`` (a torch engine) and, for ``train``, ``learner``."""

    def __init__(self, engine: Any, learner: Any = None, scorer: Scorer | None = None) -> None:
        self.engine, self.learner = engine, learner
        self.scorer = scorer or Scorer()
        self.settings = get_settings()

    def _tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        from rollout_svc.rollout import generate_group

        # a request naming no version is a bench's step on the learner's own namespace, whose newest
        # version the engine loaded at ``train``: named here, since a replica serves None as the base
        # model (rollout_svc.rollout.serves). A run's request names its lineage's version, which the
        # engine loads from the policy store like any replica (several runs share this engine).
        if request.policy_version is None:
            request = request.model_copy(
                update={
                    "policy_version": self.engine.policy_version,
                    "policy_namespace": self.engine.policy_namespace,
                    "policy_match": "exact",
                }
            )
        return await generate_group(request, self.engine, self._tokenizer, self.settings)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        return await self.scorer.ascore(group, spec)

    async def match(self, key: str, group: Group, texts: list[str]) -> list[bool]:
        return self.scorer.match(group, texts)

    async def cut(
        self, key: str, group: Group, params: ReflectParams, verdicts: list[bool] | None
    ) -> RevisionPlan:
        from reflect_svc.revise import plan_revisions

        return plan_revisions(group, params, self.engine.tokenizer, verdicts)

    async def revised(
        self, key: str, group: Group, params: ReflectParams, plan: RevisionPlan, completions: list[Group]
    ) -> Group:
        from reflect_svc.revise import assemble_revisions

        return assemble_revisions(group, params, plan, completions, self.engine.tokenizer)

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        if self.learner is None:
            raise RuntimeError("these stages have no learner")
        result: StepResult = self.learner.train_step(batch)
        if batch.lineage is not None:  # the run's next requests name its version (``generate``)
            return result
        if result.policy is not None and result.policy.version != self.engine.policy_version:
            self.engine.load_policy_sync(result.policy)
        return result

    async def cancel(self, scope: str) -> int:
        return 0  # nothing is queued: a cancelled step's coroutines are cancelled by their caller

    def forget(self, scope: str) -> None:
        return None

    def close(self) -> None:
        self.scorer.close()
