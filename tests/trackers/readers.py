"""Reading trackers' files back with the libraries' own readers (TensorBoard's EventAccumulator,
MLflow's client, W&B's record protobuf), for the trackers' tests."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()["tensors"]  # scalar_pb writes its value as a tensor of the scalars plugin
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in tags:
        meta = acc.SummaryMetadata(tag)
        if meta.plugin_data.plugin_name == "scalars":
            out[tag] = [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors(tag)]
    return out


def tensorboard_texts(folder: Path, tag: str = "samples") -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    if tag not in acc.Tags()["tensors"]:
        return []
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def mlflow_run(uri: str, run_id: str) -> tuple[Any, str]:
    """The MLflow client on ``uri`` and the MLflow run tagged with Loom run ``run_id``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`loom.run_id` = '{run_id}'")
    assert len(runs) == 1, runs
    return client, runs[0].info.run_id


def mlflow_series(uri: str, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    client, mlflow_id = mlflow_run(uri, run_id)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(mlflow_id, k)) for k in keys}


# W&B writes a run as a LevelDB-style log of protobuf records: a 7-byte file header (":W&B", a 2-byte
# magic, a version byte), then 32 KiB blocks of records, each with a 7-byte header (CRC32, length,
# type: 1 full, 2 first, 3 middle, 4 last piece).
WANDB_BLOCK = 32 * 1024


def wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        piece = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def wandb_history(folder: Path) -> list[dict[str, Any]]:
    """The history rows of every offline run under ``folder`` (a tracker's dir), in order."""
    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                row.setdefault("_step", rec.history.step.num)
                rows.append(row)
    return rows
