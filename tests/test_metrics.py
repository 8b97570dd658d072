"""The console step line (metrics.format_line)."""

import json

from areal_async.metrics import format_line


def test_the_step_line_names_rates_for_what_they_are_and_shows_entropy_and_lr():
    line = format_line(3, 30, {"rollout/correct": 0.5, "train/loss": -0.01, "train/entropy": 0.1234,
                               "train/lr": 2e-5, "perf/trained_tokens_per_s": 812.4,
                               "rollout/tokens_per_s": 4.2, "perf/step_s": 150.0, "train/tokens": 7400.0})
    assert line == ("step    3/30 | correct 0.50 | loss -0.0100 | entropy 0.123 | lr 2.00e-05 | "
                    "train 812 tok/s | rollout 4 tok/step-s | 150.0 s")
    assert format_line(30, 30, {"eval/pass@1": 0.25, "train/entropy": float("nan")}) == \
        "step   30/30 | eval pass@1 0.250"


def test_wandb_group_and_tags_come_from_the_logging_config(tmp_path, monkeypatch):
    # a staleness study's cells share one group (the study) and carry eta/objective/seed tags
    import wandb

    from areal_async.config import LoggingConfig
    from areal_async.metrics import MetricsLogger

    calls = []

    class Run:
        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or Run())
    tags = ["eta=2", "objective=naive", "seed=1"]
    MetricsLogger(tmp_path / "a", LoggingConfig(wandb_group="study", wandb_tags=tags), "eta2-naive-s1", {}).close()
    MetricsLogger(tmp_path / "b", LoggingConfig(), "plain", {}).close()
    assert (calls[0]["group"], calls[0]["name"], calls[0]["tags"]) == ("study", "eta2-naive-s1", tags)
    assert (calls[1]["group"], calls[1]["tags"]) == ("plain", [])  # default: grouped by the run's name


def _offline_runs(run_dir, timeout_s: float = 60.0):
    """Each offline wandb run written under ``run_dir``, in start order, read back from its
    transaction log (``run-<id>.wandb``: wandb's leveldb-style log, a 7-byte header then 32 KiB
    blocks of chunks ``crc32 u32 | length u16 | type u8 (1 full, 2 first, 3 middle, 4 last) |
    data``, each record a ``wandb_internal_pb2.Record``): ``{"id", "name", "group", "config",
    "start", "rows": {step: {key: value}}}``.

    wandb-core writes the log after ``finish()`` returns (seen: a 7-byte file right after it, the
    whole log 0.2 s later), so this waits until every log holds its run's exit record."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        runs = [_read_offline_run(path) for path in (run_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")]
        if all(run["exited"] for run in runs) or time.monotonic() > deadline:
            assert all(run["exited"] for run in runs), f"an offline run's log has no exit record after {timeout_s} s"
            return sorted(runs, key=lambda r: r["start"])
        time.sleep(0.05)  # polls a file another process writes: there is no event to wait on


def _read_offline_run(path):
    """One transaction log as ``_offline_runs`` describes it, plus ``exited``: whether its exit
    record is in (a log still being written ends early, perhaps inside a chunk)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    buf, pos, parts = path.read_bytes(), 7, b""
    run = {"rows": {}, "exited": False, "start": 0}
    assert len(buf) < 7 or buf[:4] == b":W&B", path
    while pos + 7 <= len(buf):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        if pos + 7 + length > len(buf):
            break
        data, pos = buf[pos + 7:pos + 7 + length], pos + 7 + length
        parts = data if kind in (1, 2) else parts + data
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record.FromString(parts)
        if record.HasField("run"):
            r = record.run
            config = {i.key: json.loads(i.value_json) for i in r.config.update}
            run |= {"id": r.run_id, "name": r.display_name, "group": r.run_group, "config": config,
                    "start": r.start_time.ToNanoseconds()}
        elif record.HasField("history"):
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            run["rows"][record.history.step.num] = row
        elif record.HasField("exit"):
            run["exited"] = True
    return run


def _kept_by_wandb(runs):
    """What wandb keeps of ``runs`` (from ``_offline_runs``) per run id: {id: {step: row}}.

    wandb keeps a run's steps increasing: a row is kept only above the run's last step. A job that
    resumes a run id starts at the run's next step (online: from the server, and the handler drops
    lower rows with "Tried to log to step k that is less than the current step"), and ``wandb
    sync`` uploads the offline jobs of one run id in start order, each continuing the run the
    previous one left (wandb-core's runsync; a lower step there is renumbered or dropped, never
    written at its step). An offline job alone does not show this: it does not know the run's
    steps and records every row."""
    kept = {}
    for run in runs:
        rows = kept.setdefault(run["id"], {})
        for step, row in sorted(run["rows"].items()):
            if not rows or step > max(rows):
                rows[step] = row
    return kept


def test_a_resumed_job_gets_wandb_to_agree_with_metrics_jsonl(tmp_path):
    # A job logs steps 0-4 and stops with its checkpoint at step 3 (after step 2); the resumed
    # job logs steps 3-5 with new values (+100). metrics.jsonl drops the stopped job's rows 3-4
    # and gets the new ones; wandb must record the new value at step 3, in a run whose steps are
    # not already past 3, and the stopped job's run holds the same steps 0-2 as metrics.jsonl.
    from areal_async.config import LoggingConfig
    from areal_async.metrics import MetricsLogger
    from areal_async.trainer.resume import drop_superseded_rows

    cfg = LoggingConfig(wandb_mode="offline", wandb_group="study", wandb_tags=["eta=1"])
    logger = MetricsLogger(tmp_path, cfg, "x", {"seed": 1}, 6)
    for step in range(5):
        logger.log(step, {"train/loss": float(step)})
    logger.log(3, {"eval/pass@1": 0.5})  # the evaluation of version 3, which a resume does not repeat
    logger.close()
    drop_superseded_rows(tmp_path / "metrics.jsonl", 3)
    logger = MetricsLogger(tmp_path, cfg, "x", {"seed": 1}, 6, resumed_at=3)
    for step in range(3, 6):
        logger.log(step, {"train/loss": 100.0 + step})
    logger.close()

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("train/loss")) for r in jsonl] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, None), (3, 103.0), (4, 104.0), (5, 105.0)]
    stopped, resumed = _offline_runs(tmp_path)
    kept = _kept_by_wandb([stopped, resumed])
    assert kept[resumed["id"]][3]["train/loss"] == 103.0  # the new value, at its step
    assert {s: r["train/loss"] for s, r in kept[resumed["id"]].items()} == {3: 103.0, 4: 104.0, 5: 105.0}
    assert kept[resumed["id"]][3]["eval/pass@1"] == 0.5  # the kept evaluation row is in the new run too
    assert {s: r["train/loss"] for s, r in kept[stopped["id"]].items() if s < 3} == {0: 0.0, 1: 1.0, 2: 2.0}
    # the new run sits with the stopped one in the dashboard and says where it took over
    assert (stopped["name"], resumed["name"]) == ("x", "x-r1")
    assert stopped["group"] == resumed["group"] == "study"
    assert resumed["config"]["resumed_from"] == {"step": 3, "runs": [stopped["id"]]}
    assert resumed["config"]["seed"] == 1 and "resumed_from" not in stopped["config"]
    runs = [json.loads(line) for line in (tmp_path / "wandb_runs.jsonl").read_text().splitlines()]
    assert runs == [{"id": stopped["id"], "name": "x", "start_step": 0},
                    {"id": resumed["id"], "name": "x-r1", "start_step": 3}]


def test_a_run_directory_from_before_the_runs_file_resumes_after_its_one_run(tmp_path):
    # such a directory holds its job's wandb run id in wandb_run_id
    from areal_async.metrics import RUNS_FILE, _earlier_runs

    assert _earlier_runs(tmp_path, "x") == []
    (tmp_path / "wandb_run_id").write_text("0123abcd\n")
    assert _earlier_runs(tmp_path, "x") == [{"id": "0123abcd", "name": "x", "start_step": 0}]
    (tmp_path / RUNS_FILE).write_text('{"id": "a", "name": "x", "start_step": 0}\n'
                                      '{"id": "b", "name": "x-r1", "start_step": 4}\n')
    assert [r["id"] for r in _earlier_runs(tmp_path, "x")] == ["a", "b"]
