"""Per-process set-up every Loom entrypoint calls first.

Several Loom processes share few cores: torch's intra-op thread count is chosen on purpose
(``LOOM_TORCH_THREADS``, default 1) because 2 threads per process under contention measured
5-15x slower than 1 on a 2-core machine.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from loom.contracts.settings import Settings, get_settings

_configured = False
T = TypeVar("T")

# transformers builds a model under process-wide patches (the meta device, skipped initialisation):
# two checkpoints loading at once in one process can leave one of them with meta tensors ("Cannot
# copy out of meta tensor"). A process that holds a learner and an engine (launch/inprocess.py, where
# a run's train step loads its lineage while the engine loads another run's version) loads in turn.
MODEL_LOADS = threading.Lock()


def configure_process(settings: Settings | None = None) -> None:
    global _configured
    if _configured:
        return
    settings = settings or get_settings()
    threads = str(settings.torch_threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = threads  # on purpose: LOOM_TORCH_THREADS wins over an inherited value
    # sympy with gmpy2 ignores math-verify's alarms on huge integers (shared/notes/verifier.md).
    os.environ.setdefault("SYMPY_GROUND_TYPES", "python")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # torch takes its intra-op thread count from OMP_NUM_THREADS when it is first imported, so a
    # process that never uses torch (most API processes) does not pay ~3 s to import it here.
    if "torch" in sys.modules:
        set_torch_threads(settings.torch_threads)
    logging.basicConfig(
        level=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _configured = True


def set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # parallel work already started; the intra-op count is what matters
            pass


class Shared(Generic[T]):
    """One object per process made on first use (a verifier pool, a sandbox pool): ``get`` makes it
    under a lock, so the threads of a worker or an API share one; ``close`` closes it, and the next
    ``get`` makes a new one (an API's shutdown, a test's reset)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._obj: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._obj is None:
                self._obj = self._make()
            return self._obj

    def close(self) -> None:
        with self._lock:
            obj, self._obj = self._obj, None
        if obj is not None:
            obj.close()  # type: ignore[attr-defined]
