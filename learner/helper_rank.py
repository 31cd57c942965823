"""The entrypoint of the learner's helper ranks: ``python -m learner.helper_rank RANK WORLD ADDR PORT
SETTINGS_JSON``. Rank 0 (the Celery worker, learner/tasks.py) starts ranks 1..N-1 with
``start_helpers``; each builds the same ``Learner`` from rank 0's ``LearnerSettings`` and trains every
batch rank 0 broadcasts (learner/distributed.py) until it broadcasts ``STOP``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence

import torch

from learner.config import LearnerSettings
from learner.distributed import STOP, RankFailure, Ranks, free_port
from learner.train import Learner
from loom.contracts.wire import TrainBatch

log = logging.getLogger("loom.learner.dist")


def start_helpers(world: int, addr: str, port: int, cfg: LearnerSettings) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..world-1 as child processes of rank 0, each with rank 0's settings; one torch thread
    each unless OMP_NUM_THREADS says otherwise."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    settings = cfg.model_dump_json()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "learner.helper_rank", str(r), str(world), addr, str(port), settings],
            env=env,
        )
        for r in range(1, world)
    ]


def backend(device: str) -> str:
    """The collectives' transport: NCCL between GPUs (one per rank), gloo on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def start_ranks(world: int, cfg: LearnerSettings) -> Ranks:
    """Rank 0 in this process, ranks 1..world-1 as its children (``start_helpers``)."""
    port = free_port()
    start_helpers(world, "127.0.0.1", port, cfg)
    return Ranks.init(0, world, "127.0.0.1", port, backend(cfg.device))


def serve(learner: Learner) -> None:
    """Train every batch rank 0 broadcasts, until it broadcasts ``STOP``."""
    ranks = learner.ranks
    while True:
        got = ranks.broadcast(None)
        if got == STOP:
            return
        try:
            learner.train_step(TrainBatch.model_validate(got))
        except ValueError as exc:  # a bad batch: rank 0 refuses it the same way, before any collective
            log.info("rank %d: batch refused: %s", ranks.rank, exc)


def main(argv: Sequence[str]) -> int:
    rank, world, addr, port, settings = argv
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = LearnerSettings.model_validate_json(settings)
    ranks = Ranks.init(int(rank), int(world), addr, int(port), backend(cfg.device))
    try:
        serve(Learner(cfg, ranks=ranks))
    except RankFailure as exc:
        log.error("%s", exc)
        return 1
    finally:
        ranks.close()
    return 0


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization once the rank's work and its process group are
    closed: a rank whose FSDP state (parameters, DTensor meshes) still held a reference to the gloo
    group freed it there, in an order torch does not fix, and one CI run's helper rank aborted at that
    point ("terminate called without an active exception", exit -6) after every step had passed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
