"""One `loom demo` step's parts, timed in one process on one torch thread: the step's 16 groups x 8
samples generated together on the torch engine (the demo's settings: the tiny model, T = 1.3,
processed log-probs, 96 tokens), scored by the reward core, trained by one ``Learner`` step (its
forward + backward per micro-batch, the optimizer step, the publish), and the new version loaded by
the engine. Each part's wall and CPU seconds (``time.process_time``), the median over ``--steps``
synchronous steps after a warm-up, beside the demo's reference loop (``launch.demo.reference_seconds``)
measured in the same run: the parts in reference units mean the same on any host.

    python bench/demo_step.py [--steps 5] [--profile PART]   # PART: gen, train, load (cProfile's top)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loom.runtime import set_torch_threads


class Clock:
    """Wall, process CPU and this thread's CPU seconds per named part, summed within a step (the
    engine decodes in its scheduler thread: generation is process CPU; the learner's step and the
    version load run in this thread, whose CPU leaves out the engine thread's waits)."""

    def __init__(self, profile: str | None = None) -> None:
        self.step: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.steps: list[dict[str, list[float]]] = []
        self.profile = profile
        self.prof = cProfile.Profile(time.process_time) if profile else None  # CPU seconds: less load-bound

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
        on = self.prof is not None and name == self.profile
        if on:
            assert self.prof is not None
            self.prof.enable()
        try:
            yield
        finally:
            if on:
                assert self.prof is not None
                self.prof.disable()
            self.step[name][0] += time.perf_counter() - w
            self.step[name][1] += time.process_time() - c
            self.step[name][2] += time.thread_time() - t

    def end_step(self) -> None:
        self.steps.append(dict(self.step))
        self.step = defaultdict(lambda: [0.0, 0.0, 0.0])


PARTS = (
    "step",
    "gen+score",
    "score",
    "train",
    "forward+backward",
    "loss+backward",
    "optimizer",
    "publish",
    "load",
)


def reference_cpu() -> float:
    """The reference loop's CPU seconds (``reference_seconds`` timed by ``time.process_time``)."""
    from launch.demo import reference_seconds

    c = time.process_time()
    reference_seconds(1)
    return time.process_time() - c


def wrap(obj: Any, attr: str, clock: Clock, name: str) -> None:
    """Time every call of ``obj.attr`` as part ``name``."""
    inner: Callable[..., Any] = getattr(obj, attr)

    def timed(*a: Any, **k: Any) -> Any:
        with clock.part(name):
            return inner(*a, **k)

    setattr(obj, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--profile", choices=("gen", "score", "train", "publish", "load"), default=None)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    set_torch_threads(a.threads)

    import torch

    from gateway.datasets import load_dataset, step_indices
    from gateway.models import RunRequest
    from gateway.runs import to_request
    from gateway.step import StepConfig, generate_step, train, trained_groups
    from launch.demo import TASK_DEFAULTS, parse_args, reference_seconds, run_request
    from launch.inprocess import InProcessStages
    from learner import logprobs as lp
    from learner import train as lt
    from learner.config import LearnerSettings
    from loom.contracts.modes import ModeLimits, resolved_request
    from loom.contracts.settings import get_settings
    from rollout_svc.engines.torch import TorchEngine, resolve_model_path

    body = run_request(parse_args([]))
    req = RunRequest.model_validate(body)
    cfg = StepConfig.of(req)
    dataset = load_dataset(req.dataset, req.mode, Path("."))
    limits, sampling = ModeLimits.from_settings(get_settings()), req.generated_sampling()
    clock = Clock(a.profile)
    ref_before, ref_cpu = reference_seconds(), reference_cpu()
    with tempfile.TemporaryDirectory() as store:
        settings = get_settings()
        engine = TorchEngine(
            resolve_model_path("tiny"),
            logprobs_mode="processed",
            cache_entries=settings.engine_prefix_cache_entries,
        )
        learner = lt.Learner(LearnerSettings(model="tiny", store=Path(store), device="cpu"))
        stages = InProcessStages(engine, learner)
        wrap(stages.scorer, "score", clock, "score")
        wrap(engine, "load_policy_sync", clock, "load")
        wrap(learner, "publish", clock, "publish")
        wrap(learner, "_optimizer_step", clock, "optimizer")
        orig_recompute = lp.recompute

        def recompute(*args: Any, each: Any, **kw: Any) -> Any:
            def timed_each(mb: Any) -> Any:
                with clock.part("loss+backward"):
                    return each(mb)

            with clock.part("forward+backward"):
                return orig_recompute(*args, each=timed_each, **kw)

        learner.ranks.forward_backward = (  # type: ignore[method-assign]
            lambda fn, *args, **kw: recompute(*args, **kw)
        )
        n = max(TASK_DEFAULTS["batch_size"], a.batch)
        for step in range(a.steps + 1):

            def draw(k: int, step: int = step) -> list[Any]:
                rows = step_indices(len(dataset), a.batch, req.schedule.seed, step, k)
                return [resolved_request(to_request(dataset[i], req), limits, sampling) for i in rows]

            with clock.part("step"):
                with clock.part("gen+score"):
                    collected = asyncio.run(generate_step(stages, cfg, f"s{step}", draw, n))
                kept = trained_groups(collected, cfg, a.batch)
                with clock.part("train"):
                    trained = asyncio.run(train(stages, f"t{step}", step, kept, cfg))
            assert trained.result is not None
            tokens = sum(len(t.completion_ids) for g, _ in kept for t in g.trajectories)
            clock.step["tokens"] = [float(tokens), 0.0, 0.0]
            clock.step["trained_tokens"] = [float(trained.result.n_tokens), 0.0, 0.0]
            clock.end_step()
            print(f"step {step}: {len(kept)} groups, {tokens} completion tokens")
        stages.close()
    ref = (ref_before + reference_seconds()) / 2
    ref_cpu = (ref_cpu + reference_cpu()) / 2
    steps = clock.steps[1:]  # the first step warms up
    print(
        f"torch {torch.__version__}, {a.threads} thread(s); reference loop {ref:.3f} s wall, "
        f"{ref_cpu:.3f} s CPU; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'part':<18} {'wall s':>8} {'cpu s':>8} {'thread cpu':>10} {'ref (wall)':>10} {'ref (cpu)':>10}")
    for name in PARTS:
        if not any(name in s for s in steps):
            continue
        wall, cpu, thread = (statistics.median(s.get(name, [0.0] * 3)[k] for s in steps) for k in range(3))
        own = cpu if name in ("gen+score", "step") else thread
        print(f"{name:<18} {wall:8.3f} {cpu:8.3f} {thread:10.3f} {wall / ref:10.1f} {own / ref_cpu:10.1f}")
    print(
        f"completion tokens a step {statistics.median(s['tokens'][0] for s in steps):.0f}, "
        f"trained {statistics.median(s['trained_tokens'][0] for s in steps):.0f}"
    )
    if clock.prof is not None:
        pstats.Stats(clock.prof).sort_stats("cumulative").print_stats(35)
        pstats.Stats(clock.prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
