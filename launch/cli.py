"""``loom`` command line. Each command lives in its own module and is imported only when used.

loom up [--smoke]            the whole stack on this machine (embedded broker unless configured)
loom status                  health of every service and queue depths
loom api SERVICE             one service's HTTP API (uvicorn, with read deadlines)
loom worker SERVICE          one service's Celery worker on its own queue
loom engine                  the torch engine behind a vLLM-compatible HTTP server
loom demo                    a short RL run on the built-in tiny model (--task code: the code model;
                             --mode agent: the tool model calling the calculator)
loom train-MODEL             reproduce a built-in model (tiny, search, stream, reflect, deep, judge, code,
                             tool): its row of the recipe table, zoo/recipes.py (docs/models.md)
loom bench NAME              run a benchmark from bench/
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from launch import SERVICE_PACKAGES
from loom.contracts.settings import SERVICES
from zoo.registry import BUILTIN

# command -> (module:function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("launch.stack:up_main", "start the whole stack on this machine"),
    "status": ("launch.stack:status_main", "health of every service and queue depths"),
    "api": ("launch.cli:api_main", "run one service's HTTP API"),
    "worker": ("launch.cli:worker_main", "run one service's Celery worker"),
    "engine": ("rollout_svc.engines.server:main", "torch engine behind a vLLM-compatible server"),
    "demo": ("launch.demo:main", "a short RL run on the built-in tiny model"),
    "bench": ("launch.cli:bench_main", "run a benchmark from bench/"),
}
# ``loom train-<name>`` for every built-in model: zoo.recipes.main(name, argv), the name's row
TRAIN: dict[str, str] = {f"train-{name}": name for name in BUILTIN}
COMMANDS.update(
    {command: ("zoo.recipes:main", f"reproduce the built-in {name} model") for command, name in TRAIN.items()}
)


def _resolve(target: str):  # type: ignore[no-untyped-def]
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def api_main(argv: Sequence[str]) -> int:
    from loom.contracts.settings import get_settings

    p = argparse.ArgumentParser(prog="loom api", description="run one service's HTTP API")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args(argv)
    settings = get_settings()
    from loom.runtime import configure_process
    from loom.service import serve

    configure_process(settings)
    # uvicorn with read deadlines on headers and bodies (slow clients are cut off: docs/security.md)
    serve(
        f"{SERVICE_PACKAGES[args.service]}.api:app",
        args.host or settings.host,
        args.port or settings.service_port(args.service),
        settings,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    return 0


def learner_nproc(given: int | None) -> int:
    """The learner's ranks: ``--nproc`` when given, else ``LOOM_LEARNER_NPROC`` (compose and k8s set it)."""
    from learner.config import LearnerSettings

    return int(given) if given is not None else LearnerSettings().nproc


def worker_main(argv: Sequence[str]) -> int:
    from loom.contracts.settings import get_settings
    from loom.queue import worker_argv
    from loom.runtime import configure_process

    p = argparse.ArgumentParser(prog="loom worker", description="run one service's Celery worker")
    p.add_argument("service", choices=SERVICES)
    p.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=None,
        help="tasks at once (rollout: groups on the engine at once; see LOOM_ROLLOUT_READY)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="learner: train as N data-parallel ranks (gloo on CPU, NCCL on GPU); this worker is rank 0 "
        "(default: LOOM_LEARNER_NPROC, 1)",
    )
    args, extra = p.parse_known_args(argv)
    if args.nproc is not None and args.nproc > 1 and args.service != "learner":
        p.error("--nproc is the learner's option")
    settings = get_settings()
    configure_process(settings)
    tasks = importlib.import_module(f"{SERVICE_PACKAGES[args.service]}.tasks")
    concurrency, pool = args.concurrency or settings.worker_concurrency, "prefork"
    if args.service == "rollout":
        from rollout_svc.config import RolloutSettings, rollout_slots

        rollout = RolloutSettings()
        running, concurrency = rollout_slots(settings, rollout, args.concurrency)
        tasks.set_engine_slots(running)
        pool = rollout.pool
    if args.service == "reward":
        from loom.contracts.reward_settings import RewardSettings

        pool = RewardSettings().pool
    if args.service == "learner":
        tasks.set_nproc(learner_nproc(args.nproc))
    if args.service == "sandbox":  # the task threads share the process's one pool of warm slots
        pool = "threads"
    if args.service == "env":  # an episode's environment lives in this process (docs/environments.md)
        from env_svc.config import get_env_settings

        concurrency, pool = args.concurrency or get_env_settings().concurrency, "threads"
    tasks.celery_app.worker_main(worker_argv(args.service, settings, concurrency, pool) + list(extra))
    return 0


def bench_main(argv: Sequence[str]) -> int:
    import runpy
    from pathlib import Path

    p = argparse.ArgumentParser(prog="loom bench", description="run a benchmark from bench/")
    p.add_argument("name", help="e.g. broker, tiny, rewards")
    args, extra = p.parse_known_args(argv)
    path = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not path.exists():
        print(f"no benchmark {args.name!r} at {path}", file=sys.stderr)
        return 2
    sys.argv = [str(path), *extra]
    runpy.run_path(str(path), run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"loom: unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    target = _resolve(COMMANDS[command][0])
    result = target(TRAIN[command], rest) if command in TRAIN else target(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
