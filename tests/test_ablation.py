"""The staleness study launcher: a tiny-model grid end to end, resumable; bad input named."""

from __future__ import annotations

import csv
import json

import pytest

import launcher.ablation
from launcher.ablation import cell_state, main
from tests.support.jobs import TINY_JOB_CONFIG as CONFIG, tiny_job_overrides


def _check_report(root, names, missing=()):
    # summary.csv has a row per cell, in run order, agreeing with each cell's metrics.jsonl; a
    # cell without metrics is a row marked missing; report.html embeds its figures
    with open(root / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == names
    for row in rows:
        if row["cell"] in missing:
            assert (row["state"], row["steps"], row["staleness_mean"]) == ("missing", "", ""), row
            continue
        train = [json.loads(x) for x in (root / row["cell"] / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in train if "train/loss" in r]
        assert row["state"] == "finished" and int(row["steps"]) == len(train) == 2
        assert float(row["staleness_mean"]) == sum(r["staleness/mean"] for r in train) / 2
        assert float(row["staleness_max"]) == max(r["staleness/max"] for r in train)
        assert float(row["trained_tokens_per_s"]) == sum(r["perf/trained_tokens_per_s"] for r in train) / 2
        assert int(row["eta"]) == int(row["cell"][3]) and row["objective"] in row["cell"]
    html = (root / "report.html").read_text()
    assert '<img src="data:image/png;base64,' in html and "http://" not in html
    assert all(name in html for name in names)


def _study(tmp_path, model_dir, *extra) -> list[str]:
    return [CONFIG, "--etas", "2", "--name", "s", "--parallel", "2", "--poll-s", "0.2", f"run_root={tmp_path}",
            *tiny_job_overrides(model_dir), *extra]


def test_a_tiny_study_runs_reports_a_failed_cell_and_resumes(tmp_path, tiny_model_dir, monkeypatch, capsys):
    # η = 2 × both objectives, 2 steps each, side by side. First run: cell eta2-naive-s1 is made to
    # fail (a bad override given to it alone: its launcher refuses it, so the test costs two jobs,
    # not three); it is reported with its error and last lines, the other finishes, exit 1, and the
    # report lists it as missing. Second run: the finished cell is skipped, the failed one runs and
    # finishes, exit 0, the report has both. Third run: both skipped. (The grid's other axes and
    # their overrides: the tests below, which start no job.)
    real = launcher.ablation.cell_overrides

    def one_bad(eta, objective, seed, study, root, *interrupt):
        bad = ["trainer.lr=-1"] if (eta, objective) == (2, "naive") else []
        return real(eta, objective, seed, study, root, *interrupt) + bad

    monkeypatch.setattr(launcher.ablation, "cell_overrides", one_bad)
    assert main(_study(tmp_path, tiny_model_dir)) == 1
    out, err = capsys.readouterr()
    assert "[ablation] eta2-naive-s1: FAILED after" in out and "(exit 2): [launcher] error: invalid config " \
        "value for 'trainer.lr' = -1" in out, out
    assert "failed cell eta2-naive-s1 (exit 2); last lines of" in err and "'trainer.lr' = -1" in err, err
    assert "1/2 cells finished, 1 failed" in out
    root = tmp_path / "s"
    names = ["eta2-decoupled-s1", "eta2-naive-s1"]
    assert f"[ablation] report: {root / 'report.html'} (table: {root / 'summary.csv'})" in out
    _check_report(root, names, missing=["eta2-naive-s1"])
    study = json.loads((root / "study.json").read_text())
    assert [c["name"] for c in study["cells"]] == names
    assert [c["state"] for c in study["cells"]] == ["finished", "failed"]
    assert study["cells"][1]["error"].startswith("exit 2: [launcher] error: invalid config value for 'trainer.lr'")
    assert (study["etas"], study["objectives"], study["seeds"], study["total_steps"]) == (
        [2], ["decoupled", "naive"], [1], 2)
    for name, eta, objective in (("eta2-decoupled-s1", 2, "decoupled"),):
        from areal_async.config import load_config

        cfg = load_config(root / name / "config.yaml")
        assert (cfg.queue.max_staleness, cfg.algo.objective, cfg.seed) == (eta, objective, 1)
        assert cfg.logging.wandb_group == "s"
        assert cfg.logging.wandb_tags == [f"eta={eta}", f"objective={objective}",
                                          "seed=1"]
        assert cell_state(root / name, 2)[0] == "finished"
        assert (root / f"{name}.out").exists()
    monkeypatch.setattr(launcher.ablation, "cell_overrides", real)
    assert main(_study(tmp_path, tiny_model_dir)) == 0
    out, _ = capsys.readouterr()
    assert "1 finished before, 1 to run, 1 at a time" in out and "eta2-naive-s1: started (new)" in out, out
    assert [c["state"] for c in json.loads((root / "study.json").read_text())["cells"]] == ["finished"] * 2
    _check_report(root, names)
    assert main(_study(tmp_path, tiny_model_dir)) == 0
    out, _ = capsys.readouterr()
    assert "2 finished before, 0 to run" in out and "started" not in out, out


def test_cell_states(tmp_path):
    run = tmp_path / "c"
    assert cell_state(run, 4) == ("new", 0)
    (run / "checkpoint").mkdir(parents=True)
    assert cell_state(run, 4) == ("broken", 0)  # started, no checkpoint: from scratch
    (run / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "train/loss": 0.0}) + "\n" for k in range(3)))
    assert cell_state(run, 4) == ("resumable", 2)
    (run / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 4}))
    assert cell_state(run, 4) == ("broken", 4)  # a checkpoint at the end but no row of the last step
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "train/loss": 0.0}) + "\n" + json.dumps({"step": 4, "eval/pass@1": 0.5}) + "\n")
    assert cell_state(run, 4) == ("finished", 4)


@pytest.mark.parametrize("flags, words", [
    (["--etas", "0,-1"], "--etas 0,-1: -1 is negative; each η must be >= 0"),
    (["--etas", "0,2,2"], "--etas 0,2,2: 2 is given twice; give each η once"),
    (["--etas", "0,two"], "--etas 0,two: 'two' is not an integer"),
    (["--etas", "1_0"], "--etas 1_0: '1_0' is not an integer"),  # int() reads it as 10
    (["--etas", "0", "--objectives", "decoupled,ppo"], "'ppo' is not an objective; choose from decoupled, naive, tis, mis, icepop, m2po, gspo"),
    (["--etas", "0", "--objectives", "naive,naive"], "'naive' is given twice"),
    (["--etas", "0", "--seeds", "1,-3"], "--seeds 1,-3: -3 is negative; each seed must be >= 0"),
    (["--etas", "0", "queue.max_staleness=3"], "override queue.max_staleness=...: the study sets"),
    (["--etas", "0", "--parallel", "0"], "--parallel 0: at least one cell"),
    (["--etas", "0", "trainer.lrr=1"], "unknown config key 'trainer.lrr'"),
    (["--etas", "0", "--interrupt", "on,maybe"], "--interrupt on,maybe: 'maybe' is not on or off"),
    (["--etas", "0", "--interrupt", "off,off"], "--interrupt off,off: 'off' is given twice"),
    (["--etas", "0", "rollout.interrupt_on_update=false"], "override rollout.interrupt_on_update=...: the study sets"),
])
def test_bad_input_is_named_and_starts_nothing(tmp_path, capsys, flags, words):
    assert main([CONFIG, f"run_root={tmp_path}", *flags]) == 2
    assert words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_study_name_with_another_grid_is_an_error_naming_both(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher.ablation, "run_jobs", lambda jobs, *a, **k: True)  # nothing runs
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,1", "--name", "g"]) == 0
    capsys.readouterr()
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,4", "--name", "g"]) == 2
    err = capsys.readouterr().err
    assert "study 'g'" in err and "differs in etas:" in err and "etas [0, 1]" in err and "etas [0, 4]" in err
    assert "Give a new study name (--name ...)" in err
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,1", "--name", "g", "--parallel", "2"]) == 0


def test_a_broken_cell_runs_again_from_scratch_and_one_with_a_checkpoint_resumes(tmp_path, monkeypatch, capsys):
    started = {}

    def record(jobs, *args, **kwargs):
        started.update({job.name: job.argv for job in jobs})
        for job in jobs:
            kwargs["on_start"](job)  # nothing runs: the study only announces them
        return True

    monkeypatch.setattr(launcher.ablation, "run_jobs", record)
    root = tmp_path / "b"
    (root / "eta0-naive-s1").mkdir(parents=True)  # started, stopped before any checkpoint
    (root / "eta1-naive-s1" / "checkpoint").mkdir(parents=True)  # stopped after step 3's checkpoint
    (root / "eta1-naive-s1" / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 3}))
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,1,2", "--objectives", "naive", "--name", "b",
                 "trainer.total_steps=6"]) == 0
    assert started["eta0-naive-s1"][-1] == "--overwrite" and started["eta1-naive-s1"][-1] == "--resume"
    assert started["eta2-naive-s1"][-1].startswith("logging.wandb_tags=")  # new: no flag
    argv = started["eta1-naive-s1"]
    assert argv[1:4] == ["-m", "launcher.local", CONFIG] and "trainer.total_steps=6" in argv
    assert {"name=eta1-naive-s1", f"run_root={root}", "queue.max_staleness=1", "algo.objective=naive",
            "seed=1", 'logging.wandb_group="b"',
            'logging.wandb_tags=["eta=1", "objective=naive", "seed=1"]'} <= set(argv)
    assert "eta1-naive-s1: started (resumed at step 3)" in capsys.readouterr().out


def test_a_grid_over_total_steps_judges_each_cell_by_its_own_steps(tmp_path, monkeypatch, capsys):
    # cells finished at their own trainer.total_steps were judged by the config's (50), resumed
    # with nothing left to run, failed, and marked failed in study.json
    started = _record_jobs(monkeypatch)
    study = [CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "t",
             "--grid", "trainer.total_steps=2,3"]
    assert main(study) == 0 and len(started) == 2
    for steps in (2, 3):
        done = tmp_path / "t" / f"eta0-naive-s1-total_steps{steps}"
        (done / "checkpoint").mkdir(parents=True)
        (done / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": steps}))
        (done / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "train/loss": 0.0}) + "\n"
                                                    for k in range(steps)))
    started.clear()
    capsys.readouterr()
    assert main(study) == 0
    assert "2 finished before, 0 to run" in capsys.readouterr().out and not started


def test_a_grid_over_total_steps_records_no_one_step_count(tmp_path, monkeypatch, capsys):
    # study.json recorded the config's 50 as the step count of every cell, run for 2 and 3 steps
    _record_jobs(monkeypatch)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "t",
                 "--grid", "trainer.total_steps=2,3"]) == 0
    study = json.loads((tmp_path / "t" / "study.json").read_text())
    assert study["total_steps"] is None
    assert [c["grid"] for c in study["cells"]] == [{"trainer.total_steps": 2}, {"trainer.total_steps": 3}]


def test_the_interruption_axis_names_only_its_non_default_cells(tmp_path, monkeypatch, capsys):
    started = {}

    def record(jobs, *args, **kwargs):
        started.update({job.name: job.argv for job in jobs})
        return True

    monkeypatch.setattr(launcher.ablation, "run_jobs", record)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,2", "--objectives", "naive", "--interrupt", "on,off",
                 "--name", "i"]) == 0
    assert "× interrupt ['on', 'off'] = 4 cells" in capsys.readouterr().out
    study = json.loads((tmp_path / "i" / "study.json").read_text())
    names = ["eta0-naive-s1", "eta0-naive-s1-nointerrupt", "eta2-naive-s1", "eta2-naive-s1-nointerrupt"]
    assert [c["name"] for c in study["cells"]] == names and list(started) == names
    assert [c["interrupt"] for c in study["cells"]] == ["on", "off"] * 2 and study["interrupts"] == ["on", "off"]
    assert {"name=eta2-naive-s1", "rollout.interrupt_on_update=true",
            'logging.wandb_tags=["eta=2", "objective=naive", "seed=1"]'} <= set(started["eta2-naive-s1"])
    assert {"name=eta2-naive-s1-nointerrupt", "rollout.interrupt_on_update=false", "queue.max_staleness=2",
            'logging.wandb_tags=["eta=2", "objective=naive", "seed=1", "interrupt=off"]'} <= set(
                started["eta2-naive-s1-nointerrupt"])


def test_the_interruption_axis_is_part_of_a_studys_identity(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher.ablation, "run_jobs", lambda jobs, *a, **k: True)  # nothing runs
    study = [CONFIG, f"run_root={tmp_path}", "--etas", "0", "--name", "g"]
    assert main(study) == 0
    path = tmp_path / "g" / "study.json"
    assert json.loads(path.read_text())["interrupts"] == ["on"]
    capsys.readouterr()
    assert main([*study, "--interrupt", "on,off"]) == 2
    err = capsys.readouterr().err
    assert "interrupt ['on']" in err and "interrupt ['on', 'off']" in err and "Give a new study name" in err
    # a study.json written before the axis existed has no "interrupts": it is the default grid
    old = json.loads(path.read_text())
    del old["interrupts"]
    for cell in old["cells"]:
        del cell["interrupt"]
    path.write_text(json.dumps(old))
    assert main(study) == 0 and json.loads(path.read_text())["interrupts"] == ["on"]
    path.write_text(json.dumps(old))
    assert main([*study, "--interrupt", "off"]) == 2


@pytest.mark.parametrize("flags, words", [
    (["--grid", "trainer.lrr=1e-6,1e-5"], "--grid trainer.lrr=1e-6,1e-5: unknown config key 'trainer.lrr'; did you "
                                          "mean 'trainer.lr'?"),
    (["--grid", "trainer.lr"], "--grid trainer.lr: give one config key and its values, comma-separated"),
    (["--grid", "trainer.lr=1e-6,,1e-5"], "--grid trainer.lr=1e-6,,1e-5: an empty value"),
    (["--grid", "trainer.lr=1e-6,abc"], "--grid trainer.lr=1e-6,abc: invalid config value for 'trainer.lr' = 'abc'"),
    (["--grid", "trainer.lr=1e-6,0.000001"], "'0.000001' is 1e-06, given twice; give each value once"),
    (["--grid", "trainer=1"], "--grid trainer=1: config key 'trainer' is a section"),
    (["--grid", "queue.max_staleness=1,2"], "--grid queue.max_staleness=1,2: the study sets queue.max_staleness for "
                                            "each cell; leave it out of --grid (η: --etas"),
    (["--grid", "seed=1,2"], "--grid seed=1,2: the study sets seed for each cell"),
    (["--grid", "algo.objective=tis,mis"], "the study sets algo.objective for each cell"),
    (["--grid", "run_root=a,b"], "the study sets run_root for each cell"),
    # the config's hint for the removed key names algo.objective, which a study sets itself
    (["--grid", "algo.decoupled=true,false"], "--grid algo.decoupled=true,false: config key 'algo.decoupled' is "
                                              "gone: give --objectives instead (decoupled: true → --objectives decoupled"),
    (["algo.decoupled=false"], "override algo.decoupled=false: config key 'algo.decoupled' is gone: give --objectives"),
    (["--grid", "trainer.lr=1e-6,1e-5", "trainer.lr=1e-5"], "trainer.lr is also set by the override trainer.lr=...; "
                                                             "a key is either varied (--grid) or fixed"),
    (["--grid", "trainer.lr=1e-6", "--grid", "trainer.lr=1e-5"], "--grid trainer.lr=1e-5: trainer.lr is given in two "
                                                                 "--grid flags"),
    # each value alone is valid, the pair is not: 128 prompt + 200 new tokens > max_seq_len 256
    (["data.max_prompt_len=128", "--grid", "rollout.max_new_tokens=64,200", "--grid", "inference.max_seq_len=256,512"],
     "--grid point rollout.max_new_tokens=200, inference.max_seq_len=256: data.max_prompt_len (128) + max("),
])
def test_bad_grid_is_named_and_starts_nothing(tmp_path, capsys, monkeypatch, flags, words):
    monkeypatch.setattr(launcher.ablation, "run_jobs", lambda *a, **k: pytest.fail("a cell was started"))
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", *flags]) == 2
    assert words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _record_jobs(monkeypatch) -> dict:
    started = {}

    def record(jobs, *args, **kwargs):
        started.update({job.name: job.argv for job in jobs})
        return True

    monkeypatch.setattr(launcher.ablation, "run_jobs", record)
    return started


def test_grid_axes_name_tag_and_override_each_cell(tmp_path, monkeypatch, capsys):
    # η 0,1 × naive × lr 1e-6,3e-5 × max_new_tokens 16,32: 8 cells, the grid points between seed
    # and η (so each point's η = 0 cell runs first), the last axis fastest; values typed (the
    # float key's "3e-5" is 3e-05, the int key's values ints) and written back as JSON overrides
    started = _record_jobs(monkeypatch)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0,1", "--objectives", "naive", "--name", "g",
                 "--grid", "trainer.lr=1e-6,3e-5", "--grid", "rollout.max_new_tokens=16,32"]) == 0
    assert ("× trainer.lr [1e-06, 3e-05] × rollout.max_new_tokens [16, 32] = 8 cells"
            in capsys.readouterr().out)
    study = json.loads((tmp_path / "g" / "study.json").read_text())
    assert study["grid"] == [{"key": "trainer.lr", "values": [1e-06, 3e-05]},
                             {"key": "rollout.max_new_tokens", "values": [16, 32]}]
    names = [f"eta{e}-naive-s1-lr{lr}-max_new_tokens{t}"
             for lr in ("1e-06", "3e-05") for t in (16, 32) for e in (0, 1)]
    assert [c["name"] for c in study["cells"]] == names and list(started) == names
    assert study["cells"][3]["grid"] == {"trainer.lr": 1e-06, "rollout.max_new_tokens": 32}
    argv = started["eta1-naive-s1-lr3e-05-max_new_tokens16"]
    assert {"name=eta1-naive-s1-lr3e-05-max_new_tokens16", "queue.max_staleness=1", "trainer.lr=3e-05",
            "rollout.max_new_tokens=16", 'logging.wandb_tags=["eta=1", "objective=naive", "seed=1", '
            '"trainer.lr=3e-05", "rollout.max_new_tokens=16"]'} <= set(argv)
    # the cell's overrides load into the config the cell asks for
    from areal_async.config import load_config

    i = argv.index(CONFIG)
    cfg = load_config(CONFIG, [a for a in argv[i + 1:] if not a.startswith("--")])
    assert (cfg.trainer.lr, cfg.rollout.max_new_tokens, cfg.name) == (3e-05, 16, names[5])


def test_grid_names_are_file_names_and_distinct():
    from launcher.study_grid import Axis, name_suffix, point_tags, short_keys, value_texts

    # two keys with one last part: each named by its whole key
    assert short_keys(["rollout.max_new_tokens", "eval.max_new_tokens", "trainer.lr"]) == {
        "rollout.max_new_tokens": "rollout.max_new_tokens", "eval.max_new_tokens": "eval.max_new_tokens",
        "trainer.lr": "lr"}
    assert value_texts(Axis("k", (True, False, 0.1, 256, [0.9, 0.99]))) == ["true", "false", "0.1", "256", "0.9_0.99"]
    # "a/b" and "a:b" are both a_b in file-name characters: each gets the digest of its value
    texts = value_texts(Axis("model.path", ("a/b", "a:b", "c", "x" * 50)))
    assert texts[0].startswith("a_b-") and texts[1].startswith("a_b-") and texts[0] != texts[1]
    assert texts[2] == "c" and len(texts[3]) == 39 and texts[3].startswith("x" * 32 + "-")
    axes = [Axis("model.path", ("org/model-1",)), Axis("trainer.lr", (1e-05,))]
    assert name_suffix({"model.path": "org/model-1", "trainer.lr": 1e-05}, axes) == "-pathorg_model-1-lr1e-05"
    # wandb refuses tags over 64 characters: a long value's tag is cut there
    assert point_tags({"model.path": "/" + "m" * 80, "trainer.lr": 1e-05}) == [
        'model.path="/' + "m" * 51, "trainer.lr=1e-05"]


def test_a_grid_is_part_of_a_studys_identity_and_resumes(tmp_path, monkeypatch, capsys):
    # the same grid again: the finished cell is skipped, the others run; another grid (or none)
    # under the same name is refused, naming both
    started = _record_jobs(monkeypatch)
    study = [CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "g",
             "--grid", "trainer.lr=1e-6,1e-5", "trainer.total_steps=2"]
    assert main(study) == 0
    done = tmp_path / "g" / "eta0-naive-s1-lr1e-05"
    (done / "checkpoint").mkdir(parents=True)
    (done / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (done / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "train/loss": 0.0}) + "\n" for k in range(2)))
    started.clear()
    capsys.readouterr()
    assert main(study) == 0
    assert "1 finished before, 1 to run" in capsys.readouterr().out and list(started) == ["eta0-naive-s1-lr1e-06"]
    assert main([*study[:-2], "trainer.lr=1e-6,3e-5", "trainer.total_steps=2"]) == 2
    err = capsys.readouterr().err
    assert 'grid trainer.lr [1e-06, 1e-05]' in err and 'grid trainer.lr [1e-06, 3e-05]' in err, err
    assert main(study[:-3] + ["trainer.total_steps=2"]) == 2
    assert "grid none" in capsys.readouterr().err
    # a study.json written before --grid existed has no "grid": it is the grid without axes
    plain = [CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "p"]
    assert main(plain) == 0
    path = tmp_path / "p" / "study.json"
    old = json.loads(path.read_text())
    del old["grid"]
    for cell in old["cells"]:
        del cell["grid"]
    path.write_text(json.dumps(old))
    assert main(plain) == 0 and json.loads(path.read_text())["grid"] == []
    assert [c["name"] for c in json.loads(path.read_text())["cells"]] == ["eta0-naive-s1"]


def test_grid_values_split_at_commas_outside_brackets_and_quotes(tmp_path, monkeypatch, capsys):
    # a quoted comma split a value: '"a, b",c' was the values '"a' and 'b"' (a YAML error), and a
    # bracket in quotes ('"[",z') kept every comma after it from splitting
    from launcher.study_grid import split_values

    assert split_values("""1,[2,3],{k: "x,y"},"a, b",'it''s, ok',"q\\",",it's,x],y""") == [
        "1", "[2,3]", '{k: "x,y"}', '"a, b"', "'it''s, ok'", '"q\\","', "it's", "x]", "y"]
    started = _record_jobs(monkeypatch)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "q",
                 "--grid", 'logging.wandb_project="a, b","[",c']) == 0
    study = json.loads((tmp_path / "q" / "study.json").read_text())
    assert study["grid"] == [{"key": "logging.wandb_project", "values": ["a, b", "[", "c"]}]
    assert len(started) == 3


def test_a_long_grid_name_is_cut_to_fit_a_file_name(tmp_path, monkeypatch):
    # six long values made a cell name over 255 characters: the study ended in an OSError
    # (File name too long) while it looked at the cell's directory
    from launcher.study_grid import NAME_CHARS

    started = _record_jobs(monkeypatch)
    long = "x" * 45
    keys = ["logging.wandb_project", "model.cache_dir", "inference.host", "reward.fn", "queue.host",
            "trainer.weight_sync_host"]
    grid = [flag for k in keys for flag in ("--grid", f"{k}={long}a,{long}b" if k == keys[0] else f"{k}={long}")]
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "n", *grid]) == 0
    names = [c["name"] for c in json.loads((tmp_path / "n" / "study.json").read_text())["cells"]]
    assert list(started) == names and len(set(names)) == 2
    assert all(len(n) == NAME_CHARS and n.startswith("eta0-naive-s1-wandb_project") for n in names)


@pytest.mark.parametrize("text, words", [('{"name": "c"', "(Expecting ',' delimiter"),
                                         ('{"name": "c"}', "(no config, overrides, etas, objectives, seeds, cells)"),
                                         ('{"config": 1, "overrides": [], "etas": [0], "objectives": [], "seeds": [1], '
                                          '"cells": [1]}', "(no name in each of its cells)")])
def test_a_study_json_that_is_not_a_record_is_named(tmp_path, capsys, monkeypatch, text, words):
    # it was a bare JSON error naming no file, or a KeyError traceback
    monkeypatch.setattr(launcher.ablation, "run_jobs", lambda *a, **k: pytest.fail("a cell was started"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "study.json").write_text(text)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "--name", "c"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'c' / 'study.json'} is not a study record {words}" in err and "move it away" in err, err


def test_a_report_that_fails_leaves_the_studys_exit_status(tmp_path, monkeypatch, capsys):
    # a fault inside the report (a TypeError) ended the study in a traceback, exit status 1 as if a cell failed
    import areal_async.report

    def broken(root):
        raise TypeError("a fault")

    _record_jobs(monkeypatch)
    monkeypatch.setattr(areal_async.report, "write_study_report", broken)
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "--objectives", "naive", "--name", "f"]) == 0
    err = capsys.readouterr().err
    assert "TypeError: a fault" in err and "[ablation] no report: the report failed (above); write it again with " \
        f"python tools/report.py {tmp_path / 'f'}" in err, err


def test_cells_that_ran_out_of_device_memory_side_by_side_are_named_with_the_fix(tmp_path, monkeypatch, capsys):
    # sixteen cells on one 80 GB GPU: thirteen died of CUDA out-of-memory and the study said only "failed"
    lasts = ("  [trainer] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 38.00 MiB",
             "[launcher] error: something else")

    def fail_all(jobs, *args, **kwargs):
        for job, last in zip(jobs, lasts):
            kwargs["on_start"](job)
            job.out.parent.mkdir(parents=True, exist_ok=True)
            job.out.write_text(f"===== now $ {' '.join(job.argv)} =====\n{last}\n[launcher] job failed: exit 1\n")
            job.returncode = 1
            kwargs["on_end"](job)
        return False

    monkeypatch.setattr(launcher.ablation, "run_jobs", fail_all)
    study = [CONFIG, f"run_root={tmp_path}", "--etas", "0,1", "--objectives", "naive", "--name", "m"]
    assert main([*study, "--parallel", "2"]) == 1
    err = capsys.readouterr().err
    assert ("1 failed cell(s) ran out of device memory with up to 2 side by side (eta0-naive-s1): run the same "
            "command with a smaller --parallel") in err, err
    assert main([*study, "--parallel", "1"]) == 1  # one at a time: no smaller --parallel to give
    assert "ran out of device memory" not in capsys.readouterr().err


def test_a_removed_key_is_refused_as_the_config_refuses_it(tmp_path, capsys, monkeypatch):
    # the study refused only the removed keys it listed itself, not those of config_hints.RENAMED:
    # a key removed later reached load_config and lost the study's flag and the override it came in
    import areal_async.config_hints as hints

    monkeypatch.setitem(hints.RENAMED, "queue.staleness", ("queue.max_staleness", {"low": 1, "high": 8}))
    monkeypatch.setattr(launcher.ablation, "run_jobs", lambda *a, **k: pytest.fail("a cell was started"))
    assert main([CONFIG, f"run_root={tmp_path}", "--etas", "0", "queue.staleness=low"]) == 2
    assert ("override queue.staleness=low: config key 'queue.staleness' is gone: give --etas instead (staleness: "
            "\"low\" → --etas 1, staleness: \"high\" → --etas 8, both: --etas 1,8)") in capsys.readouterr().err
