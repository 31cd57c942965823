"""Experiment trackers (docs/trackers.md): a run's per-step metrics and a few sample trajectories go to
TensorBoard, Weights & Biases (offline) and/or MLflow, as trainers' own loops log them.

One ``Tracker`` protocol, one class per library; each imports its library only when a run opens it
(each is an optional extra). ``Trackers`` fans a step out to every tracker of a run and never lets a
tracker's failure reach the run loop: a tracker that cannot open or write is logged and skipped, and
the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gateway.models import TrackerSpec

log = logging.getLogger("loom.gateway.trackers")

NOT_SERIES = ("step", "time")  # the x axis and the wall clock: not curves
SAMPLE_COLUMNS = ("group_id", "prompt", "response", "reward", "components", "status", "finish_reason")
DEFAULT_PROJECT = "loom"


class Tracker(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None: ...

    def close(self, status: str) -> None: ...


def parse_setting(text: str) -> list[TrackerSpec]:
    """``LOOM_TRACKERS``: comma-separated names or a JSON list of TrackerSpec objects."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        return [TrackerSpec.model_validate(e) for e in json.loads(text)]
    return [TrackerSpec.model_validate({"name": n.strip()}) for n in text.split(",") if n.strip()]


def resolve(requested: Sequence[TrackerSpec] | None, setting: str) -> list[TrackerSpec]:
    """The run's trackers: its own list (an empty list: none), else the setting's. A requested tracker
    takes the operator's tracking_uri for its name: a request cannot name a server."""
    configured = parse_setting(setting)
    if requested is None:
        return configured
    operator = {t.name: t for t in configured}
    out = []
    for t in requested:
        op = operator.get(t.name)
        out.append(t.model_copy(update={"tracking_uri": op.tracking_uri}) if op and op.tracking_uri else t)
    return out


def series(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step, as floats (booleans count as 0/1)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k not in NOT_SERIES and isinstance(v, int | float) and v == v  # NaN: not a point
    }


def samples_markdown(samples: Sequence[dict[str, Any]]) -> str:
    """A markdown table of the samples (TensorBoard's text plugin renders markdown)."""

    def cell(v: Any) -> str:
        text = json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(s.get(c)) for c in SAMPLE_COLUMNS) + " |\n" for s in samples)


class TensorBoardTracker:
    """Event files (tensorboard's own writer, no torch or TensorFlow): scalars per metric, samples as
    text."""

    name = "tensorboard"

    def __init__(self, spec: TrackerSpec, run_id: str, folder: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        folder.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.writer = EventFileWriter(str(folder), flush_secs=5)

    def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        summary = Summary()
        for tag, value in metrics.items():
            summary.value.extend(scalar_pb(tag, value).value)
        if samples and self.spec.samples_per_step:
            summary.value.extend(
                text_pb("samples", samples_markdown(samples[: self.spec.samples_per_step])).value
            )
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in offline mode (no network; ``wandb sync <dir>/wandb/offline-run-*`` uploads it later);
    its id is the Loom run id, so a resumed run continues the same W&B run."""

    name = "wandb"

    def __init__(self, spec: TrackerSpec, run_id: str, folder: Path) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.wandb = wandb
        self.run = wandb.init(
            mode="offline",
            dir=str(folder),
            project=spec.project or DEFAULT_PROJECT,
            id=run_id,
            name=run_id,
            resume="allow",
            reinit="create_new",  # several runs of one gateway process log at once
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False),
        )

    def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None:
        row: dict[str, Any] = dict(metrics)
        if samples and self.spec.samples_per_step:
            rows = [
                [json.dumps(s.get(c)) if c == "components" else s.get(c) for c in SAMPLE_COLUMNS]
                for s in samples
            ]
            row["samples"] = self.wandb.Table(
                columns=list(SAMPLE_COLUMNS), data=rows[: self.spec.samples_per_step]
            )
        self.run.log(row, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "succeeded" else 1)


class MlflowTracker:
    """An MLflow run (experiment ``project``) tagged with the Loom run id: a resumed run logs into the
    same MLflow run. Samples are a JSON artifact per step (``samples/step_000000.json``)."""

    name = "mlflow"

    def __init__(self, spec: TrackerSpec, run_id: str, folder: Path) -> None:
        from mlflow.tracking import MlflowClient

        uri = spec.tracking_uri
        if uri is None:
            folder.mkdir(parents=True, exist_ok=True)
            uri = folder.resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses new file stores unless asked: a local store needs no server nor database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.spec = spec
        self.client = MlflowClient(tracking_uri=uri)
        project = spec.project or DEFAULT_PROJECT
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`loom.run_id` = '{run_id}'")
        run = (
            found[0]
            if found
            else self.client.create_run(experiment_id, run_name=run_id, tags={"loom.run_id": run_id})
        )
        self.run_id = run.info.run_id

    def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(key=k, value=v, timestamp=now, step=step) for k, v in metrics.items()]
        for i in range(0, len(points), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=points[i : i + 1000])
        if samples and self.spec.samples_per_step:
            self.client.log_dict(
                self.run_id,
                {"step": step, "samples": list(samples[: self.spec.samples_per_step])},
                f"samples/step_{step:06d}.json",
            )

    def close(self, status: str) -> None:
        final = {"succeeded": "FINISHED", "cancelled": "KILLED", "interrupted": "RUNNING"}.get(
            status, "FAILED"
        )
        if final != "RUNNING":  # a gateway stopping mid-run resumes it later
            self.client.set_terminated(self.run_id, status=final)


KINDS: dict[str, type[TensorBoardTracker] | type[WandbTracker] | type[MlflowTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def tracker_folder(spec: TrackerSpec, run_dir: Path) -> Path:
    """``dir`` is relative to the run's folder (checked by TrackerSpec); default trackers/<name>."""
    return run_dir / (spec.dir or f"trackers/{spec.name}")


class Trackers:
    """The trackers of one run. Every call catches a tracker's exception, logs it and goes on."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)
        self.failures: dict[str, int] = {t.name: 0 for t in self.trackers}

    @classmethod
    def open(cls, specs: Sequence[TrackerSpec], run_id: str, run_dir: Path) -> Trackers:
        opened: list[Tracker] = []
        for spec in specs:
            try:
                opened.append(KINDS[spec.name](spec, run_id, tracker_folder(spec, run_dir)))
            except Exception:
                log.exception(
                    "run %s: tracker %s could not open; the run goes on without it", run_id, spec.name
                )
        return cls(opened)

    def log(self, step: int, metrics: dict[str, Any], samples: Sequence[dict[str, Any]]) -> None:
        points = series(metrics)
        for t in self.trackers:
            try:
                t.log(step, points, samples)
            except Exception:
                self.failures[t.name] += 1
                # the first failure with its traceback, later ones in one line
                log.warning(
                    "tracker %s failed at step %d (%d failures); the run goes on",
                    t.name,
                    step,
                    self.failures[t.name],
                    exc_info=self.failures[t.name] == 1,
                )

    def close(self, status: str) -> None:
        for t in self.trackers:
            try:
                t.close(status)
            except Exception:
                log.warning("tracker %s failed to close", t.name, exc_info=True)
