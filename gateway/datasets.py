"""Run datasets: Loom's built-in synthetic tasks (zoo.tiny.tasks; ``code``: the code model's programming
problems, zoo.code.tasks) or uploaded JSONL of {prompt, answer}.

Uploaded JSONL is never held whole in memory: ``DatasetWriter`` takes it in chunks (the stream of
``POST /v1/datasets``, or a run's inline ``jsonl`` text), checks each line as it comes and writes it to
``<data_dir>/datasets/<id>.jsonl`` with an index of line offsets (``<id>.idx``); the id is the SHA-256
of the content, so the same upload is the same dataset. A run reads the rows of each step from the
file (``StoredDataset``): a 150k-line dataset costs the gateway its index (8 bytes a line), not
150k parsed items.

A stored dataset belongs to the keys that stored it (``DatasetStore.add``, inside the
transaction that checks the key's dataset quota): a run of another key that names its id is told
exactly what an unknown id is told (``open_owned``), and the same content stored by two keys is one
file with two owners.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from gateway.models import DATASET_ID, KNOBS, DatasetSpec, TaskItem
from loom.contracts.modes import MODE_PARAMS
from loom.contracts.wire import unencodable_path

if TYPE_CHECKING:
    from gateway.quotas import Quotas
    from gateway.state import GatewayState

MAX_PROMPT_CHARS = 100_000  # TaskItem.prompt's limit

BUILTIN_TASK_KIND = {"arith": "arithmetic", "countdown": "countdown"}


class DatasetError(ValueError):
    pass


class DatasetTooLarge(DatasetError):
    """The upload passed the writer's ``max_bytes`` (``size``: its bytes so far)."""

    def __init__(self, max_bytes: int, size: int) -> None:
        self.max_bytes, self.size = max_bytes, size
        super().__init__(f"the dataset exceeds {max_bytes} bytes")


# (dataset id, items, bytes, place): store the dataset for its key; ``place()`` puts its files in place
Admit = Callable[[str, int, int, Callable[[], None]], Any]


def no_dataset(dataset_id: str) -> DatasetError:
    """What a run naming an id it cannot read is told, whether the id was never stored or is another
    key's: the answer says nothing of other keys' datasets."""
    return DatasetError(f"no dataset {dataset_id} (POST /v1/datasets stores one)")


def builtin_item(problem: Any, mode: str) -> TaskItem:
    """One synthetic problem as a run item: the tiny model's prompt in ``mode``'s format (its
    ``BUILTIN_FORMAT``, zoo.tiny.traces.posed) and an exact label (arithmetic: the value; Countdown:
    the numbers and target as JSON, as reward_svc expects)."""
    from zoo.tiny.traces import posed

    kind = BUILTIN_TASK_KIND[problem.kind]
    if problem.kind == "countdown":
        label = json.dumps({"numbers": list(problem.numbers), "target": problem.target})
    else:
        label = problem.gold
    prompt, mode_params = posed(problem, MODE_PARAMS[mode].BUILTIN_FORMAT)
    return TaskItem(prompt=prompt, label=label, task=kind, mode_params=mode_params)  # type: ignore[arg-type]


def code_item(problem: Any) -> TaskItem:
    """One built-in programming problem as a run item: the code model's prompt and its tests as the
    label of a ``code`` task (reward_svc/code.py's assert form)."""
    from zoo.code import code_prompt

    return TaskItem(prompt=code_prompt(problem), label=problem.label, task="code")


def builtin_items(spec: DatasetSpec, mode: str) -> list[TaskItem]:
    """A built-in dataset's training-split items for ``mode`` (without knobs, the distribution its
    built-in model was trained on)."""
    knobs = KNOBS[spec.builtin or ""].model_validate(spec.knobs).model_dump(exclude_unset=True)
    if spec.builtin == "code" and mode != "plain":
        raise DatasetError(f"the built-in code tasks are plain prompts; mode {mode!r} needs others")
    try:
        if spec.builtin == "code":
            from zoo.code import code_problems

            sources = tuple(knobs.get("sources", ("list", "range", "string")))
            return [code_item(p) for p in code_problems(spec.size, spec.seed, "train", sources)]
        from zoo.tiny.tasks import TINY_KNOBS, make_problems

        kind = spec.builtin or "arith"
        problems = make_problems(kind, spec.size, spec.seed, split="train", **(knobs or TINY_KNOBS[kind]))  # type: ignore[arg-type]
    except ValueError as exc:  # too few distinct problems for ``size`` under these knobs
        raise DatasetError(str(exc)) from None
    return [builtin_item(p, mode) for p in problems]


def _check_line(line: str, lineno: int) -> bool:
    """Whether line ``lineno`` holds an item (False: blank); DatasetError naming the line if it is not a
    JSON object with a non-empty string ``prompt`` (and an optional ``answer``)."""
    if not line.strip():
        return False
    try:
        row = json.loads(line)
        prompt = row["prompt"]
        row.get("answer")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise DatasetError(f"jsonl line {lineno}: expected an object with 'prompt' and 'answer'") from exc
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"jsonl line {lineno}: 'prompt' must be a non-empty string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise DatasetError(f"jsonl line {lineno}: 'prompt' is longer than {MAX_PROMPT_CHARS} characters")
    where = unencodable_path(row)  # a \ud800 escape: a lone surrogate, which UTF-8 cannot encode
    if where is not None:
        raise DatasetError(
            f"jsonl line {lineno}: '{where.lstrip('.')[:200]}' holds a lone surrogate (a \\ud800-\\udfff "
            "escape), which UTF-8 cannot encode: text must be valid Unicode"
        )
    return True


class DatasetWriter:
    """JSONL in chunks -> a stored dataset (see the module docstring). ``feed`` each chunk, then
    ``finish()`` -> (id, items); a bad line raises DatasetError naming it (nothing is stored)."""

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=root, prefix=".upload-", suffix=".jsonl")
        self._file = os.fdopen(fd, "wb")
        self._tmp = Path(name)
        self._hash = hashlib.sha256()
        self._offsets = array("q")
        self._rest = b""
        self._written = 0
        self._lineno = 0
        self._placed = False

    def feed(self, chunk: bytes) -> None:
        """The complete lines of ``chunk`` (after what is left of the previous one) are checked and
        written; an unfinished last line waits for the next chunk."""
        size = self._written + len(self._rest) + len(chunk)
        if self.max_bytes is not None and size > self.max_bytes:
            self.abort()
            raise DatasetTooLarge(self.max_bytes, size)
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        if cut:
            self._lines(data[:cut])

    def _lines(self, data: bytes) -> None:
        try:
            text = data.decode("utf-8")  # whole lines: a newline never splits a UTF-8 sequence
        except UnicodeDecodeError as exc:
            self.abort()
            lineno = self._lineno + data.count(b"\n", 0, exc.start) + 1
            raise DatasetError(f"jsonl line {lineno}: not valid UTF-8") from None
        kept: list[str] = []
        for line in text[:-1].split("\n"):  # ``data`` ends with its last line's newline
            self._lineno += 1
            try:
                has_item = _check_line(line, self._lineno)
            except DatasetError:
                self.abort()
                raise
            if has_item:
                self._offsets.append(self._written)
                row = line.rstrip("\r") + "\n"
                self._written += len(row.encode())
                kept.append(row)
        out = "".join(kept).encode()
        self._file.write(out)
        self._hash.update(out)

    def finish(self, admit: Admit | None = None) -> tuple[str, int]:
        """(id, items) of the stored dataset. ``admit``: stores it for a key (its quota, its ownership),
        calling ``place`` to put the files in place; what it raises leaves nothing stored."""
        if self._rest:  # a last line without a newline
            rest, self._rest = self._rest, b""
            self._lines(rest + b"\n")
        self._file.close()
        if not self._offsets:
            self.abort()
            raise DatasetError("the dataset is empty")
        dataset_id = "ds-" + self._hash.hexdigest()[:24]
        data, index = self.root / f"{dataset_id}.jsonl", self.root / f"{dataset_id}.idx"
        fd, name = tempfile.mkstemp(dir=self.root, prefix=".upload-", suffix=".idx")
        index_tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            self._offsets.tofile(f)

        def place() -> None:
            os.replace(index_tmp, index)  # the index first: a data file implies one
            os.replace(self._tmp, data)
            self._placed = True

        try:
            if admit is None:
                place()
            else:
                admit(dataset_id, len(self._offsets), self._written, place)
        finally:
            if not self._placed:
                index_tmp.unlink(missing_ok=True)
                self.abort()
        return dataset_id, len(self._offsets)

    def abort(self) -> None:
        """Remove what was written (nothing once the dataset is in place)."""
        if not self._file.closed:
            self._file.close()
        if not self._placed:
            self._tmp.unlink(missing_ok=True)


def store_jsonl(text: str, root: Path, admit: Admit | None = None) -> tuple[str, int]:
    """A run's inline JSONL text as a stored dataset (the same checks and id as an upload)."""
    writer = DatasetWriter(root)
    try:
        data = text.encode()
    except UnicodeEncodeError:
        writer.abort()
        raise DatasetError("the jsonl holds a lone surrogate, which UTF-8 cannot encode") from None
    for i in range(0, len(data), 1 << 20):
        writer.feed(data[i : i + (1 << 20)])
    return writer.finish(admit)


def owner_admit(state: GatewayState, owner: str, quotas: Quotas | None) -> Admit:
    """``finish``'s ``admit`` for ``owner``: its ownership row, checked against its dataset quota
    (QuotaExceeded) in the same transaction."""

    def admit(dataset_id: str, n_items: int, n_bytes: int, place: Callable[[], None]) -> None:
        state.datasets.add(owner, dataset_id, n_bytes, n_items, quotas, place)

    return admit


def open_owned(
    state: GatewayState, root: Path, owner: str, dataset_id: str, task: Any = None
) -> StoredDataset:
    """``owner``'s stored dataset ``dataset_id``; another key's is refused exactly as an unknown id."""
    if not DATASET_ID.fullmatch(dataset_id) or not state.datasets.owns(owner, dataset_id):
        raise no_dataset(dataset_id)
    return StoredDataset(root, dataset_id, task)


def remove_files(root: Path, dataset_id: str) -> None:
    """A dataset's files (the data first: an index without data is no dataset)."""
    if DATASET_ID.fullmatch(dataset_id):
        (root / f"{dataset_id}.jsonl").unlink(missing_ok=True)
        (root / f"{dataset_id}.idx").unlink(missing_ok=True)


class StoredDataset(Sequence[TaskItem]):
    """The items of a stored dataset, read from its file row by row."""

    def __init__(self, root: Path, dataset_id: str, task: Any = None) -> None:
        self.path = root / f"{dataset_id}.jsonl"
        self.task = task
        if not DATASET_ID.fullmatch(dataset_id) or not self.path.exists():
            raise no_dataset(dataset_id)
        self._offsets = array("q")
        with open(root / f"{dataset_id}.idx", "rb") as f:
            self._offsets.frombytes(f.read())

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, i: int) -> TaskItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[TaskItem]: ...
    def __getitem__(self, i: int | slice) -> TaskItem | list[TaskItem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        with open(self.path, "rb") as f:
            f.seek(self._offsets[i])
            row = json.loads(f.readline())
        answer = row.get("answer")
        return TaskItem(prompt=row["prompt"], label=None if answer is None else str(answer), task=self.task)

    def __iter__(self) -> Iterator[TaskItem]:
        return (self[i] for i in range(len(self)))


def load_dataset(spec: DatasetSpec, mode: str = "plain", data_dir: Path | None = None) -> Sequence[TaskItem]:
    """The run's items. Built-in tasks come formatted for ``mode`` in the tiny model's prompt format;
    uploaded ones are read from ``<data_dir>/datasets`` (inline ``jsonl`` is stored there first)."""
    if spec.builtin is not None:
        return builtin_items(spec, mode)
    root = dataset_root(data_dir)
    dataset_id = spec.id
    if dataset_id is None:
        dataset_id, _ = store_jsonl(spec.jsonl or "", root)
    return StoredDataset(root, dataset_id, spec.task)


def dataset_root(data_dir: Path | None) -> Path:
    if data_dir is None:
        from loom.contracts.settings import get_settings

        data_dir = Path(get_settings().data_dir)
    return Path(data_dir) / "datasets"


def step_indices(n_items: int, batch_size: int, seed: int, step: int, draw: int = 0) -> list[int]:
    """The dataset rows of ``step``: a pure function of (seed, step), so a resumed run draws the same.
    ``draw`` > 0: the step's further batches (a run's ``filter_max_batches``), each its own draw."""
    rng = random.Random(f"{seed}:{step}" if draw == 0 else f"{seed}:{step}:{draw}")
    if batch_size <= n_items:
        return rng.sample(range(n_items), batch_size)
    return [rng.randrange(n_items) for _ in range(batch_size)]
