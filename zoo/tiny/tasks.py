"""Synthetic reasoning tasks with gold answers and exact verifiers (loom.exact), seeded and reproducible.

Two families:
- ``arith``: multi-digit ``a+b``, ``a-b`` (a >= b) and ``a*b`` (b one digit by default), digit counts
  as difficulty knobs;
- ``countdown``: ``n`` numbers and a target reachable with + - * / using every number once (solvable
  by construction: the target is the value of a random expression over the numbers).

Held-out split: a problem is held out when the hash of its key falls in the test bucket, so train and
test never share a problem whatever seeds draw them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Literal

from loom.exact import check_arithmetic, check_countdown

Kind = Literal["arith", "countdown"]
Split = Literal["train", "test", "any"]

OP_WORDS = {"+": "sum", "-": "difference", "*": "product"}
TEST_BUCKETS = 10  # 1 in TEST_BUCKETS problems is held out


@dataclass(frozen=True)
class Problem:
    kind: Kind
    text: str  # the problem statement, e.g. "Compute 47+85." or "Use 3 5 7 to make 22."
    gold: str  # arith: the value; countdown: a fully parenthesised expression reaching the target
    a: int = 0
    b: int = 0
    op: str = ""
    numbers: tuple[int, ...] = ()
    target: int = 0
    steps: tuple[tuple[int, str, int, int], ...] = field(default=())  # countdown: (x, op, y, result)

    @property
    def key(self) -> str:
        return self.text

    def verify(self, answer: str | None) -> bool:
        """Exact check of an extracted answer (never evaluates model text as code)."""
        if answer is None:
            return False
        if self.kind == "arith":
            return check_arithmetic(answer, self.gold)
        return check_countdown(answer, list(self.numbers), self.target)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["numbers"] = list(self.numbers)
        d["steps"] = [list(s) for s in self.steps]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Problem:
        d = dict(d)
        d["numbers"] = tuple(d.get("numbers", ()))
        d["steps"] = tuple(tuple(s) for s in d.get("steps", ()))
        return cls(**d)


def is_held_out(problem: Problem) -> bool:
    digest = hashlib.sha256(problem.key.encode()).digest()
    return digest[0] % TEST_BUCKETS == 0


def _in_split(problem: Problem, split: Split) -> bool:
    return split == "any" or is_held_out(problem) == (split == "test")


def _rand_digits(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def arith_problem(
    rng: random.Random,
    ops: tuple[str, ...] = ("+", "-", "*"),
    digits: tuple[int, int] = (2, 3),
    mul_digits_b: tuple[int, int] = (1, 1),
) -> Problem:
    op = rng.choice(ops)
    da = rng.randint(*digits)
    db = rng.randint(*(mul_digits_b if op == "*" else digits))
    a, b = _rand_digits(rng, da), _rand_digits(rng, db)
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Problem(kind="arith", text=f"Compute {a}{op}{b}.", gold=str(value), a=a, b=b, op=op)


def _apply(x: int, op: str, y: int) -> int | None:
    if op == "+":
        return x + y
    if op == "-":
        return x - y if x >= y else None
    if op == "*":
        return x * y
    return x // y if y != 0 and x % y == 0 else None


def countdown_problem(
    rng: random.Random, n_numbers: int = 3, max_number: int = 9, max_target: int = 99
) -> Problem:
    """Draw numbers, then combine a random pair with a random valid op until one value is left.
    Settings that admit no problem (say max_number 1) raise ValueError after 100 000 draws."""
    for _ in range(100_000):
        numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
        pool: list[tuple[int, str]] = [(n, str(n)) for n in numbers]
        steps: list[tuple[int, str, int, int]] = []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (x, ex), (y, ey) = pool[i], pool[j]
            if x < y:
                (x, ex), (y, ey) = (y, ey), (x, ex)
            op = rng.choice("+-*/")
            r = _apply(x, op, y)
            if r is None or (op in "*/" and y == 1):
                break
            steps.append((x, op, y, r))
            pool = [p for k, p in enumerate(pool) if k not in (i, j)]
            pool.append((r, f"({ex}{op}{ey})" if len(pool) > 0 else f"{ex}{op}{ey}"))
        if len(pool) != 1:
            continue
        target, expr = pool[0]
        if not (1 <= target <= max_target) or target in numbers:
            continue
        shown = " ".join(str(n) for n in numbers)
        return Problem(
            kind="countdown",
            text=f"Use {shown} to make {target}.",
            gold=expr,
            numbers=tuple(numbers),
            target=target,
            steps=tuple(steps),
        )
    raise ValueError(
        f"no countdown problem with n_numbers={n_numbers}, max_number={max_number}, max_target={max_target}"
    )


# The distribution the built-in tiny model is trained and evaluated on (RL runs should draw from it).
TINY_KNOBS: dict[str, dict[str, object]] = {
    "arith": {"ops": ("+", "-"), "digits": (2, 3)},
    "countdown": {"n_numbers": 3, "max_number": 9},
}


def tiny_problems(kind: Kind, n: int, seed: int, split: Split = "any") -> list[Problem]:
    """``make_problems`` with the tiny model's knobs (TINY_KNOBS)."""
    return make_problems(kind, n, seed, split, **TINY_KNOBS[kind])


HELDOUT_SEED = 10_000  # the card's held-out sets: tiny_problems(kind, n, HELDOUT_SEED, "test")


def make_problems(kind: Kind, n: int, seed: int, split: Split = "any", **knobs: object) -> list[Problem]:
    """``n`` distinct problems of ``kind`` from ``seed`` in ``split`` (same arguments, same list)."""
    rng = random.Random(f"{kind}:{seed}")
    gen = arith_problem if kind == "arith" else countdown_problem
    out: list[Problem] = []
    seen: set[str] = set()
    tries = since_new = 0
    while len(out) < n:
        tries += 1
        since_new += 1
        # the second bound ends an exhausted space in well under a second instead of 200 n draws
        if tries > 200 * n + 1000 or since_new > 20_000:
            raise ValueError(f"cannot draw {n} distinct {kind} problems with {knobs} (found {len(out)})")
        p = gen(rng, **knobs)  # type: ignore[arg-type]
        if p.key in seen or not _in_split(p, split):
            continue
        seen.add(p.key)
        out.append(p)
        since_new = 0
    return out
