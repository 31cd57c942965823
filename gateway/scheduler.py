"""Fair share of the rollout tier across API keys: deficit round robin over per-key queues of
generation tasks, released to the broker within a bounded window (docs/operations.md "Fair share").

The broker's ``rollout`` queue is first come first served: a key that submits a flood of groups puts
every one of them ahead of another key's small job. So the gateway does not publish a generation task
the moment its job asks for it: the task waits in its key's queue here, and at most ``window``
generation tasks are in the broker (published, result not read yet) at once. Each time one comes
back, the next ones are chosen by deficit round robin (Shreedhar and Varghese, "Efficient fair
queuing using deficit round robin", SIGCOMM 1995): keys take turns; a key's turn adds ``quantum x
weight`` to its deficit and releases its queued tasks while their cost (the group's worst-case
tokens, gateway/cost.py) fits in it; a key whose queue empties keeps no credit. A small job of key B
therefore waits behind at most one turn of each other key, never behind another key's whole flood.

``drr_order`` is the pure core (plain data in and out, tested directly); ``FairGate`` is the thin
asyncio shell ``gateway.pipeline.CeleryStages.generate`` waits on. Nothing here is durable and nothing
needs to be: a task waiting here has not been published, its job is ``running`` in the gateway's
database, and a restarted gateway resumes the job (gateway/manager.py ``resume_all``), which asks for
the same task again under the same key.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_WINDOW = 64  # generation tasks in the broker when the replicas' slots are not configured


@dataclass(frozen=True)
class DrrState:
    """Where the round robin stands between two calls: each key's deficit, the keys in turn order
    (``ring[0]`` is the next to serve) and whether ``ring[0]``'s turn has begun (its quantum added)."""

    deficits: Mapping[str, float] = field(default_factory=dict)
    ring: tuple[str, ...] = ()
    started: bool = False


def _ring(queues: Mapping[str, Sequence[float]], state: DrrState) -> list[str]:
    """The keys with queued work in turn order: the state's order, newcomers after it."""
    kept = [k for k in state.ring if queues.get(k)]
    return kept + [k for k, q in queues.items() if q and k not in state.ring]


def _skip_idle_turns(
    ring: list[str],
    heads: Mapping[str, float],
    deficits: dict[str, float],
    credit: Mapping[str, float],
) -> None:
    """A whole round released nothing (every head costs more than its deficit): add at once the
    rounds it takes for the first key to afford its head, but one (the next turn adds that one)."""
    rounds = min(math.ceil((heads[k] - deficits[k]) / credit[k]) for k in ring)
    for k in ring:
        deficits[k] += max(rounds - 1, 0) * credit[k]


def drr_order(
    queues: Mapping[str, Sequence[float]],
    weights: Mapping[str, float],
    quantum: float,
    state: DrrState | None = None,
    limit: int | None = None,
) -> tuple[list[tuple[str, int]], DrrState]:
    """The order in which deficit round robin releases queued tasks: ``(key, position in that key's
    queue)`` for at most ``limit`` tasks (None: all), and the state to continue from.

    ``queues``: each key's queued task costs, oldest first; ``weights``: a key's share (absent: 1);
    ``quantum``: the credit one turn of a weight-1 key adds (at least the largest cost, so every turn
    of such a key releases a task). ``state``: the previous call's, so turns go on where they
    stopped when the queues have changed in between (a key whose queue emptied leaves the ring)."""
    state = state or DrrState()
    ring = _ring(queues, state)
    credit = {k: quantum * weights.get(k, 1.0) for k in ring}
    deficits = {k: float(state.deficits.get(k, 0.0)) for k in ring}
    heads = {k: 0 for k in ring}
    started = state.started and bool(ring) and bool(state.ring) and ring[0] == state.ring[0]
    budget = sum(len(queues[k]) for k in ring) if limit is None else limit
    out: list[tuple[str, int]] = []
    idle_turns = 0
    while ring and len(out) < budget:
        k, q = ring[0], queues[ring[0]]
        if not started:
            deficits[k] += credit[k]
        started = False
        sent = len(out)
        while heads[k] < len(q) and q[heads[k]] <= deficits[k] and len(out) < budget:
            deficits[k] -= q[heads[k]]
            out.append((k, heads[k]))
            heads[k] += 1
        idle_turns = 0 if len(out) > sent else idle_turns + 1
        if heads[k] == len(q):  # emptied: leaves the ring with no credit kept
            ring.pop(0)
            del deficits[k]
            continue
        if len(out) >= budget and q[heads[k]] <= deficits[k]:
            return out, DrrState(deficits, tuple(ring), True)  # its turn goes on at the next call
        ring.append(ring.pop(0))
        if idle_turns >= len(ring):
            _skip_idle_turns(ring, {r: queues[r][heads[r]] for r in ring}, deficits, credit)
            idle_turns = 0
    return out, DrrState(deficits, tuple(ring), False)


@dataclass
class _Waiter:
    key: str  # the task's key
    cost: float
    granted: asyncio.Future[None]


class FairGate:
    """At most ``window`` tasks hold a slot at once; waiting ones get theirs by ``drr_order`` across
    tenants (API keys). ``tenant(scope)`` gives a job's or run's (key name, weight), read once per
    scope (``forget`` drops it); an unknown scope is its own tenant of weight 1. ``dispatched``
    keeps the keys granted, in order, up to ``log_limit`` (what tests and benches read).

    ``async with gate.slot(key, cost)`` waits for a slot and holds it until the block ends (the
    task's result read, failed or cancelled). One event loop drives a gate."""

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        tenant: Callable[[str], tuple[str, float]] | None = None,
        log_limit: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"the fair gate's window must be >= 1, got {window}")
        self.window = window
        self._tenant_of = tenant or (lambda scope: (scope, 1.0))
        self._tenants: dict[str, tuple[str, float]] = {}
        self._weights: dict[str, float] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._state = DrrState()
        self.in_flight = 0
        self.log_limit = log_limit
        self.dispatched: list[str] = []

    def tenant(self, scope: str) -> tuple[str, float]:
        found = self._tenants.get(scope)
        if found is None:
            found = self._tenants[scope] = self._tenant_of(scope)
        return found

    def forget(self, scope: str) -> None:
        self._tenants.pop(scope, None)

    def waiting(self) -> dict[str, int]:
        """Tasks waiting for a slot, per tenant."""
        return {t: len(q) for t, q in self._waiting.items() if q}

    def slot(self, key: str, cost: float) -> _Slot:
        return _Slot(self, key, cost)

    async def acquire(self, key: str, cost: float) -> None:
        name, weight = self.tenant(key.split(".", 1)[0])
        waiter = _Waiter(key, max(float(cost), 1.0), asyncio.get_running_loop().create_future())
        self._weights[name] = weight
        self._waiting.setdefault(name, deque()).append(waiter)
        self._grant()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release()  # granted while being cancelled: give the slot back
            else:
                queue = self._waiting.get(name)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._grant()

    def _grant(self) -> None:
        for name, queue in self._waiting.items():  # waiters cancelled before they ran on
            if any(w.granted.done() for w in queue):
                self._waiting[name] = deque(w for w in queue if not w.granted.done())
        free = self.window - self.in_flight
        queues = {t: [w.cost for w in q] for t, q in self._waiting.items() if q}
        if free <= 0 or not queues:
            return
        quantum = max(q[0] for q in queues.values())
        order, self._state = drr_order(queues, self._weights, quantum, self._state, free)
        for name, _ in order:  # positions in a key's queue come in order: its oldest first
            waiter = self._waiting[name].popleft()
            self.in_flight += 1
            waiter.granted.set_result(None)
            if len(self.dispatched) < self.log_limit:
                self.dispatched.append(waiter.key)
        for name in [t for t, q in self._waiting.items() if not q]:
            del self._waiting[name]


class _Slot:
    def __init__(self, gate: FairGate, key: str, cost: float) -> None:
        self.gate, self.key, self.cost = gate, key, cost

    async def __aenter__(self) -> None:
        await self.gate.acquire(self.key, self.cost)

    async def __aexit__(self, *exc: object) -> None:
        self.gate.release()
