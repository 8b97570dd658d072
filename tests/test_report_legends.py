"""The report's figure legends fit their figures, however long the grid points' labels."""

from __future__ import annotations

import itertools
import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from areal_async.report import plots, write_report
from areal_async.report.build import study_cells
from tests.support.report_runs import timed, write_run

KEYS = ["rollout.sampling.presence_penalty_schedule", "trainer.optimizer.learning_rate_warmup_fraction",
        "algo.importance_weight_cap_for_decoupled_objective", "rollout.max_new_tokens_per_generation_turn",
        "trainer.gradient_clipping.max_global_norm", "queue.admission.max_groups_in_flight_per_worker"]


def _study(root, points: int, etas=(0, 2)):
    """A study whose cells vary every key of ``KEYS`` (``points`` grid points × ``etas``, naive)."""
    root.mkdir()
    values = list(itertools.islice(itertools.product(*[[f"value-{k[-6:]}-{i}" for i in range(2)] for k in KEYS]),
                                   points))
    cells = [(f"eta{e}-naive-s1-{p}", e, dict(zip(KEYS, combo))) for p, combo in enumerate(values) for e in etas]
    (root / "study.json").write_text(json.dumps({
        "name": root.name, "config": "c.yaml", "overrides": [], "total_steps": 2, "etas": list(etas),
        "objectives": ["naive"], "seeds": [1], "interrupts": ["on"],
        "grid": [{"key": k, "values": sorted({c[2][k] for c in cells})} for k in KEYS],
        "cells": [{"name": n, "eta": e, "objective": "naive", "seed": 1, "interrupt": "on", "grid": g,
                   "state": "finished", "error": None} for n, e, g in cells]}))
    for name, eta, _ in cells:
        rows = [{**r, "train/behav_kl": 0.1} for r in timed([2.0, 1.0])]  # and a diagnostics figure
        write_run(root / name, rows, eta=eta, decoupled=False)


@pytest.mark.parametrize("points", [2, 6])
def test_every_legend_lies_within_its_figure(tmp_path, monkeypatch, points):
    # with many --grid keys a label is ~600 px long: the legends of two columns (throughput), of
    # three (per-step diagnostics) or inside a 420 px axes reached past the 1200 px figure, and so
    # did the learning curves' titles that name a grid point
    figures = []
    png = plots._png
    widths = []  # of the PNG (cut to what is drawn) against its figure's, in pixels

    def png_once(fig):
        data = png(fig)
        figures.append(fig)
        widths.append((int.from_bytes(data[16:20], "big"), fig.get_figwidth() * 100))
        return data

    monkeypatch.setattr(plots, "_png", png_once)
    _study(tmp_path / "s", points)
    _, cells = study_cells(tmp_path / "s")
    write_report(cells, tmp_path / "s", title="t")
    assert len(figures) >= 4
    assert all(png_px <= fig_px + 20 for png_px, fig_px in widths), widths  # + savefig's 0.1 in pads; titles too
    for fig in figures:
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert legends
        box = fig.bbox
        for legend in legends:
            extent = legend.get_window_extent(renderer)
            assert (extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and extent.y0 >= box.y0 - 1
                    and extent.y1 <= box.y1 + 1), (fig.axes[0].get_ylabel(), extent, box)
            for ax in fig.axes:  # an in-axes legend stays in its axes
                if ax.get_legend() is legend:
                    inner = ax.get_window_extent(renderer)
                    assert extent.x0 >= inner.x0 - 1 and extent.x1 <= inner.x1 + 1, (ax.get_ylabel(), extent, inner)


def test_a_long_label_is_wrapped_at_its_parts_to_the_width():
    label = "η=2 naive, " + ", ".join(f"{k}=1e-06" for k in KEYS)
    wrapped = plots.wrap_label(label, 4.5, 8)  # each part fits: broken only after ", "
    assert wrapped.replace(",\n", ", ") == label and wrapped.count("\n") >= 3
    assert all(plots.text_inches(line, 8) <= 4.5 for line in wrapped.split("\n"))
    assert plots.wrap_label("short", 3.0, 8) == "short"
    assert all(plots.text_inches(line, 8) <= 0.5 for line in plots.wrap_label("x" * 80, 0.5, 8).split("\n"))
