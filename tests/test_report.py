"""The study report: synthetic metrics.jsonl files with known values → summary.csv numbers, a
self-contained report.html, and bad input named (exit status 2)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from areal_async.report import main, plots, read_run, report_paths
from areal_async.report.build import run_cell, study_cells, write_study_report
from areal_async.report.summary import by_grid_point
from tests.support import REPO
from tests.support.report_runs import timed as _timed, train_row as _train, write_run as _write_run


def _eval(version, time, pass1):
    return {"step": version, "time": time, "eval/pass@1": pass1, "eval/version": version}


def resumed_rows():
    # An evaluation of version 0 at t=1000; steps 0..4 every 2 s (each step_s = 2) with an
    # evaluation of version 3 between steps 3 and 4; the job stops; a job resumed from the
    # checkpoint at step 3 logs version 3's evaluation again (t=1099), steps 3, 4, 5 (t=1100, 1102,
    # 1104) and the evaluation at the end (version 6, t=1107). The first job's steps 3 and 4 and
    # its version-3 evaluation carry values the report must not use (the last occurrence wins).
    return [_eval(0, 1000.0, 0.25),
            _train(0, 1004.0, 0.0, 0.0, 0.0, 50.0, **{"train/behav_kl": 0.5}),
            _train(1, 1006.0, 0.25, 0.5, 1.0, 60.0),
            _train(2, 1008.0, 0.5, 1.0, 2.0, 70.0, **{"train/behav_kl": 0.25}),
            _train(3, 1010.0, 0.0, 9.0, 9.0, 1e6),  # superseded
            _eval(3, 1010.5, 0.4),  # superseded
            _train(4, 1012.0, 0.0, 9.0, 9.0, 1e6),  # superseded
            _eval(3, 1099.0, 0.5),
            _train(3, 1100.0, 0.75, 1.0, 1.0, 80.0),
            _train(4, 1102.0, 1.0, 1.0, 2.0, 90.0),
            _train(5, 1104.0, 1.0, 0.5, 1.0, 100.0),
            _eval(6, 1107.0, 0.75)]


def test_each_step_once_in_order_the_last_occurrence_wins_and_the_resume_gap_is_left_out(tmp_path):
    run = read_run(_write_run(tmp_path / "a", resumed_rows()))
    assert [r["step"] for r in run.train] == [0, 1, 2, 3, 4, 5]
    assert [r["staleness/mean"] for r in run.train] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.5]
    assert [(r["step"], r["eval/pass@1"]) for r in run.evals] == [(0, 0.25), (3, 0.5), (6, 0.75)]
    # start = min(first row 1000, step 0's start 1004 - 2) = 1000; the interval step 2 → step 3
    # (1008 → 1100) is step 3's 2 s plus a 90 s gap, left out: the last row (1107) is at 107 - 90
    assert (run.resumes, run.elapsed_s, run.wall_s) == (1, 107.0, 17.0)
    assert [r["clock_s"] for r in run.train] == [4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    assert [r["clock_s"] for r in run.evals] == [0.0, 9.0, 17.0]
    # the gap is found from the file going back in steps, whatever its length
    assert read_run(tmp_path / "a", resume_gap_s=1e6).wall_s == 17.0


def test_a_resume_without_repeated_steps_is_found_by_its_length(tmp_path):
    # the resumed job dropped the stopped job's rows past its checkpoint: steps 0, 1 then 2, 3 after
    # a 70 s stop; no step repeats, so only the interval's length shows the gap
    rows = [_train(k, t, 0.5, 0.0, 0.0, 10.0) for k, t in ((0, 2.0), (1, 4.0), (2, 76.0), (3, 78.0))]
    run_dir = _write_run(tmp_path / "b", rows)
    assert (read_run(run_dir).resumes, read_run(run_dir).wall_s) == (1, 8.0)  # 78 - 0 - (72 - 2)
    assert (read_run(run_dir, resume_gap_s=100).resumes, read_run(run_dir, resume_gap_s=100).wall_s) == (0, 78.0)


def test_a_short_resume_is_found_exactly_by_the_trainers_own_clock(tmp_path):
    # perf/elapsed_s (training wall time, summed over resumes) goes 2, 4, then 6, 8 after a 20 s stop:
    # shorter than resume_gap_s, so only the job's own clock shows it, and it shows it exactly
    rows = [_train(k, t, 0.5, 0.0, 0.0, 10.0, **{"perf/elapsed_s": e})
            for k, t, e in ((0, 2.0, 2.0), (1, 4.0, 4.0), (2, 26.0, 6.0), (3, 28.0, 8.0))]
    run = read_run(_write_run(tmp_path / "c", rows))
    assert (run.resumes, run.wall_s, run.elapsed_s) == (1, 8.0, 28.0)
    assert [r["clock_s"] for r in run.train] == [2.0, 4.0, 6.0, 8.0]
    # timing noise within one job (the clocks 0.3 s apart) is not a resume
    rows[2]["perf/elapsed_s"], rows[3]["perf/elapsed_s"] = 25.7, 27.7
    run_dir = tmp_path / "d"
    _write_run(run_dir, rows)
    assert read_run(run_dir).resumes == 0


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_summary_csv_numbers(tmp_path):
    a = _write_run(tmp_path / "a", resumed_rows())
    b = _write_run(tmp_path / "b", [_train(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 10.0, **{"rollout/multi_version_frac": f,
                                                                              "rollout/no_eos_ratio": k / 2,
                                                                              "rollout/response_len": 10.0 * 2 ** k})
                                    for k, f in ((0, 0.0), (1, 0.5), (2, 0.25))], eta=0, decoupled=False, seed=7)
    files = report_paths([a, b], tmp_path / "out", threshold=0.6, window=2)
    rows = _csv(files.csv)
    assert [r["cell"] for r in rows] == ["a", "b"]
    ra, rb = rows
    assert (ra["eta"], ra["objective"], ra["seed"], ra["state"]) == ("1", "decoupled", "1", "")
    assert (rb["eta"], rb["objective"], rb["seed"]) == ("0", "naive", "7")
    assert (ra["steps"], ra["last_step"], ra["resumes"]) == ("6", "5", "1")
    assert float(ra["elapsed_s"]) == 107.0 and float(ra["wall_s"]) == 17.0
    assert float(ra["staleness_mean"]) == (0.0 + 0.5 + 1.0 + 1.0 + 1.0 + 0.5) / 6  # the first job's 9s unused
    assert float(ra["staleness_max"]) == 2.0
    assert float(ra["trained_tokens_per_s"]) == 75.0  # mean of 50, 60, ..., 100
    assert float(ra["tokens_per_wall_s"]) == 600.0 / 17.0
    assert float(ra["behav_kl_mean"]) == 0.375  # only the steps that logged it: (0.5 + 0.25) / 2
    # correct 0, .25, .5, .75, 1, 1: 2-step means .125, .375, .625 → step 3 (clock 1100 - 1000 - 90)
    assert (ra["threshold_step"], float(ra["wall_s_to_threshold"])) == ("3", 10.0)
    assert float(ra["correct_last"]) == 1.0 and float(ra["reward_last"]) == 5.0
    assert (ra["eval_first_version"], float(ra["eval_pass1_first"])) == ("0", 0.25)
    assert (ra["eval_final_version"], float(ra["eval_pass1_final"])) == ("6", 0.75)
    assert ra["multi_version_frac_mean"] == "" and float(rb["multi_version_frac_mean"]) == 0.25
    assert rb["threshold_step"] == "" and rb["wall_s_to_threshold"] == ""  # 0.5 < 0.6 throughout
    assert rb["eval_pass1_final"] == "" and rb["resumes"] == "0"
    # the last 2 steps' truncation and length: (0.5 + 1) / 2, (20 + 40) / 2; blank when not logged
    assert float(rb["no_eos_last"]) == 0.75 and float(rb["response_len_last"]) == 30.0
    assert ra["no_eos_last"] == "" and ra["response_len_last"] == ""
    assert float(rb["wall_s"]) == 6.0  # step 0 starts at 10 - 2, the last row is at 14


def test_report_html_is_self_contained(tmp_path):
    a = _write_run(tmp_path / "a", resumed_rows())
    files = report_paths([a], None)
    assert files.html == a / "report.html" and files.csv == a / "summary.csv"
    html = files.html.read_text()
    # reward and correct vs step and vs wall time, eval, throughput, time to threshold, staleness,
    # diagnostics
    assert html.count('<img src="data:image/png;base64,') == 7
    assert "http://" not in html and "https://" not in html and "<script" not in html


def test_episode_metrics_reach_the_summary_and_their_panel(tmp_path):
    # A multi-turn run gets the episodes panel and its means; a single-turn run (turns 1, no
    # tool calls) gets neither panel nor prefix_cache_hit (never logged without a second turn).
    episode = {"rollout/turns": 2.0, "rollout/tool_calls": 1.0, "rollout/tool_errors": 0.0, "rollout/env_s": 0.01,
               "rollout/truncated": 0.0}
    a = _write_run(tmp_path / "a", [_train(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 10.0,
                                           **{**episode, "rollout/turns": 2.0 + k, "rollout/prefix_cache_hit": h})
                                    for k, h in ((0, 0.5), (1, 0.75))])
    single = {"rollout/turns": 1.0, "rollout/tool_calls": 0.0, "rollout/tool_errors": 0.0, "rollout/truncated": 0.0}
    b = _write_run(tmp_path / "b", [_train(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 10.0, **single) for k in range(2)])
    ra, rb = _csv(report_paths([a, b], tmp_path / "out").csv)
    assert float(ra["turns_mean"]) == 2.5 and float(ra["tool_calls_mean"]) == 1.0
    assert float(ra["prefix_cache_hit_mean"]) == 0.625 and float(ra["truncated_mean"]) == 0.0
    assert float(rb["turns_mean"]) == 1.0 and rb["prefix_cache_hit_mean"] == ""
    assert "Episodes vs step" in (tmp_path / "out" / "report.html").read_text()
    assert "Episodes vs step" not in report_paths([b], None).html.read_text()


def test_a_study_lists_a_cell_without_metrics_as_missing(tmp_path, capsys):
    root = tmp_path / "st"
    _write_run(root / "eta1-decoupled-s1", resumed_rows())
    (root / "eta1-naive-s1").mkdir(parents=True)  # failed before its first step: no metrics
    cells = [{"name": n, "eta": 1, "objective": o, "seed": 1, "state": s, "error": None}
             for n, o, s in (("eta1-decoupled-s1", "decoupled", "finished"), ("eta1-naive-s1", "naive", "failed"))]
    (root / "study.json").write_text(json.dumps({"name": "st", "config": "c.yaml", "overrides": [], "total_steps": 6,
                                                 "etas": [1], "objectives": ["decoupled", "naive"], "seeds": [1],
                                                 "cells": cells}))
    assert main([str(root)]) == 0
    assert "[report] 2 run(s), 1 without metrics" in capsys.readouterr().out
    rows = _csv(root / "summary.csv")
    assert [(r["cell"], r["state"], r["steps"]) for r in rows] == [("eta1-decoupled-s1", "finished", "6"),
                                                                   ("eta1-naive-s1", "missing", "")]
    assert (rows[1]["eta"], rows[1]["objective"]) == ("1", "naive")
    # written before the interruption axis (no "interrupts"): every cell ran with interruption on
    assert [r["interrupt"] for r in rows] == ["on", "on"]
    html = (root / "report.html").read_text()
    # the six figures of the run above and the time to threshold
    assert "Interruption on vs off" not in html and html.count('<img src="data:image/png;base64,') == 7
    assert "Cells without metrics" in html and f"{root / 'eta1-naive-s1' / 'metrics.jsonl'} does not exist" in html
    assert write_study_report(root).rows[0]["staleness_mean"] == (0.0 + 0.5 + 1.0 + 1.0 + 1.0 + 0.5) / 6


@pytest.mark.parametrize("make, words", [
    (lambda p: (p / "r").mkdir() or (p / "r" / "config.yaml").write_text("seed: 1\n"),
     "r/metrics.jsonl does not exist: {p}/r has no metrics yet"),
    (lambda p: (p / "r").mkdir() or (p / "r" / "metrics.jsonl").write_text(""), "r/metrics.jsonl is empty"),
    (lambda p: None, "r does not exist: give a run directory (runs/<name>, with metrics.jsonl) or a study"),
    (lambda p: (p / "r").mkdir(), "r holds neither study.json nor metrics.jsonl / config.yaml"),
    (lambda p: (p / "r").mkdir() or (p / "r" / "metrics.jsonl").write_text('{"step": 0, "time": 1}\n{"step"\n{}\n'),
     "r/metrics.jsonl, line 2:"),
])
def test_bad_input_is_named_with_exit_status_2(tmp_path, capsys, make, words):
    make(tmp_path)
    assert main([str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[report] error: ") and words.format(p=tmp_path) in err, err


def test_bad_options_are_named(tmp_path, capsys):
    a = _write_run(tmp_path / "a", resumed_rows())
    b = _write_run(tmp_path / "b", resumed_rows())
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "study.json").write_text(json.dumps({"cells": []}))
    for argv, words in (([str(a), "--threshold", "1.5"], "threshold 1.5: rollout/correct is a fraction"),
                        ([str(a), "--window", "0"], "window 0: the trailing mean needs at least 1 step"),
                        ([str(a), str(b)], "2 run directories and no --out: give --out DIR"),
                        ([str(tmp_path / "st"), str(a)], "is a study directory: give it alone"),
                        ([str(tmp_path / "st"), "--group-by", "trainer.lr"], "a study's report is grouped by its own "
                                                                             "--grid keys")):
        assert main(argv) == 2
        assert words in capsys.readouterr().err


def test_a_truncated_last_line_is_skipped_and_noted(tmp_path):
    run_dir = _write_run(tmp_path / "a", resumed_rows())
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "ti')
    run = read_run(run_dir)
    assert [r["step"] for r in run.train] == [0, 1, 2, 3, 4, 5] and "the last line (13) is incomplete" in run.notes[0]


def test_a_null_time_metric_is_a_missing_one(tmp_path):
    # a row holding perf/step_s or perf/elapsed_s as null (JSON of None) ended the report in a TypeError
    rows = [_train(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 10.0, **{"perf/elapsed_s": 2.0 * k + 2}) for k in range(4)]
    rows[1]["perf/step_s"] = rows[2]["perf/elapsed_s"] = None
    run = read_run(_write_run(tmp_path / "a", rows))
    assert (run.resumes, run.wall_s) == (0, 8.0)
    row = _csv(report_paths([tmp_path / "a"], None).csv)[0]
    assert (row["steps"], row["step_s"]) == ("4", "2.0")


def test_the_script_runs_as_a_script(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(tmp_path / "nothing")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "nothing does not exist" in proc.stderr, proc.stderr


def _study(root, cells, **keys):
    """A study.json of ``cells`` (name, eta, objective, seed, interrupt or None for no key), state finished."""
    records = [{"name": n, "eta": e, "objective": o, "seed": sd, "state": "finished", "error": None,
                **({} if i is None else {"interrupt": i})} for n, e, o, sd, i in cells]
    (root / "study.json").write_text(json.dumps({"name": root.name, "config": "c.yaml", "overrides": [],
                                                 "total_steps": 3, "etas": sorted({c[1] for c in cells}),
                                                 "objectives": ["decoupled"], "seeds": [1], "cells": records,
                                                 **keys}))


def _steps(frac, tok_s):
    return [_train(k, 10.0 + 2 * k, 0.5, 1.0, 2.0, tok_s, **{"rollout/multi_version_frac": frac}) for k in range(3)]


def test_a_study_with_interruption_on_and_off_has_the_column_and_apart_groups(tmp_path):
    root = tmp_path / "st"
    names = ("eta1-decoupled-s1", "eta1-decoupled-s1-nointerrupt", "eta2-decoupled-s1", "eta2-decoupled-s1-nointerrupt")
    for name, frac in zip(names, (0.5, 0.0, 0.25, 0.0)):
        _write_run(root / name, _steps(frac, 10.0))
    # the cells' config.yaml files leave interrupt_on_update out: the column must come from study.json
    _study(root, [(names[0], 1, "decoupled", 1, "on"), (names[1], 1, "decoupled", 1, "off"),
                  (names[2], 2, "decoupled", 1, "on"), (names[3], 2, "decoupled", 1, "off")],
           interrupts=["on", "off"])
    assert main([str(root)]) == 0
    with open(root / "summary.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[header.index("objective") + 1] == "interrupt"
    rows = _csv(root / "summary.csv")
    assert [(r["cell"], r["interrupt"]) for r in rows] == list(zip(names, ("on", "off", "on", "off")))
    assert [float(r["multi_version_frac_mean"]) for r in rows] == [0.5, 0.0, 0.25, 0.0]
    _, cells = study_cells(root)
    groups = plots.groups_of([(c, read_run(c.run_dir)) for c in cells])
    assert [(g.label, g.interrupt, len(g.runs)) for g in groups] == [
        ("η=1 decoupled", "on", 1), ("η=1 decoupled, no interruption", "off", 1),
        ("η=2 decoupled", "on", 1), ("η=2 decoupled, no interruption", "off", 1)]
    html = (root / "report.html").read_text()
    # the figures of runs without evaluation rows (reward and correct vs step and vs wall time,
    # throughput, staleness, diagnostics) and the on-vs-off panel
    assert "Interruption on vs off" in html and html.count('<img src="data:image/png;base64,') == 6
    assert "× interruption [&#39;on&#39;, &#39;off&#39;]" in html


def test_a_run_directory_reads_interruption_from_its_config(tmp_path):
    on = _write_run(tmp_path / "on", _steps(0.5, 10.0))  # no rollout.interrupt_on_update: the default, on
    off = _write_run(tmp_path / "off", _steps(0.0, 10.0), interrupt=False)
    explicit = _write_run(tmp_path / "explicit", _steps(0.5, 10.0), interrupt=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text((on / "metrics.jsonl").read_text())  # no config.yaml: unknown
    assert [run_cell(p).interrupt for p in (on, off, explicit, bare)] == ["on", "off", "on", None]
    rows = _csv(report_paths([on, off, explicit, bare], tmp_path / "out").csv)
    assert [(r["cell"], r["interrupt"]) for r in rows] == [("on", "on"), ("off", "off"), ("explicit", "on"),
                                                            ("bare", "")]
    # the two on runs are one group (seeds of one grid point), the off run its own; the run of
    # unknown grid point is named after itself
    groups = plots.groups_of([(run_cell(p), read_run(p)) for p in (on, off, explicit, bare)])
    assert [(g.label, len(g.runs)) for g in groups] == [("η=1 decoupled", 2), ("η=1 decoupled, no interruption", 1),
                                                        ("bare", 1)]
    # all runs with interruption on: no label says anything of it
    same = plots.groups_of([(run_cell(p), read_run(p)) for p in (on, explicit)])
    assert [g.label for g in same] == ["η=1 decoupled"]


@pytest.mark.parametrize("algo, objective", [("objective: icepop", "icepop"), ("decoupled: false", "naive"),
                                             ("decoupled: true", "decoupled"), ("eps_clip: 0.2", None)])
def test_a_cell_objective_is_read_from_algo_objective_or_the_boolean_of_older_runs(tmp_path, algo, objective):
    # Run directories written before algo.objective replaced algo.decoupled still name their objective.
    from areal_async.report.runs import cell_config, read_config

    (tmp_path / "config.yaml").write_text(f"seed: 3\nqueue:\n  max_staleness: 2\nalgo:\n  {algo}\n")
    assert cell_config(read_config(tmp_path)) == {"eta": 2, "objective": objective, "interrupt": "on", "seed": 3, "grid": {}}


def _grid_study(root, cells, grid):
    """A study.json of ``cells`` (name, eta, seed, grid point) with ``--grid`` axes ``grid``, all naive."""
    records = [{"name": n, "eta": e, "objective": "naive", "seed": sd, "interrupt": "on", "grid": g,
                "state": "finished", "error": None} for n, e, sd, g in cells]
    (root / "study.json").write_text(json.dumps({
        "name": root.name, "config": "c.yaml", "overrides": [], "total_steps": 2, "etas": [0, 2],
        "objectives": ["naive"], "seeds": [1, 2], "interrupts": ["on"], "grid": grid, "cells": records}))


def test_a_grid_study_is_grouped_by_its_keys_with_speedup_vs_sync(tmp_path):
    # η 0, 2 × lr 1e-06, 1e-05 × seeds 1, 2; step_s = the mean of a run's two perf/step_s values.
    # speedup_vs_sync = step_s of the η = 0 run with the same lr and seed / the run's own:
    #   lr 1e-06 seed 1: η 0 (3 + 3)/2 = 3.0, η 2 (1 + 2)/2 = 1.5 → 3.0/1.5 = 2.0
    #   lr 1e-06 seed 2: η 0 2.0, η 2 0.5 → 4.0
    #   lr 1e-05 seed 1: η 0 6.0, η 2 1.5 → 4.0 (with lr 1e-06's η = 0 run it would be 2.0)
    #   lr 1e-05 seed 2: η 0 has no metrics (missing) → blank; itself blank too
    # every η = 0 run with a step_s: 1.0
    root = tmp_path / "g"
    step_s = {(0, 1, 1e-06): [3.0, 3.0], (2, 1, 1e-06): [1.0, 2.0], (0, 2, 1e-06): [2.0, 2.0],
              (2, 2, 1e-06): [0.5, 0.5], (0, 1, 1e-05): [6.0, 6.0], (2, 1, 1e-05): [1.5, 1.5],
              (0, 2, 1e-05): None, (2, 2, 1e-05): [1.0, 1.0]}
    cells = []
    for (eta, seed, lr), times in step_s.items():
        name = f"eta{eta}-naive-s{seed}-lr{lr!r}"
        cells.append((name, eta, seed, {"trainer.lr": lr}))
        if times:
            _write_run(root / name, _timed(times), eta=eta, decoupled=False, seed=seed)
    _grid_study(root, cells, [{"key": "trainer.lr", "values": [1e-06, 1e-05]}])
    assert main([str(root)]) == 0
    with open(root / "summary.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[header.index("interrupt") + 1] == "trainer.lr"
    rows = _csv(root / "summary.csv")
    assert [(r["eta"], r["seed"], float(r["trainer.lr"]), r["speedup_vs_sync"]) for r in rows] == [
        ("0", "1", 1e-06, "1.0"), ("2", "1", 1e-06, "2.0"), ("0", "2", 1e-06, "1.0"), ("2", "2", 1e-06, "4.0"),
        ("0", "1", 1e-05, "1.0"), ("2", "1", 1e-05, "4.0"), ("0", "2", 1e-05, ""), ("2", "2", 1e-05, "")]
    # the figures' groups: one per (η, lr), the two seeds in each; labels name the lr
    _, study_cells_ = study_cells(root)
    read = [(c, read_run(c.run_dir)) for c in study_cells_ if (c.run_dir / "metrics.jsonl").exists()]
    groups = plots.groups_of(read)
    assert [(g.label, len(g.runs), g.point) for g in groups] == [
        ("η=0 naive, trainer.lr=1e-06", 2, 0), ("η=2 naive, trainer.lr=1e-06", 2, 0),
        ("η=0 naive, trainer.lr=1e-05", 1, 1), ("η=2 naive, trainer.lr=1e-05", 2, 1)]
    assert [len(p) for p in plots.by_point(groups)] == [2, 2]
    html = (root / "report.html").read_text()
    assert "× trainer.lr [1e-06, 1e-05] × seeds" in html and "trainer.<wbr>lr" in html
    assert "2 steps per cell" in html  # the grid does not vary trainer.total_steps
    # means over seeds per grid point: lr 1e-06 η 2 speedup (2.0 + 4.0) / 2 = 3.0, step_s
    # (1.5 + 0.5) / 2 = 1.0; lr 1e-05 η 0 one run (seed 2 missing); its η 2 speedup only seed 1's 4.0
    points = by_grid_point(write_study_report(root).rows, ["trainer.lr"])
    assert [(p["eta"], p["trainer.lr"], p["seeds"], p["speedup_vs_sync"], p["step_s"]) for p in points] == [
        (0, 1e-06, 2, 1.0, 2.5), (2, 1e-06, 2, 3.0, 1.0), (0, 1e-05, 1, 1.0, 6.0), (2, 1e-05, 2, 4.0, 1.25)]
    assert "By grid point: means over seeds" in html and '<table class="summary points">' in html


def test_a_grid_over_total_steps_names_no_one_step_count(tmp_path):
    # the report said "50 steps per cell" (the config's) of cells run for 2 and 3 steps
    root = tmp_path / "t"
    root.mkdir()
    cells = [(f"eta0-naive-s1-total_steps{n}", 0, 1, {"trainer.total_steps": n}) for n in (2, 3)]
    _grid_study(root, cells, [{"key": "trainer.total_steps", "values": [2, 3]}])
    for name, *_ in cells:
        _write_run(root / name, _timed([1.0, 1.0]), eta=0)
    write_study_report(root)
    html = (root / "report.html").read_text()
    assert "steps per cell" not in html and "× trainer.total_steps [2, 3] × seeds" in html


def test_run_directories_are_grouped_by_a_config_key(tmp_path, capsys):
    a = _write_run(tmp_path / "a", _timed([2.0, 2.0]), eta=0)
    b = _write_run(tmp_path / "b", _timed([1.0, 1.0]), eta=2)
    with (a / "config.yaml").open("a") as f:
        f.write("trainer:\n  lr: 1.0e-05\n")
    assert main([str(a), str(b), "--out", str(tmp_path / "o"), "--group-by", "trainer.lr"]) == 0
    rows = _csv(tmp_path / "o" / "summary.csv")
    # b has no trainer.lr: blank, and so another grid point than a: no η = 0 twin
    assert [(r["cell"], r["trainer.lr"], r["speedup_vs_sync"]) for r in rows] == [("a", "1e-05", "1.0"),
                                                                                   ("b", "", "")]
    assert main([str(a), str(b), "--out", str(tmp_path / "o"), "--group-by", "trainer.lrr"]) == 2
    assert "--group-by trainer.lrr: no run's config.yaml has it" in capsys.readouterr().err
    # a section was a column of Python dict texts
    assert main([str(a), str(b), "--out", str(tmp_path / "o"), "--group-by", "trainer"]) == 2
    assert "--group-by trainer: it is a section of the config; group by one of its keys, --group-by trainer.NAME" \
        in capsys.readouterr().err



def test_a_run_directory_given_twice_is_named(tmp_path, capsys):
    # a/ and a given together (overlapping globs) counted as two runs: two seeds of one grid point
    a = _write_run(tmp_path / "a", _timed([2.0, 2.0]), eta=0)
    assert main([str(a), str(tmp_path / "a" / ".." / "a"), "--out", str(tmp_path / "o")]) == 2
    assert f"is given twice (also as {a}): its run would count as two seeds" in capsys.readouterr().err


def test_runs_of_one_point_and_seed_that_differ_in_another_key_are_named(tmp_path, capsys):
    # without --group-by, η = 0 runs at two learning rates were one grid point: averaged as two
    # seeds, and one was the other's η = 0 twin (speedup_vs_sync 2.0 at η = 0, not 1)
    a = _write_run(tmp_path / "a", _timed([2.0, 2.0]), eta=0)
    b = _write_run(tmp_path / "b", _timed([1.0, 1.0]), eta=0)
    for run, lr, port in ((a, "1.0e-05", 1), (b, "0.001", 2)):
        with (run / "config.yaml").open("a") as f:
            f.write(f"name: {run.name}\ntrainer:\n  lr: {lr}\n  master_port: {port}\n")
    out = str(tmp_path / "o")
    assert main([str(a), str(b), "--out", out]) == 2
    assert (f"{a} and {b} have one η, objective, interruption, seed and --group-by values but their config.yaml "
            f"differ in trainer.lr: the report would mix them; give --group-by trainer.lr") in capsys.readouterr().err
    assert main([str(a), str(b), "--out", out, "--group-by", "trainer.lr"]) == 0
    assert [r["speedup_vs_sync"] for r in _csv(tmp_path / "o" / "summary.csv")] == ["1.0", "1.0"]
    text = (a / "config.yaml").read_text()
    (a / "config.yaml").write_text(text.replace("master_port: 1", "master_port: 1\n  resume: false"))
    (b / "config.yaml").write_text(text.replace("master_port: 1", "master_port: 2\n  resume: true"))
    assert main([str(a), str(b), "--out", out]) == 0  # one setting run twice: names, ports, resumed or not differ


@pytest.mark.parametrize("key, column", [("seed", "seed"), ("queue.max_staleness", "eta"),
                                         ("algo.objective", "objective"), ("rollout.interrupt_on_update", "interrupt")])
def test_a_group_by_key_the_report_reads_already_is_named(tmp_path, capsys, key, column):
    # --group-by seed ended in a TypeError (the seed column given twice to one row)
    a = _write_run(tmp_path / "a", _timed([2.0, 2.0]), eta=0)
    b = _write_run(tmp_path / "b", _timed([1.0, 1.0]), eta=2, seed=2)
    assert main([str(a), str(b), "--out", str(tmp_path / "o"), "--group-by", key]) == 2
    assert f"--group-by {key}: every run's {key} is read already, as the column {column}" in capsys.readouterr().err


def test_time_to_threshold_reached_and_not(tmp_path):
    # correct per step: a 0.2, 0.2, 0.4, 0.6, 0.8 (rows at 12, 14, 16, 18, 20 s);
    # b 0.2 throughout. Window 2: a's trailing means (from step 1) 0.2, 0.3, 0.5, 0.7; b's 0.2.
    # threshold 0.5: a at step 3, clock 8.0 (the run starts at 12 - perf/step_s 2 = 10, step 3 is at
    # 18); b not reached. start+0.25: a's start is 0.2 → 0.45, step 3 again; b → 0.45, not reached.
    # rollout/reward = 10 * correct - 5 (_train): a -3, -3, -1, 1, 3; means -3, -2, 0, 2; >= 1.5 at step 4.
    a = _write_run(tmp_path / "a", [_train(k, 12.0 + 2 * k, c, 0.0, 0.0, 10.0)
                                    for k, c in enumerate((0.2, 0.2, 0.4, 0.6, 0.8))])
    b = _write_run(tmp_path / "b", [_train(k, 12.0 + 2 * k, 0.2, 0.0, 0.0, 10.0) for k in range(5)])
    for kwargs, expected in (
            ({"threshold": 0.5}, [("0.5", "True", "3", 8.0), ("0.5", "False", "", None)]),
            ({"threshold": "start+0.25"}, [("0.45", "True", "3", 8.0), ("0.45", "False", "", None)]),
            ({"threshold": "1.5", "metric": "rollout/reward"},
             [("1.5", "True", "4", 10.0), ("1.5", "False", "", None)])):
        rows = _csv(report_paths([a, b], tmp_path / "o", window=2, **kwargs).csv)
        got = [(f"{float(r['threshold_value']):.4g}", r["threshold_reached"], r["threshold_step"],
                float(r["wall_s_to_threshold"]) if r["wall_s_to_threshold"] else None) for r in rows]
        assert got == expected, (kwargs, got)
        assert rows[0]["threshold"] == str(kwargs["threshold"]) and rows[0]["window"] == "2"
    html = (tmp_path / "o" / "report.html").read_text()
    assert html.count('<td class="text missing-value">not reached</td>') == 2  # b's step and seconds
    # fewer steps than the window: no threshold value, neither reached nor not
    row = _csv(report_paths([b], tmp_path / "p", window=9).csv)[0]
    assert (row["threshold_value"], row["threshold_reached"], row["threshold_step"]) == ("", "", "")
    # a metric no run logs (a typo) is named in the report, not left as silently blank columns
    assert "no run logs" not in html
    report_paths([a, b], tmp_path / "q", metric="rollout/corect", threshold=0.5)
    assert "no run logs rollout/corect, so the time to threshold is blank" in (tmp_path / "q" / "report.html").read_text()


def test_threshold_options_are_checked(tmp_path, capsys):
    a = _write_run(tmp_path / "a", resumed_rows())
    for argv, words in ((["--threshold", "start+0"], "threshold start+0: a threshold above the start needs a rise > 0"),
                        (["--threshold", "half"], "threshold half is not a number"),
                        (["--threshold", "start+x"], "threshold start+x is not a number")):
        assert main([str(a), *argv]) == 2
        assert words in capsys.readouterr().err
    assert main([str(a), "--metric", "rollout/reward", "--threshold", "4"]) == 0  # not a fraction: any value


def test_the_threshold_column_is_the_text_as_given(tmp_path):
    # --threshold 0.50 was written as 0.5, against the column's "the threshold as given"
    a = _write_run(tmp_path / "a", resumed_rows())
    for given in ("0.50", "start+0.10"):
        assert main([str(a), "--threshold", given, "--out", str(tmp_path / given)]) == 0
        assert _csv(tmp_path / given / "summary.csv")[0]["threshold"] == given


def test_the_html_table_scrolls_in_its_box_with_the_cell_column_in_view(tmp_path):
    a = _write_run(tmp_path / "a", [_train(k, 10.0 + 2 * k, 0.5, 0.0, 0.0, 60367.25, **{"train/behav_kl": -0.000123456})
                                    for k in range(2)])
    html = report_paths([a], None).html.read_text()
    style = html[html.index("<style>"):html.index("</style>")]
    # the page is at most 1200 px wide; the table scrolls inside its box; the key column sticks
    assert "max-width: 1200px" in style and ".scroll { overflow-x: auto; max-width: 100%; }" in style
    assert "table.summary .key { position: sticky; left: 0;" in style
    assert "table.summary th { background: #f2f2f2; white-space: normal; max-width: 7em;" in style
    # a long path or key outside the table wraps (a study's overrides, a missing cell's reason, the column list)
    assert "p, li, figcaption { overflow-wrap: anywhere; }" in style
    assert "dt { font-family: monospace; float: left; clear: left; width: 15em; overflow-wrap: anywhere; }" in style
    table = html[html.index('<div class="scroll">\n<table class="summary">'):html.index("</table>")]
    assert '<th class="key" title="cell name (study) or run directory name">cell</th>' in table
    assert "<th title=\"mean over steps of perf/step_s\">step_<wbr>s</th>" in table
    assert '<td class="key">a</td>' in table
    # compact numbers: thousands grouped without decimals, others to 3 significant digits
    assert "<td>60,367</td>" in table and "<td>-0.000123</td>" in table and "60367.25" not in table
    # constant or long columns are stated elsewhere, not in the table
    assert ">run_<wbr>dir<" not in table and "threshold_<wbr>metric" not in table
    # a column blank in every row is left out (summary.csv keeps it)
    assert ">tool_<wbr>calls_<wbr>mean<" not in table and ">interrupt<" in table
    assert "tool_calls_mean" in (a / "summary.csv").read_text()


def test_many_grid_points_keep_their_figures_readable(tmp_path):
    # 16 grid points: the staleness histogram's legends, inside its axes, squeezed them to nothing
    # (matplotlib: "constrained_layout not applied because axes sizes collapsed to zero") and
    # the series past the tenth repeated the first ten's colours
    import itertools
    import warnings

    from matplotlib.figure import Figure

    root = tmp_path / "many"
    root.mkdir()
    keys = {"trainer.lr": [1e-05, 3e-05], "rollout.max_new_tokens": [16, 32], "algo.ppo_minibatches": [1, 2],
            "trainer.weight_decay": [0.0, 0.1]}
    cells = [(f"eta0-naive-s1-{i}", 0, 1, dict(zip(keys, combo)))
             for i, combo in enumerate(itertools.product(*keys.values()))]
    _grid_study(root, cells, [{"key": k, "values": v} for k, v in keys.items()])
    for name, *_ in cells:
        _write_run(root / name, _timed([2.0, 1.0]), eta=0, decoupled=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_study_report(root)
    assert not [w for w in caught if "collapsed" in str(w.message)], [str(w.message) for w in caught]
    assert len(set(plots.palette(16))) == 16 and len(set(plots.palette(30))) == 30
    # the per-step figures' markers repeat past 10 grid points, where η 0's colour did too
    _, cells_ = study_cells(root)
    groups = plots.groups_of([(c, read_run(c.run_dir)) for c in cells_])
    ax = Figure().subplots()
    assert plots._draw(ax, groups, plots._colors(groups), "perf/step_s", "step")
    assert len({(line.get_color(), line.get_marker()) for line in ax.lines}) == len(groups) == 16
