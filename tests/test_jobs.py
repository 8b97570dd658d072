"""Whole jobs side by side (``launcher/jobs.py``): at most ``parallel`` at once, each one's output
in its file, exit statuses and signals named, a deadline that stops the running ones; and
``tools/learning_table.py``'s table of finished runs."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest

from launcher.jobs import Job, run_jobs
from tests.support import REPO


def _job(tmp_path, name: str, code: str) -> Job:
    return Job(name, [sys.executable, "-c", code], tmp_path / f"{name}.out")


def test_jobs_run_at_most_parallel_at_once_and_each_exit_is_named(tmp_path):
    # each job appends its start and end time; with parallel=2, no three intervals overlap
    stamp = f"import time; f=open({str(tmp_path / 'times')!r}, 'a'); t=time.time(); time.sleep(0.6); " \
            f"f.write(f'{{t}} {{time.time()}}\\n'); f.close()"
    jobs = [_job(tmp_path, "ok1", stamp + "; print('done one')"), _job(tmp_path, "ok2", stamp),
            _job(tmp_path, "three", stamp + "; raise SystemExit(3)"),
            _job(tmp_path, "killed", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]
    started, ended = [], []
    assert run_jobs(jobs, 2, on_start=lambda j: started.append(j.name), on_end=lambda j: ended.append(j.name),
                    poll_s=0.05)
    assert started == ["ok1", "ok2", "three", "killed"] and sorted(ended) == sorted(started)
    assert [j.exit_text() for j in jobs] == ["exit 0", "exit 0", "exit 3", "killed by SIGKILL"]
    spans = sorted(tuple(map(float, line.split())) for line in (tmp_path / "times").read_text().splitlines())
    assert len(spans) == 3
    assert max(start for start, _ in spans) >= min(end for _, end in spans)  # the three never ran at once
    assert jobs[0].last_lines() == ["done one"] and jobs[0].out.read_text().startswith("===== ")


def test_a_deadline_stops_the_running_jobs_and_starts_no_more(tmp_path):
    # SIGINT handled as launcher.local handles it (interrupt_on_signals), also where this test's
    # process inherited it ignored (started with & from a script): the child would then ignore it
    sleeper = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"
    jobs = [_job(tmp_path, "a", sleeper), _job(tmp_path, "b", sleeper)]
    t0 = time.monotonic()
    assert run_jobs(jobs, 1, poll_s=0.05, deadline_s=0.5, grace_s=5) is False
    assert time.monotonic() - t0 < 10
    assert jobs[0].exit_text() in ("killed by SIGINT", "exit 1")  # SIGINT: Python's KeyboardInterrupt exit
    assert jobs[1].proc is None  # never started
    with pytest.raises(ValueError, match="parallel=0: at least one job"):
        run_jobs(jobs, 0)


def _learning_table():
    spec = importlib.util.spec_from_file_location("learning_table", REPO / "tools" / "learning_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_learning_table_judges_blocks_and_evaluations(tmp_path):
    # correct by step: 0.2 for steps 0-3, 0.5 for 4-7, 0.4 for 8-9 (a last partial block of 2 ≥ 4/2 kept)
    table = _learning_table()
    run = tmp_path / "r"
    run.mkdir()
    correct = [0.2] * 4 + [0.5] * 4 + [0.4] * 2
    rows = [{"step": k, "time": 60.0 * k, "perf/step_s": 1.0, "rollout/correct": c, "train/entropy": 1.0 - 0.05 * k}
            for k, c in enumerate(correct)]
    rows.append({"step": 10, "time": 540.0, "perf/step_s": 1.0})  # a step none of whose episodes was scored
    rows += [{"step": 0, "time": 0.0, "eval/pass@1": 0.30}, {"step": 9, "time": 540.0, "eval/pass@1": 0.45}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = table.summarize(run, block=4)
    assert row["steps"] == 11 and row["minutes"] == pytest.approx(9.0)
    assert (row["first"], row["best"], row["last"], row["worst_later"]) == pytest.approx((0.2, 0.5, 0.4, 0.4))
    assert (row["gain"], row["hold"], row["eval"]) == (True, True, True)  # 0.4 ≥ 0.35; 0.4 ≥ 0.15; 0.45 ≥ 0.40
    assert (row["ent0"], row["ent1"]) == pytest.approx((1.0 - 0.05 * 1.5, 1.0 - 0.05 * 8.5))
    assert table.summarize(tmp_path / "none", 4)["steps"] == 0
