"""The report's reading of run directories' ``config.yaml``: each read once, and two runs of one
grid point compared key by key (a key one run lacks counts; the built-in model's location does not)."""

from __future__ import annotations

import pathlib

import pytest

from areal_async.report import ReportInputError, report_paths
from tests.support.report_runs import timed, write_run


def test_each_runs_config_is_read_once(tmp_path, monkeypatch):
    # runs of one grid point had their config.yaml read again for each comparison (the first run's
    # once per later run), besides the read for their cell
    runs = [write_run(tmp_path / name, timed([1.0, 1.0]), eta=0) for name in ("a", "b", "c")]
    reads: dict[str, int] = {}
    read_text = pathlib.Path.read_text

    def counted(self, *args, **kwargs):
        if self.name == "config.yaml":
            reads[self.parent.name] = reads.get(self.parent.name, 0) + 1
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counted)
    report_paths(runs, tmp_path / "o")
    assert reads == {"a": 1, "b": 1, "c": 1}


def _two_runs(tmp_path, extra_a: str, extra_b: str, algo_a: str = "objective: naive"):
    """Runs a and b of one grid point (η 0, naive, seed 1) with ``extra_*`` appended to their config.yaml."""
    runs = [write_run(tmp_path / name, timed([1.0, 1.0]), eta=0, decoupled=False) for name in ("a", "b")]
    text = (runs[0] / "config.yaml").read_text()
    (runs[0] / "config.yaml").write_text(text.replace("objective: naive", algo_a) + extra_a)
    (runs[1] / "config.yaml").write_text(text + extra_b)
    return runs


def _refusal(runs, out) -> str:
    try:
        report_paths(runs, out)
    except ReportInputError as exc:
        return str(exc)
    return ""


def test_a_key_one_run_lacks_is_a_difference(tmp_path):
    # a key written only by a newer version (absent from the older run's config.yaml) was not compared
    a, b = _two_runs(tmp_path, "trainer:\n  lr: 1.0e-05\n", "trainer:\n  lr: 1.0e-05\n  warmup_steps: 4\n")
    assert (f"their config.yaml differ in trainer.warmup_steps (not in {a / 'config.yaml'}): the report would mix "
            f"them; give --group-by trainer.warmup_steps") in _refusal([a, b], tmp_path / "o")
    # the point's own keys in an older spelling are its values, not a difference: algo.decoupled
    # for algo.objective, rollout.interrupt_on_update absent for true
    a, b = _two_runs(tmp_path / "old", "", "rollout:\n  interrupt_on_update: true\n", algo_a="decoupled: false")
    assert _refusal([a, b], tmp_path / "o") == ""


BUILTIN = "smollm2-135m-instruct"


@pytest.mark.parametrize("model_a, model_b, same", [
    # the built-in model under each machine's home (~), by name (before the launcher resolved it), or
    # in an absolute cache_dir on one machine: one model
    ((f"/home/ann/.cache/areal_async/{BUILTIN}", "~/.cache/areal_async"),
     (f"/root/.cache/areal_async/{BUILTIN}", "~/.cache/areal_async"), True),
    ((BUILTIN, "~/.cache/areal_async"), (f"/root/.cache/areal_async/{BUILTIN}", "~/.cache/areal_async"), True),
    ((f"/scratch/models/{BUILTIN}", "/scratch/models"), (f"/root/.cache/areal_async/{BUILTIN}", "~/.cache/areal_async"),
     True),
    ((f"cache/{BUILTIN}", "cache"), (f"/srv/job/cache/{BUILTIN}", "cache"), True),
    # a directory of that name outside the run's cache_dir may be another checkpoint saved under it
    ((f"/data/{BUILTIN}", "~/.cache/areal_async"), (f"/root/.cache/areal_async/{BUILTIN}", "~/.cache/areal_async"),
     False),
    ((f"/scratch/other/{BUILTIN}", "/scratch/models"), (f"/scratch/models/{BUILTIN}", "/scratch/models"), False),
    # HF directories compare as paths
    (("/a/Qwen3-8B", "~/.cache/areal_async"), ("/b/Qwen3-8B", "~/.cache/areal_async"), False),
])
def test_the_built_in_models_location_is_not_a_difference(tmp_path, model_a, model_b, same):
    a, b = _two_runs(tmp_path, *(f"model:\n  path: {p}\n  cache_dir: {c}\n" for p, c in (model_a, model_b)))
    refusal = _refusal([a, b], tmp_path / "o")
    if same:
        assert refusal == ""
    else:
        assert ("differ in model.path; model.path counts as the same only where both runs' are one built-in model "
                "in their model.cache_dir: the report would mix them; give --group-by model.path") in refusal, refusal
