"""SIMULATION ONLY: an engine that emits pseudo-random tokens after a fixed per-token latency.

It exists for one purpose, the replica-scaling benchmark (bench/rollout.py): it emulates a batching
server whose requests do not slow each other down, so the benchmark measures Loom's orchestration and
not the model. Its tokens and log-probs are meaningless; never use it for training.
"""

from __future__ import annotations

import asyncio
import random

from loom.contracts.wire import PolicyVersion, SamplingParams
from rollout_svc.engines.base import Completion, Engine, Layout, UnsupportedCapability


class SimulatedEngine(Engine):
    name = "simulated"
    capabilities = frozenset({"prefix_cache"})

    def __init__(self, ms_per_token: float, vocab_size: int = 256) -> None:
        super().__init__()
        self.ms_per_token = ms_per_token
        self.emitted_vocab = vocab_size  # the ids it emits; it reads any prompt (vocab_size: None)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if layout is not None:
            raise UnsupportedCapability(self.name, "group_positions")
        await asyncio.sleep(self.ms_per_token * params.max_tokens / 1000.0)
        rng = random.Random(params.seed)
        self.stats.requests += 1
        self.stats.prefill_tokens += len(prompt_ids)
        self.stats.decode_tokens += params.n * params.max_tokens
        return [
            Completion(
                token_ids=[rng.randrange(self.emitted_vocab) for _ in range(params.max_tokens)],
                logprobs=[-1.0] * params.max_tokens,
                finish_reason="length",
            )
            for _ in range(params.n)
        ]

    async def load_policy(self, policy: PolicyVersion) -> None:
        self.policy_version, self.policy_namespace = policy.version, policy.namespace

    async def reset_cache(self) -> None:
        return None
