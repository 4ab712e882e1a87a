"""--report_to tensorboard wandb swanlab: every sink receives the rows of metrics.jsonl.

The real libraries run in offline mode (WANDB_MODE / SWANLAB_MODE = offline); each
sink's files are read back with its own record format and compared with metrics.jsonl.
"""
import glob
import json
import os
import time

import pytest

from megatron_grpo.train.logger import RunLogger

STEPS = [{"reward": 0.25, "loss": 1.5, "kl": 0.0, "timing/train": 0.5},
         {"reward": 0.5, "loss": 0.75, "kl": 0.125, "timing/train": 0.25},
         {"reward": 0.875, "loss": 0.5, "kl": float("nan"), "timing/train": 0.125}]


def _log(out, report_to, **names):
    logger = RunLogger(str(out), len(STEPS), report_to=report_to, **names)
    for i, m in enumerate(STEPS, 1):
        logger.log(i, m)
    png = logger.close()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert os.path.isfile(png)
    # What a sink must have received: every finite value, by step (NaN -> left out).
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and v is not None} for r in rows}


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = _log(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            got.setdefault(ev.step, {})[tag] = ev.value
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-6)


def _settled(path, seconds=10.0):
    """The bytes of `path` once its size has stopped changing (wandb's service process
    writes the file; finish() has returned by then, but a loaded machine once showed a
    file without its run record), waiting at most `seconds`."""
    deadline, last = time.monotonic() + seconds, -1
    while time.monotonic() < deadline:
        size = os.path.getsize(path)
        if size == last:
            break
        last = size
        time.sleep(0.5)
    with open(path, "rb") as f:
        return f.read()


def _wandb_history(path, record="history"):
    """History rows of an offline .wandb file (LevelDB log blocks of Record protos); with
    record="run": the run records (project, display_name); with record="types": the type
    of every record (for a failure's message)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block, chunk, rows = _settled(path), 7, 32768, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:                        # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:       # zero padding up to the block's end
            pos += left
            continue
        chunk += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            if record == "types":
                rows.append(rec.WhichOneof("record_type"))
            elif record == "run" and rec.WhichOneof("record_type") == "run":
                rows.append(rec.run)
            elif record == "history" and rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    want = _log(tmp_path, ["wandb"])
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    got = {r["_step"]: {k: v for k, v in r.items() if not k.startswith("_")}
           for r in _wandb_history(path)}
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-12)


def test_wandb_project_and_name(tmp_path, monkeypatch):
    """--wandb_project / --wandb_exp_name name the run (ms-swift's options)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log(tmp_path, ["wandb"], wandb_project="grpo-port", wandb_exp_name="dense-colocate")
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    runs = _wandb_history(path, record="run")
    assert runs, (os.path.getsize(path), _wandb_history(path, record="types"))
    assert runs[0].project == "grpo-port" and runs[0].display_name == "dense-colocate"


def test_swanlab_offline(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    monkeypatch.setenv("SWANLAB_MODE", "offline")
    want = _log(tmp_path, ["swanlab"])
    (path,) = glob.glob(str(tmp_path / "**" / "run-*.swanlab"), recursive=True)
    reader = DataStoreReader()
    reader.open(path)
    got = {}
    for data in reader:
        rec = record_pb2.Record()
        rec.ParseFromString(data)
        if rec.HasField("scalar"):
            got.setdefault(rec.scalar.step, {})[rec.scalar.key] = rec.scalar.value.number
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-12)


def test_a_resume_restores_the_checkpoint_steps_row_when_the_crash_lost_it(tmp_path):
    """A run killed between a checkpoint's save and its step's metrics row: the resumed
    run writes the row the checkpoint kept, once; rows after the checkpoint are dropped."""
    out = str(tmp_path)
    path = os.path.join(out, "metrics.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "reward": 0.1}) + "\n")
        f.write(json.dumps({"step": 3, "reward": 0.3}) + "\n")     # after the checkpoint
    for _ in range(2):     # a second resume from the same checkpoint adds nothing
        RunLogger(out, 4, start_step=2, last_row={"reward": 0.2, "loss": 1.0},
                  report_to=()).close()
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        assert rows == [{"step": 1, "reward": 0.1}, {"step": 2, "loss": 1.0, "reward": 0.2}]
