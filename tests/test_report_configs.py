"""The report's reading of run directories' ``config.yaml``: each read once, and two runs of one
grid point compared key by key (a key one run lacks counts; the built-in model's location does not)."""

from __future__ import annotations

import pathlib

from areal_async.report import report_paths
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
