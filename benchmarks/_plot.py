"""Figures for the benchmarks' ``--plot PATH.png``: PNG files drawn with matplotlib.

matplotlib is an optional extra (``pip install 'dblock[plots]'``); a benchmark without
``--plot`` never imports it. How a benchmark uses this module (it imports as ``_plot``, as
``_timing``, with benchmarks/ on ``sys.path``):

    import _plot  # benchmarks/_plot.py

    ap.add_argument("--plot", metavar="PATH.png", help="also draw ... (needs dblock[plots])")
    args = ap.parse_args()
    if args.plot:
        _plot.require()  # fail now, not after a run of minutes
    ...  # measure, print the table
    if args.plot:
        _plot.line_plot(args.plot, "Title", "x label", "y label", {"dblock": [(12, 1.7), (200, 2.1)]})

``line_plot`` draws one line per series (points joined in x order); ``bar_plot`` draws
groups of bars. Both create the file's folder, write a PNG of some tens of kB with the Agg
backend (no display needed), and return the path written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Point = tuple[float, float]

INSTALL = "pip install 'dblock[plots]' (in a checkout: pip install -e '.[plots]')"


def require() -> None:
    """Raise SystemExit naming the extra to install if matplotlib is missing."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"--plot draws with matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")  # PNG files only: no display, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    path: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, Sequence[Point]],
    *,
    dashed: Mapping[str, Sequence[Point]] | None = None,
    dashed_label: str = "p99",
    hlines: Mapping[str, float] | None = None,
    note: str | None = None,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """Write a line chart of ``series`` (name -> [(x, y), ...]) to ``path``.

    ``dashed`` holds a second line for some of the names, drawn dashed in the same colour and
    labelled "name, dashed_label" (a p99 beside a p50). ``hlines`` are flat reference lines
    (name -> y), e.g. a baseline measured once rather than at each x. ``note`` is a smaller
    line under the title (server, machine, sizes). With few distinct x values, each gets a tick
    of its own. A linear y axis starts at 0, so that the eye reads ratios right; NaN points
    leave a gap.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100, layout="constrained")
    try:
        xs: set[float] = set()
        for name, points in series.items():
            line = _line(ax, name, points, "-")
            xs.update(x for x, _ in points)
            extra = (dashed or {}).get(name)
            if extra:
                _line(ax, f"{name}, {dashed_label}", extra, "--", color=line.get_color())
        for name, y in (hlines or {}).items():
            ax.axhline(y, linestyle=":", color="0.4", label=name)
        if logx:
            ax.set_xscale("log")
        if logy:
            _log_y(ax)
        else:
            ax.set_ylim(bottom=0)
        if 0 < len(xs) <= 12:
            from matplotlib.ticker import NullFormatter

            ax.set_xticks(sorted(xs), [_number(x) for x in sorted(xs)])
            ax.xaxis.set_minor_formatter(NullFormatter())  # a log axis labels its minor ticks too
        _finish(fig, ax, title, xlabel, ylabel, note)
        return _save(fig, path)
    finally:
        plt.close(fig)


def bar_plot(
    path: str | Path,
    title: str,
    ylabel: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    note: str | None = None,
    logy: bool = False,
) -> Path:
    """Write a bar chart to ``path``: for each of ``groups`` (the x labels), one bar per series.

    ``series`` maps a name to one value per group, in the order of ``groups``; NaN draws no bar.
    With a single series its name is left out of the legend (the title says it).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100, layout="constrained")
    try:
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            offsets = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(offsets, values, width, label=name if len(series) > 1 else None)
        ax.set_xticks(range(len(groups)), groups)
        if logy:
            _log_y(ax)
        _finish(fig, ax, title, None, ylabel, note)
        return _save(fig, path)
    finally:
        plt.close(fig)


def _line(ax: Any, name: str, points: Sequence[Point], style: str, **kw: Any) -> Any:
    ordered = sorted(points)
    (line,) = ax.plot([x for x, _ in ordered], [y for _, y in ordered], style, marker="o", label=name, **kw)
    return line


def _log_y(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")

    def minor(v: float, _: int) -> str:
        low, high = ax.get_ylim()
        # Over a short span every minor tick is labelled; over a longer one only the 2s and 5s.
        return f"{v:g}" if high / low < 20 or f"{v:e}"[0] in "25" else ""

    # Plain numbers (0.5, 2, 10) rather than powers of ten.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _finish(fig: Any, ax: Any, title: str, xlabel: str | None, ylabel: str, note: str | None) -> None:
    if note is None:
        ax.set_title(title, fontsize=12)
    else:
        fig.suptitle(title, fontsize=12)
        ax.set_title(note, fontsize=9, color="0.3")
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) > 4:  # below the chart, where it hides no line; the figure grows to make room
        fig.set_figheight(fig.get_figheight() + 0.2 * ((len(labels) + 1) // 2))
        fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    elif labels:
        ax.legend(fontsize=9)


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _number(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"
