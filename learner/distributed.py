"""The learner as N ranks (docs/algorithms.md §5.2): data parallel over ``torch.distributed`` (gloo on
CPU, NCCL on GPU). Rank 0 is the process that consumes the queue; it broadcasts each TrainBatch, every
rank trains its share of the samples (samples[rank::N]) and the gradients are summed over the ranks
before the clip and the AdamW step, so every rank takes the same step; rank 0 publishes.

Exact normalisation: each rank's loss is divided by the GLOBAL counts (trained tokens for
``token_mean``, trajectories for the sequence means and HRPO), all-reduced before the first backward,
so the summed gradient is the one-process gradient of the whole batch.

One process is ``OneProcess``: the same methods, each the identity.

A rank that dies or stops answering makes the collective on rank 0 raise: ``RankFailure``. The Celery
task then ends its worker process (learner/tasks.py), so the late-acknowledged message is redelivered
instead of acknowledged with half a step.

Two layouts (``LearnerSettings.sharding``, chosen once when the ``Learner`` is built: ``layout``):
``replicate`` (the default, ``Ranks``) holds the whole model on every rank (DDP's layout, with the
all-reduce done by hand after accumulation, ``Ranks.sum_gradients``); ``fsdp`` (``ShardedRanks``)
wraps it with FSDP2's ``fully_shard`` (each decoder layer, then the root), so the parameters,
gradients and AdamW's moments are sharded over the ranks: FSDP all-gathers a layer's parameters for
its forward and backward and reduce-scatters its gradient, summed (``shard``: divide factor 1, because
each rank's loss already has the global normaliser). Every rank then runs as many forward/backward
passes as the rank with the most micro-batches (``idle_passes``), since each is a collective. Gloo has
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on torch 2.13, so FSDP runs on CPU too.
The clip takes the global norm of the sharded (DTensor) gradients. To publish, every rank gathers the
full state dict to rank 0 (``full_state``, ``full_optimizer_state``), which writes the same plain HF
checkpoint and optimizer.pt as one process; ``save_sharded`` keeps each rank's shards.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.contracts.wire import PolicyVersion
from loom.store import PolicyStore

log = logging.getLogger("loom.learner.dist")

STOP = "stop"  # the broadcast that ends the helper ranks' loop


class RankFailure(RuntimeError):
    """A collective failed: another rank died or timed out; the step did not happen."""


class OneProcess:
    """The learner in one process: each collective is the identity and nothing is sharded. The
    ``Learner`` calls the same methods whatever the layout (``layout`` picks it once), so its train
    step has no branch on the number of ranks."""

    rank: int = 0
    world: int = 1
    sharded: bool = False  # FSDP: a forward needs every rank (no FCI scoring on rank 0 alone)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, name: str) -> torch.device:
        return torch.device(name)

    def prepare(self, model: Any, mixed_precision: str) -> None:
        """The freshly loaded model, made ready for this layout (in place)."""

    def load_optimizer(self, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def resume(self, model: Any, optimizer: Any, store_root: Path, version: int) -> None:
        """The ranks' own checkpoint of ``version``, where there is one."""

    def share_batch(self, batch: Any) -> None:
        """Rank 0 hands the batch it is about to train to the other ranks."""

    def share(self, items: Sequence[Any]) -> list[Any]:
        return list(items)

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def all_max(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def forward_backward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def autocast(self, dtype: torch.dtype | None) -> torch.dtype | None:
        return dtype

    def extra_passes(self, micro_batches: int) -> int:
        """How many idle forward/backward passes this rank owes the others (``idle_passes``)."""
        return 0

    def idle_passes(self, model: Any, n: int) -> None:
        """``n`` forward/backward passes that add nothing (FSDP's collectives need every rank)."""

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The gradients summed over the ranks, in place."""

    def gather(self, model: Any, optimizer: Any, with_optimizer: bool) -> tuple[dict[str, Any], Any] | None:
        """The full model (and optimizer) state to publish, where the model is sharded; else None."""
        return None

    def publish(
        self, write: Callable[[], PolicyVersion], store: PolicyStore, version: int, model: Any, optimizer: Any
    ) -> PolicyVersion:
        """``write()`` publishes ``version`` (rank 0); every rank returns its record."""
        return write()

    def broadcast(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        """Every rank has come this far."""

    def close(self) -> None:
        """The process group, left."""


@dataclass
class Ranks(OneProcess):
    """N ranks holding the whole model each (``replicate``): samples shared out, gradients summed."""

    rank: int
    world: int

    @classmethod
    def init(
        cls, rank: int, world: int, addr: str, port: int, backend: str = "gloo", timeout_s: float = 120.0
    ) -> Ranks:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return cls(rank, world)

    def device(self, name: str) -> torch.device:
        return torch.device(f"cuda:{self.rank}" if name == "cuda" else name)  # one GPU per rank

    def prepare(self, model: Any, mixed_precision: str) -> None:
        self.same_weights(model)

    def resume(self, model: Any, optimizer: Any, store_root: Path, version: int) -> None:
        sharded = sharded_path(store_root, version)
        if sharded.exists():  # the ranks' own checkpoint of this version (model + optimizer)
            load_sharded(model, optimizer, sharded)

    def share_batch(self, batch: Any) -> None:
        if self.is_main:  # the helper ranks (serve) train the same batch
            self.broadcast(batch.model_dump(mode="json"))

    def share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's items: every ``world``-th from ``rank`` (balanced whatever the batch order)."""
        return list(items[self.rank :: self.world])

    def all_sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
        return [float(x) for x in t]

    def all_max(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        collective(dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return [float(x) for x in t]

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """grad <- sum over ranks, one flat buffer (a rank with no sample contributes zeros)."""
        ps = list(params)
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in ps if p.grad is not None])
        collective(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in ps:
            assert p.grad is not None
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def same_weights(self, model: Any) -> None:
        """Every rank takes rank 0's parameters and buffers (as DDP does at construction): a freshly
        initialised part (a LoRA adapter's A) is drawn by each process's own random state."""
        for t in [*model.parameters(), *model.buffers()]:
            collective(dist.broadcast, t.data, src=0)

    def publish(
        self, write: Callable[[], PolicyVersion], store: PolicyStore, version: int, model: Any, optimizer: Any
    ) -> PolicyVersion:
        if self.is_main:
            record = write()
            self.barrier()
        else:
            self.barrier()  # rank 0 has published: the same version, read back
            latest = store.latest()
            if latest is None or latest.version != version:
                raise RankFailure(f"rank {self.rank}: rank 0 did not publish version {version}")
            record = latest
        save_sharded(self, model, optimizer, sharded_path(store.root, record.version))
        return record

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.is_main else None]
        collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    def barrier(self) -> None:
        collective(dist.barrier)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class ShardedRanks(Ranks):
    """N ranks under FSDP2 (``fsdp``): parameters, gradients and optimizer state sharded (``shard``)."""

    sharded: bool = True

    def prepare(self, model: Any, mixed_precision: str) -> None:
        super().prepare(model, mixed_precision)
        shard(model, mixed_precision)

    def load_optimizer(self, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
        set_full_optimizer_state(model, optimizer, state)

    def forward_backward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # every FSDP forward and backward is a collective: a failure there is a RankFailure
        return collective(fn, *args, **kwargs)

    def autocast(self, dtype: torch.dtype | None) -> torch.dtype | None:
        return None  # FSDP casts by its MixedPrecisionPolicy

    def extra_passes(self, micro_batches: int) -> int:
        # every rank runs as many forward/backward passes as the rank with the most micro-batches
        return int(self.all_max([float(micro_batches)])[0]) - micro_batches

    def idle_passes(self, model: Any, n: int) -> None:
        for _ in range(n):
            idle_pass(model)

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """FSDP has reduce-scattered them already (summed, ``shard``)."""

    def gather(self, model: Any, optimizer: Any, with_optimizer: bool) -> tuple[dict[str, Any], Any] | None:
        # the plain checkpoint is gathered from the shards: a collective
        optim_sd = full_optimizer_state(model, optimizer) if with_optimizer else None
        return full_state(model), optim_sd


def layout(ranks: Ranks | None, sharding: str) -> OneProcess:
    """The learner's layout, decided once: one process, or N ranks replicated or sharded."""
    if ranks is None or ranks.world == 1:
        return OneProcess()
    return ShardedRanks(ranks.rank, ranks.world) if sharding == "fsdp" else ranks


SHARDED_DIR = "sharded"  # under the policy store: sharded/v<N>, the ranks' model + optimizer state


def sharded_path(store_root: Path, version: int) -> Path:
    return store_root / SHARDED_DIR / f"v{version}"


def save_sharded(ranks: Ranks, model: Any, optimizer: Any, path: Path) -> None:
    """Every rank's model and optimizer state with ``torch.distributed.checkpoint`` (a collective:
    each rank writes its shard, replicated tensors once); rank 0 then drops the older checkpoints."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    collective(save, {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if ranks.is_main:
        for old in path.parent.glob("v*"):
            if old != path and old.name[1:].isdigit() and int(old.name[1:]) < int(path.name[1:]):
                shutil.rmtree(old, ignore_errors=True)


def load_sharded(model: Any, optimizer: Any, path: Path) -> None:
    """The model and optimizer state of :func:`save_sharded` (a collective), in place."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    collective(load, state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def shard(model: Any, mixed_precision: str = "no") -> None:
    """FSDP2 over the ranks, in place: ``fully_shard`` on each decoder layer (the classes the HF model
    names in ``_no_split_modules``), then on the root. Gradients are summed, not averaged;
    ``mixed_precision="bf16"`` computes in bf16 and reduces the gradients in float32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layer_policy = root_policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        layer_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # the logits leave the root in float32 (a layer's output stays bf16: the next one reads it)
        root_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mp_policy=layer_policy)
    fully_shard(model, mp_policy=root_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # a plain SUM of the ranks' gradients (gloo has no PREMUL_SUM; FSDP's default is AVG)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def idle_pass(model: Any) -> None:
    """A forward and backward of one token with a zero loss: a rank with fewer micro-batches joins
    the others' FSDP all-gathers and reduce-scatters, adding zero gradients."""
    device = next(model.parameters()).device
    logits = collective(model, input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
    collective((logits.float().sum() * 0.0).backward)


def full_state(model: Any) -> dict[str, Any]:
    """The whole model's state dict gathered from the shards, on the CPU (a collective: every rank
    calls it; rank 0 writes the plain checkpoint from it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(collective(get_model_state_dict, model, options=options))


def _trained_names(model: Any) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The sharded AdamW state gathered on rank 0 (a collective) in ``optimizer.state_dict()``'s own layout
    (parameters by index), so optimizer.pt reads the same whichever way the version was trained."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = collective(get_optimizer_state_dict, model, optimizer, options=options)
    if not full:  # ranks > 0: cpu_offload leaves the full state on rank 0 alone
        return {}
    index = {name: i for i, name in enumerate(_trained_names(model))}
    return {
        "state": {index[k]: v for k, v in full["state"].items()},
        "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in full["param_groups"]],
    }


def set_full_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """An ``optimizer.state_dict()`` (parameters by index) into the sharded optimizer (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _trained_names(model)
    full = {
        "state": {names[int(i)]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
    options = StateDictOptions(full_state_dict=True)
    collective(set_optimizer_state_dict, model, optimizer, optim_state_dict=full, options=options)


def collective(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; a failure of the transport (another rank gone) is a ``RankFailure``."""
    try:
        return fn(*args, **kwargs)
    except RankFailure:
        raise
    except (RuntimeError, ConnectionError) as exc:  # gloo: "Connection closed by peer", timeouts
        name = getattr(fn, "__name__", type(fn).__name__)
        raise RankFailure(f"a learner rank failed during {name}: {exc}") from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
