"""The report's figures as ``Panel``s of PNG bytes (``None`` when no run holds the metrics), drawn
on matplotlib's Agg canvas, not pyplot: importing or drawing touches no global state.
What each shows: docs/dashboards.md#the-studys-report."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import defaultdict

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

from areal_async.report.runs import RunMetrics
from areal_async.report.summary import Cell, Threshold

STYLES = {"decoupled": "-", "naive": "--"}
OFF = {"marker": "x", "alpha": 0.6}  # how a group without interruption is drawn, when both occur
NOTES = {"off": "no interruption", None: "interruption unknown"}  # label notes when interruption differs
AXES_IN = 0.8  # the share of a subplot's width its axes take (the rest: tick labels and the y label)
GRID_MARKERS = ("o", "s", "^", "v", "D", "P", "*", "<", ">", "h")  # a grid point's marker, when there are several
DIAGNOSTICS = [("train/importance_weight", "mean w = π_prox/π_behav after the cap"),
               ("train/behav_kl", "mean log π_prox − log π_behav (naive: θ − behav)"),
               ("train/clip_ratio", "share of tokens clipped"),
               ("train/behav_capped_ratio", "share of tokens with w capped/masked"),
               ("rollout/multi_version_frac", "samples spanning several versions")]
EPISODES = [("rollout/turns", "model turns per episode"), ("rollout/tool_calls", "tool calls per episode"),
            ("rollout/tool_errors", "tool errors per episode"), ("rollout/prefix_cache_hit",
                                                                  "prompt tokens of later turns from the cache"),
            ("rollout/truncated", "share of episodes cut by a limit"), ("rollout/env_s", "seconds in tools per episode")]


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    caption: str
    png: bytes


@dataclasses.dataclass(frozen=True)
class Group:
    """The runs of one grid point (η, objective, interrupt, ``--grid`` values), or one run of
    unknown grid point.

    ``note`` is what the label adds about interruption ("no interruption"), ``""`` when the runs
    do not differ in it (or the group is on). ``grid``: ``((key, value as JSON), ...)`` of the
    ``--grid`` keys; ``point``: its index among the report's ``--grid`` points (0 with one).
    """

    label: str
    eta: int | None
    objective: str | None
    interrupt: str | None
    runs: list[RunMetrics]
    note: str = ""
    grid: tuple = ()
    point: int = 0

    @property
    def grid_text(self) -> str:
        """``"trainer.lr=1e-06, rollout.max_new_tokens=256"``; ``""`` without ``--grid`` keys."""
        return ", ".join(f"{k}={v}" for k, v in self.grid)


def grid_of(cell: Cell) -> tuple:
    """A cell's ``--grid`` values as a hashable ``((key, JSON text), ...)``."""
    return tuple((k, json.dumps(v)) for k, v in cell.grid.items())


def interruption_note(interrupt: str | None, values: set) -> str:
    """The label's note on ``interrupt`` when the runs' interruption ``values`` differ, else ``""``."""
    return NOTES.get(interrupt, "") if len(values) > 1 else ""


def groups_of(runs: list[tuple[Cell, RunMetrics]]) -> list[Group]:
    """Runs grouped by (η, objective, interrupt, ``--grid`` values), in order of grid point (as
    the runs first give it), η, objective, then on before off; unknown ones last, by name. Labels
    name the grid point only when the runs have several."""
    known: dict[tuple, list[RunMetrics]] = defaultdict(list)
    lone = []
    values = {cell.interrupt for cell, _ in runs}
    grids = list(dict.fromkeys(grid_of(cell) for cell, _ in runs))
    for cell, run in runs:
        g = grid_of(cell)
        if cell.eta is None or cell.objective is None:
            lone.append(Group(cell.name, None, None, cell.interrupt, [run], interruption_note(cell.interrupt, values),
                              g, grids.index(g)))
        else:
            known[(cell.eta, cell.objective, cell.interrupt, g)].append(run)
    order = sorted(known, key=lambda k: (grids.index(k[3]), k[0], list(STYLES).index(k[1]) if k[1] in STYLES else 9,
                                         k[1], ["on", "off", None].index(k[2]) if k[2] in ("on", "off", None) else 9))
    out = []
    for e, o, i, g in order:
        note = interruption_note(i, values)
        label = f"η={e} {o}" + (f", {note}" if note else "") + "".join(f", {k}={v}" for k, v in g if len(grids) > 1)
        out.append(Group(label, e, o, i, known[(e, o, i, g)], note, g, grids.index(g)))
    return out + sorted(lone, key=lambda g: g.label)


def by_point(groups: list[Group]) -> list[list[Group]]:
    """``groups`` split by ``--grid`` point, in point order."""
    return [[g for g in groups if g.point == p] for p in sorted({g.point for g in groups})]


def _colors(groups: list[Group]) -> dict[str, tuple]:
    """A colour per label: its η's, or each its own where markers would repeat (past ``GRID_MARKERS``)."""
    if len({g.point for g in groups}) > len(GRID_MARKERS):
        return dict(zip([g.label for g in groups], palette(len(groups))))
    etas = sorted({g.eta for g in groups if g.eta is not None})
    cmap = matplotlib.colormaps["viridis"]
    by_eta = {e: cmap(0.85 * i / max(len(etas) - 1, 1)) for i, e in enumerate(etas)}
    others = iter(matplotlib.colormaps["tab10"].colors)
    return {g.label: by_eta[g.eta] if g.eta is not None else next(others, (0.5, 0.5, 0.5)) for g in groups}


def _trailing(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return list((c[idx] - c[lo]) / (idx - lo))


def seed_band(runs: list[RunMetrics], key: str, window: int = 1, evals: bool = False):
    """``(steps, x_clock_s, mean, lo, hi)`` arrays over the runs' rows holding ``key``: the group's mean and
    min–max band at each step (docs/dashboards.md#the-studys-report)."""
    at: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        rows = [r for r in (run.evals if evals else run.train) if isinstance(r.get(key), (int, float))]
        values = _trailing([float(r[key]) for r in rows], window) if window > 1 else [float(r[key]) for r in rows]
        for r, v in zip(rows, values):
            at[r["step"]].append((r["clock_s"], v))
    steps = sorted(at)
    ys = [np.array([v for _, v in at[s]]) for s in steps]
    return (np.array(steps), np.array([np.mean([c for c, _ in at[s]]) for s in steps]),
            np.array([y.mean() for y in ys]), np.array([y.min() for y in ys]), np.array([y.max() for y in ys]))


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _draw(ax, groups, colors, key, xaxis, window=1, evals=False, marker=None) -> bool:
    drew = False
    several = len({g.point for g in groups}) > 1  # grid points told apart by marker
    for g in groups:
        steps, clock, m, lo, hi = seed_band(g.runs, key, window, evals)
        if not len(steps):
            continue
        x = steps if xaxis == "step" else clock / 60
        off = g.interrupt == "off" and bool(g.note)  # drawn apart only when interruption differs
        if several:
            style = {"marker": GRID_MARKERS[g.point % len(GRID_MARKERS)], "markevery": max(1, len(x) // 12),
                     "markersize": 4, **({"alpha": OFF["alpha"]} if off else {})}
        else:
            style = {**OFF, "markevery": max(1, len(x) // 12)} if off else {"marker": marker}
        ax.plot(x, m, STYLES.get(g.objective, "-"), color=colors[g.label], label=g.label, lw=1.6, **style)
        if len(g.runs) > 1:
            ax.fill_between(x, lo, hi, color=colors[g.label], alpha=0.08 if off else 0.15, lw=0)
        drew = True
    ax.set_xlabel("training step" if xaxis == "step" else "wall time (min, run clock)")
    ax.grid(alpha=0.3)
    return drew


def learning_curves(groups: list[Group], xaxis: str, rule: Threshold) -> Panel | None:
    """Rollout reward and correct fraction against ``xaxis`` (``"step"`` | ``"wall"``), a row of
    two axes per ``--grid`` point (titled by it when there are several)."""
    window, points = rule.window, by_point(groups)
    if not points:
        return None
    fig = Figure(layout="constrained", figsize=(12, 4.2 * len(points)))
    rows = fig.subplots(len(points), 2, squeeze=False)
    colors = _colors(groups)
    drew = False
    for axes, point in zip(rows, points):
        if len(points) > 1:  # the row's title names the grid point: the labels need not
            short = [dataclasses.replace(g, label=g.label.removesuffix(", " + g.grid_text)) for g in point]
            colors.update({s.label: colors[g.label] for s, g in zip(short, point)})
            point = short
        for ax, key in zip(axes, ("rollout/reward", "rollout/correct")):
            drew |= _draw(ax, point, colors, key, xaxis, window)
            ax.set_ylabel(f"{key} ({window}-step trailing mean)")
            if len(points) > 1:
                ax.set_title(wrap_label(point[0].grid_text, AXES_IN * 12 / 2, 9), fontsize=9)
            if key == rule.metric and not rule.relative:
                ax.axhline(rule.value, color="grey", lw=0.8, ls=":", label=f"threshold {rule.value:g}")
        axes_legend(axes[1], AXES_IN * 12 / 2, 8)
    if not drew:
        return None
    what = "step" if xaxis == "step" else "wall time"
    return Panel(f"Reward and correct fraction vs {what}",
                 f"Rollout batches' mean reward and fraction correct, {window}-step trailing mean (fewer steps before "
                 f"step {window - 1}); line: mean over seeds, band: min–max over seeds"
                 + ("; one row per --grid point." if len(points) > 1 else "."), _png(fig))


def eval_curves(groups: list[Group]) -> Panel | None:
    """Greedy ``eval/pass@1`` against the evaluated policy version."""
    inside = fits_in_axes([g.label for g in groups], AXES_IN * 6.5, 8, 6)
    fig = Figure(layout="constrained", figsize=(6.5, 4.2 + (0.0 if inside else legend_inches(
        [g.label for g in groups], 6.5 - 0.2, 8))))
    ax = fig.subplots()
    drew = _draw(ax, groups, _colors(groups), "eval/pass@1", "step", evals=True, marker="o")
    if not drew:
        return None
    ax.set_xlabel("policy version (training steps done)")
    ax.set_ylabel("eval/pass@1 (greedy)")
    if inside:
        axes_legend(ax, AXES_IN * 6.5, 8)
    else:  # below the axes, which it would hide
        figure_legend(fig, *ax.get_legend_handles_labels(), 8)
    return Panel("Evaluation pass@1 over training", "Greedy pass@1 on the test prompts at each evaluated "
                 "version; line: mean over seeds, band: min–max.", _png(fig))


def _by_eta(rows: list[dict], columns: tuple[str, ...]) -> Figure | None:
    """A figure with one axis per column of ``rows`` (``summary.summarize``) against η, one line per
    objective (per (objective, interrupt) when the rows differ in interruption, and per ``--grid``
    point, labelled with it, when there are several), points the mean over seeds and bars min–max;
    ``None`` when no row holds any of the columns."""
    rows = [r for r in rows if r["eta"] is not None and r["objective"] is not None]
    values = {r["interrupt"] for r in rows}
    grids = list(dict.fromkeys(json.dumps(r["grid"]) for r in rows))
    lines = sorted({(r["objective"], r["interrupt"], json.dumps(r["grid"])) for r in rows},
                   key=lambda k: (grids.index(k[2]), k[0] not in STYLES, k[0], k[1] != "on", k[1] or ""))
    # a line's colour: its objective when interruption differs, its (grid point, objective) when grid points do
    hues = list(dict.fromkeys((g, o) if len(grids) > 1 else o for o, _, g in lines))

    def label(objective: str, interrupt: str | None, grid: str) -> str:
        note = interruption_note(interrupt, values)
        point = ", ".join(f"{k}={json.dumps(v)}" for k, v in json.loads(grid).items()) if len(grids) > 1 else ""
        return objective + (f", {note}" if note else "") + (f", {point}" if point else "")

    labels = [label(*line) for line in lines]
    inside = fits_in_axes(labels, AXES_IN * 4.2, 8, 4)
    below = 0.0 if inside else legend_inches(labels, 4.2 * len(columns) - 0.2, 8)  # the axes keep their room
    fig = Figure(layout="constrained", figsize=(4.2 * len(columns), 4.2 + below))
    axes = fig.subplots(1, len(columns))
    drew = False
    for ax, column in zip(axes, columns):
        for objective, interrupt, grid in lines:
            by_eta = defaultdict(list)
            for r in rows:
                if (r["objective"], r["interrupt"], json.dumps(r["grid"])) == (objective, interrupt, grid) \
                        and r[column] is not None:
                    by_eta[r["eta"]].append(r[column])
            if not by_eta:
                continue
            etas = sorted(by_eta)
            m = np.array([np.mean(by_eta[e]) for e in etas])
            err = np.array([[m[i] - min(by_eta[e]), max(by_eta[e]) - m[i]] for i, e in enumerate(etas)]).T
            note = interruption_note(interrupt, values)
            off = interrupt == "off" and bool(note)
            # when interruption differs, an objective keeps one colour and off is told by marker and alpha
            hue = hues.index((grid, objective) if len(grids) > 1 else objective)
            style = {"color": palette(len(hues))[hue]} if len(values) > 1 or len(grids) > 1 else {}
            if off:
                style["alpha"] = OFF["alpha"]
            ax.set_xticks(sorted({r["eta"] for r in rows}))
            ax.errorbar(etas, m, yerr=err, fmt=STYLES.get(objective, "-") + ("x" if off else "o"), capsize=3,
                        label=label(objective, interrupt, grid), **style)
            drew = True
        ax.set_xlabel("η (max staleness)")
        ax.set_ylabel(column.replace("_", " "))
        ax.grid(alpha=0.3)
        if ax.lines and inside:
            axes_legend(ax, AXES_IN * 4.2, 8)
    if drew and not inside:  # one legend under the axes, which it would hide
        figure_legend(fig, *next(ax for ax in axes if ax.lines).get_legend_handles_labels(), 8)
    return fig if drew else None


def throughput(rows: list[dict]) -> Panel | None:
    """Trained tokens/s and ``speedup_vs_sync`` against η, one line per objective (and
    interruption, and ``--grid`` point, when the rows differ in them), from ``summarize`` rows."""
    fig = _by_eta(rows, ("trained_tokens_per_s", "tokens_per_wall_s", "speedup_vs_sync"))
    if fig is None:
        return None
    fig.axes[2].axhline(1.0, color="grey", lw=0.8, ls=":")
    return Panel("Throughput vs η", "Left: mean over steps of perf/trained_tokens_per_s (the trainer's rate "
                 "while training). Middle: all trained tokens over the run's wall time. Right: speedup_vs_sync, the "
                 "η = 0 run's mean step time (same objective, interruption, --grid values and seed) over this "
                 "run's; above the dotted line at 1 a step is faster than synchronous RL. Points: mean over seeds, "
                 "bars: min–max.", _png(fig))


def time_to_threshold(rows: list[dict], rule: Threshold) -> Panel | None:
    """``threshold_step`` and ``wall_s_to_threshold`` against η (the runs that reached the
    threshold), from ``summarize`` rows; ``None`` when none did."""
    fig = _by_eta(rows, ("threshold_step", "wall_s_to_threshold"))
    if fig is None:
        return None
    reached = sum(r["threshold_reached"] is True for r in rows)
    tried = sum(r["threshold_reached"] is not None for r in rows)
    what = f"{rule.metric} ≥ {rule.text()} ({rule.window}-step trailing mean)"
    return Panel(f"Time to {what}", f"Left: the first step whose trailing mean reaches the threshold; right: the "
                 f"run clock there (s). {reached} of {tried} runs reached it; the others are left out here and "
                 f"'not reached' in the table. Points: mean over the seeds that reached it, bars: min–max.",
                 _png(fig))


def interruption(rows: list[dict]) -> Panel | None:
    """With interruption on and off among ``rows``: ``multi_version_frac_mean`` and
    ``tokens_per_wall_s`` against η, on vs off per objective; ``None`` otherwise."""
    if not {"on", "off"} <= {r["interrupt"] for r in rows if r["eta"] is not None and r["objective"] is not None}:
        return None
    fig = _by_eta(rows, ("multi_version_frac_mean", "tokens_per_wall_s"))
    if fig is None:
        return None
    return Panel("Interruption on vs off", "Left: mean over steps of rollout/multi_version_frac (samples whose "
                 "tokens come from several policy versions: interrupted and resumed, so only with interruption "
                 "on). Right: all trained tokens over the run's wall time (without interruption a weight update "
                 "waits for the generations in flight). Points: mean over seeds, bars: min–max.", _png(fig))


def staleness_histograms(groups: list[Group]) -> Panel | None:
    """Per η, the fraction of trained samples at each staleness (``staleness/hist``, pooled over
    the seeds and steps of each objective, and interruption and ``--grid`` point when the groups
    differ in them)."""
    pooled: dict[int | str, dict[str, list[float]]] = defaultdict(dict)
    several = len({g.point for g in groups}) > 1
    for g in groups:
        values = [v for run in g.runs for r in run.train for v in (r.get("staleness/hist") or [])]
        if values:
            name = (g.objective or g.label) + (f", {g.note}" if g.note and g.eta is not None else "") + (
                f", {g.grid_text}" if g.eta is not None and several else "")
            pooled[g.eta if g.eta is not None else g.label][name] = values
    if not pooled:
        return None
    keys = sorted(pooled, key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0, str(k)))
    names = sorted({name for series in pooled.values() for name in series})
    colors = dict(zip(names, palette(len(names))))  # a series keeps its colour across the η panels
    cols = min(len(keys), 4)
    nrows = -(-len(keys) // cols)
    inside = fits_in_axes(names, AXES_IN * 3.6, 7, 6)
    below = 0.0 if inside else legend_inches(names, 3.6 * cols - 0.2, 7)  # below the axes, which it would hide
    fig = Figure(layout="constrained", figsize=(3.6 * cols, 3.0 * nrows + below))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        series = pooled[key]
        edges = np.arange(int(max(max(v) for v in series.values())) + 2) - 0.5
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(sorted(series.items())):
            counts, _ = np.histogram(values, bins=edges)
            ax.bar(edges[:-1] + 0.5 - 0.4 + width * (i + 0.5), counts / len(values), width=width, label=name,
                   color=colors[name])
        ax.set_title(f"η = {key}" if isinstance(key, int) else str(key), fontsize=10)
        ax.set_xticks(range(len(edges) - 1))
        ax.set_xlabel("staleness (steps)")
        ax.set_ylabel("fraction of samples")
        if inside:
            axes_legend(ax, AXES_IN * 3.6, 7)
    if not inside:
        handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
        figure_legend(fig, [handles[n] for n in names], names, 7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    return Panel("Staleness histograms per η", "Fraction of trained samples by staleness = step − version that "
                 "generated the sample's first token (staleness/hist), pooled over seeds and steps.", _png(fig))


def diagnostics(groups: list[Group]) -> Panel | None:
    """The off-policy diagnostics of ``DIAGNOSTICS`` against step (those any run logged)."""
    present = [(k, t) for k, t in DIAGNOSTICS if any(run.values(k) for g in groups for run in g.runs)]
    if not present:
        return None
    return _per_step_grid(groups, present, "Off-policy diagnostics vs step")


def episodes(groups: list[Group]) -> Panel | None:
    """``EPISODES`` against step, when some run's episodes had more than one turn or a tool call."""
    multi = any(v > 1 for g in groups for run in g.runs for _, v in run.values("rollout/turns")) or \
        any(v > 0 for g in groups for run in g.runs for _, v in run.values("rollout/tool_calls"))
    present = [(k, t) for k, t in EPISODES if any(run.values(k) for g in groups for run in g.runs)]
    return _per_step_grid(groups, present, "Episodes vs step") if multi and present else None


def palette(n: int) -> list[tuple]:
    """``n`` colours, each distinct: tab10's, tab20's for up to 20, else ``n`` spread over turbo."""
    if n <= 10:
        return list(matplotlib.colormaps["tab10"].colors[:n])
    if n <= 20:
        return list(matplotlib.colormaps["tab20"].colors[:n])
    return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]


def text_inches(text: str, fontsize: float) -> float:
    """The width of one line of ``text`` at ``fontsize`` points in the default font, in inches
    (5 % over matplotlib's glyph advance: what the drawn text takes)."""
    width, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=fontsize), ismath=False)
    return 1.05 * width / 72


def wrap_label(label: str, width_in: float, fontsize: float) -> str:
    """``label`` in lines of at most ``width_in`` inches: broken after ``", "`` where it can, else
    inside a part."""
    lines: list[str] = []
    for part in label.split(", "):
        joined = f"{lines[-1]}, {part}" if lines else part
        if lines and text_inches(joined, fontsize) <= width_in:
            lines[-1] = joined
            continue
        if lines:
            lines[-1] += ","
        while len(part) > 1 and text_inches(part, fontsize) > width_in:
            cut = 1
            while cut < len(part) - 1 and text_inches(part[:cut + 1], fontsize) <= width_in:
                cut += 1
            lines.append(part[:cut])
            part = part[cut:]
        lines.append(part)
    return "\n".join(lines)


def legend_layout(labels: list[str], width_in: float, fontsize: float) -> tuple[list[str], int, float]:
    """A legend across ``width_in`` inches: ``labels`` wrapped to fit it, the most columns their
    widths leave room for, and the legend's height in inches (with its margin)."""
    pt = fontsize / 72  # matplotlib's legend spacings are in font sizes
    text_room = width_in - (2 * 0.4 + 2.0 + 0.8 + 0.5) * pt  # border pads, handle, its pad, slack
    wrapped = [wrap_label(label, text_room, fontsize) for label in labels]
    widest = max((text_inches(line, fontsize) for label in wrapped for line in label.split("\n")), default=0.0)
    entry = widest + (2.0 + 0.8) * pt
    ncols = max(1, min(len(labels), int((text_room + 2.0 * pt) // (entry + 2.0 * pt))))
    rows = -(-len(labels) // ncols)
    columns = [wrapped[i * rows:(i + 1) * rows] for i in range(ncols)]  # matplotlib fills column by column
    lines = max(sum(label.count("\n") + 1 for label in column) for column in columns) if labels else 0
    return wrapped, ncols, (lines * 1.25 + (rows - 1) * 0.5 + 2 * 0.4) * pt + 0.2


def legend_inches(labels: list[str], width_in: float, fontsize: float) -> float:
    """The height a figure legend of ``labels`` across ``width_in`` inches takes (``legend_layout``)."""
    return legend_layout(labels, width_in, fontsize)[2]


def figure_legend(fig, handles: list, labels: list[str], fontsize: float) -> None:
    """One legend below the axes, its labels wrapped and its columns chosen to fit the figure's width."""
    wrapped, ncols, _ = legend_layout(labels, fig.get_figwidth() - 0.2, fontsize)
    fig.legend(handles, wrapped, loc="outside lower center", ncols=ncols, fontsize=fontsize)


def axes_legend(ax, width_in: float, fontsize: float) -> None:
    """The legend of ``ax`` (``width_in`` inches wide) inside it, each label wrapped to half its width."""
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [wrap_label(label, width_in / 2, fontsize) for label in labels], fontsize=fontsize)


def fits_in_axes(labels: list[str], width_in: float, fontsize: float, most: int) -> bool:
    """Whether a legend of ``labels`` belongs inside axes ``width_in`` inches wide: at most ``most``
    entries, each within half its width unwrapped; else it goes below them (``figure_legend``)."""
    return len(labels) <= most and all(text_inches(label, fontsize) <= width_in / 2 for label in labels)


def _per_step_grid(groups: list[Group], present: list[tuple[str, str]], title: str) -> Panel:
    cols = min(len(present), 3)
    nrows = -(-len(present) // cols)
    labels = [g.label for g in groups]
    inside = fits_in_axes(labels, AXES_IN * 4.4, 7, 6)
    below = 0.0 if inside else legend_inches(labels, 4.4 * cols - 0.2, 7)  # the legend's room: the axes keep theirs
    fig = Figure(layout="constrained", figsize=(4.4 * cols, 3.3 * nrows + below))
    axes = fig.subplots(nrows, cols, squeeze=False)
    colors = _colors(groups)
    for ax, (key, meaning) in zip(axes.flat, present):
        _draw(ax, groups, colors, key, "step")
        ax.set_title(f"{key}\n{meaning}", fontsize=9)
    if inside:
        axes_legend(axes.flat[0], AXES_IN * 4.4, 7)
    else:  # one legend under the axes, which it would hide
        figure_legend(fig, *axes.flat[0].get_legend_handles_labels(), 7)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    return Panel(title, "Per step (no smoothing); line: mean over seeds, band: min–max.", _png(fig))
