"""Read back what the metric sinks wrote: TensorBoard event files and W&B offline run files.

The W&B reader walks the run's `.wandb` file (a header, then 32 KiB blocks of records framed
like LevelDB's log: crc32 u32, length u16, type u8 = full/first/middle/last) and decodes each
record with wandb's own protobuf; current wandb releases ship no reader of their own."""
from __future__ import annotations

import glob
import json
import struct

BLOCK = 32768


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(log_dir)
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _records(path: str):
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, buf = 7, b""
    while pos + 7 <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last fragment: one record is complete
            yield buf
            buf = b""


def wandb_history(run_dir: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    rows = []
    for data in _records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows
