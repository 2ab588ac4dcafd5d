"""Figures: each plot function writes a real PNG and PDF, also on empty input."""

import numpy as np
import polars as pl
import pytest

from kvdiverge.engine.core.coupled import simulate
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.confirmatory import confirmatory_analysis
from kvdiverge.estimation.estimators import document_estimates, replicate_estimates
from kvdiverge.estimation.gap import gap_decomposition
from kvdiverge.estimation.pooling import branch_tv_curve, pooled_estimates, survival_curve
from kvdiverge.estimation.speculative import speculative_table
from kvdiverge.estimation.timing import variance_table
from kvdiverge.report import analyses, speculative, survival

PLAN = {
    "policy": "B",
    "early": [1, 2],
    "late": [3, 4],
    "test": "wilcoxon-signed-rank",
    "alternative": "greater",
    "correction": "holm",
    "alpha": 0.05,
}


@pytest.fixture(scope="module")
def tables(kernel):
    frames = []
    for policy, split in (("A", "exploratory"), ("B", "exploratory"), ("B", "confirmatory")):
        for i in range(4):
            f = simulate(TableKernelPair(kernel, 3), 6, 3, seed=1 if policy == "A" else 2, doc_id=f"{split}{i}")
            frames.append(
                f.with_columns(pl.lit("m").alias("model"), pl.lit(policy).alias("policy"), pl.lit(split).alias("split"))
            )
    docs = document_estimates(replicate_estimates(pl.concat(frames), 2))
    gaps = gap_decomposition(docs, "m", "A", "B", "exploratory", Bootstrap(100, 0.95, 1))
    res, per = confirmatory_analysis(
        docs.filter(pl.col("split") == "confirmatory"), PLAN, "confirmatory", Bootstrap(100, 0.95, 1)
    )
    return {
        "docs": docs,
        "survival": survival_curve(docs, Bootstrap(100, 0.95, 1)),
        "branch": branch_tv_curve(docs, Bootstrap(100, 0.95, 1)),
        "gaps": gaps,
        "res": res,
        "per": per,
        "pooled": pooled_estimates(docs, Bootstrap(100, 0.95, 1)),
    }


def check(tmp_path, name):
    png, pdf = tmp_path / f"{name}.png", tmp_path / f"{name}.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert pdf.read_bytes()[:4] == b"%PDF"
    assert not list(tmp_path.glob(".*tmp*")) and not list(tmp_path.glob(f".{name}*"))


def test_every_figure(tables, tmp_path):
    t = tables
    survival.plot_survival(t["survival"], tmp_path / "s.png", tmp_path / "s.pdf")
    check(tmp_path, "s")
    analyses.plot_gaps(t["gaps"], tmp_path / "g.png", tmp_path / "g.pdf")
    check(tmp_path, "g")
    analyses.plot_branch_tv(t["branch"], tmp_path / "b.png", tmp_path / "b.pdf", early=(1, 2), late=(3, 4))
    check(tmp_path, "b")
    analyses.plot_confirmatory(t["per"], t["res"], tmp_path / "c.png", tmp_path / "c.pdf")
    check(tmp_path, "c")
    analyses.plot_variance(variance_table(t["pooled"]), tmp_path / "v.png", tmp_path / "v.pdf")
    check(tmp_path, "v")
    speculative.plot_speculative(
        speculative_table(t["docs"], Bootstrap(100, 0.95, 1)), tmp_path / "k.png", tmp_path / "k.pdf", floor="A"
    )
    check(tmp_path, "k")


def test_empty_inputs_still_give_figures(tables, tmp_path):
    t = tables
    survival.plot_survival(t["survival"].head(0), tmp_path / "s.png", tmp_path / "s.pdf")
    analyses.plot_gaps(t["gaps"].head(0), tmp_path / "g.png", tmp_path / "g.pdf")
    nan_branch = t["branch"].with_columns(pl.lit(np.nan).alias("btv"))
    analyses.plot_branch_tv(nan_branch, tmp_path / "b.png", tmp_path / "b.pdf")
    analyses.plot_confirmatory(
        t["per"].with_columns(pl.lit(None, dtype=pl.Float64).alias("d")),
        t["res"],
        tmp_path / "c.png",
        tmp_path / "c.pdf",
    )
    analyses.plot_variance(variance_table(t["pooled"]).head(0), tmp_path / "v.png", tmp_path / "v.pdf")
    for name in "sgbcv":
        assert (tmp_path / f"{name}.png").stat().st_size > 0 and (tmp_path / f"{name}.pdf").stat().st_size > 0


def test_survival_bands_share_their_lines_colour(tables, tmp_path, monkeypatch):
    """Runs listed out of alphabetical order once gave each band another run's colour."""
    from matplotlib.colors import to_rgb

    t = tables
    s = t["survival"]
    s = s.filter((pl.col("split") == s["split"][0]) & (pl.col("policy") == s["policy"][0]))
    # three runs, given in reverse alphabetical order of their labels
    runs = pl.concat(
        [
            s.with_columns(pl.lit(p).alias("policy"), pl.col("S") * f, pl.col("S_lo") * f, pl.col("S_hi") * f)
            for p, f in (("zeta", 1.0), ("mid", 0.6), ("alpha", 0.3))
        ]
    )
    figures = []
    monkeypatch.setattr(survival, "save_figure", lambda fig, png, pdf: figures.append(fig))
    survival.plot_survival(runs, tmp_path / "s.png", tmp_path / "s.pdf")
    ax = figures[0].axes[0]
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
    bands = ax.collections
    assert len(lines) == len(bands) == 3
    for line in lines:  # the band whose upper edge is this line's curve has its colour
        top = float(np.max(line.get_ydata()))
        band = min(bands, key=lambda b: abs(b.get_paths()[0].vertices[:, 1].max() - top))
        assert np.allclose(to_rgb(line.get_color()), band.get_facecolor()[0][:3])


def test_speculative_figure_draws_each_run_and_its_iid_line(tables):
    import matplotlib.pyplot as plt

    table = speculative_table(tables["docs"].filter(pl.col("split") == "exploratory"), Bootstrap(100, 0.95, 1))
    fig = speculative.speculative_figure(table, floor="A")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["B", "noise floor (A)", "i.i.d. (1 − α^(k+1)) / (1 − α)"]
    dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":" and len(ln.get_xdata())]
    b = table.filter(pl.col("policy") == "B").sort("k")
    assert any(np.allclose(ln.get_ydata(), b["iid_tokens_per_forward"].to_numpy()) for ln in dotted)
    assert ax.get_xlabel() == "draft block length k (tokens)"
    plt.close(fig)


def _synthetic(kind: str) -> pl.DataFrame:
    """One model's curves over steps 0..8: policies ``same-a`` and ``same-b`` exactly equal, ``apart`` 0.05 below
    (and, for the length figure, its full side 0.1 below that)."""
    t = np.arange(9)
    curve = 0.95**t
    rows = []
    for policy, shift in (("same-a", 0.0), ("same-b", 0.0), ("apart", -0.05)):
        y = curve + shift
        base = {"model": "m", "policy": policy, "split": "exploratory"}
        if kind == "survival":
            rows.append(pl.DataFrame({**base, "t": t, "S": y, "S_lo": y - 0.1, "S_hi": y + 0.02, "n_docs": 4}))
        elif kind == "branch":
            rows.append(pl.DataFrame({**base, "lag": t, "btv": y, "btv_lo": y - 0.1, "btv_hi": y + 0.02, "n_docs": 4}))
        else:  # length: the two sides of same-a and same-b equal, apart's full side 0.1 below its compressed one
            for side, drop in (("compressed", 0.0), ("full", 0.1 if policy == "apart" else 0.0)):
                rows.append(pl.DataFrame({**base, "side": side, "t": t, "survival": y - drop}))
    return pl.concat(rows)


FIGURES_WITH_LINES = {
    "survival": lambda table: survival.survival_figure(table),
    "length": lambda table: survival.length_figure(table),
    "branch": lambda table: analyses.plot_branch_tv(table, "b.png", "b.pdf"),
}

#: Per figure: the labels of the coinciding lines, and the legend's note naming them.
COINCIDING = {
    "survival": (["same-a", "same-b"], "on one curve (markers offset): same-a; same-b"),
    "branch": (
        ["same-a (exploratory)", "same-b (exploratory)"],
        "on one curve (markers offset): same-a (exploratory); same-b (exploratory)",
    ),
    "length": (
        ["same-a, compressed", "same-a, full", "same-b, compressed", "same-b, full"],
        "on one curve (markers offset): same-a, both sides; same-b, both sides",
    ),
}


@pytest.mark.parametrize("kind", list(FIGURES_WITH_LINES))
def test_coinciding_curves_are_named_in_the_legend_and_marked_at_offset_steps(kind, monkeypatch):
    """Two policies with the same curve: the legend names both as one curve, and each of the n coinciding
    lines shows its own marker shape at every n-th step, at steps no other one marks; the curve 0.05
    apart is neither named nor given offset markers."""
    import matplotlib.pyplot as plt

    figures = []
    for module in (survival, analyses):  # the survival, length and branch TV figures' save_figure
        monkeypatch.setattr(module, "save_figure", lambda fig, *paths: figures.append(fig))
    fig = FIGURES_WITH_LINES[kind](_synthetic(kind)) or figures[0]
    ax = fig.axes[0]
    texts = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    labels, note = COINCIDING[kind]
    assert [t for t in texts if "on one curve" in t] == [note]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if len(ln.get_xdata()) == 9}
    assert len(lines) == (6 if kind == "length" else 3)
    assert all(np.array_equal(lines[k].get_ydata(), lines[labels[0]].get_ydata()) for k in labels)
    assert len({lines[k].get_marker() for k in labels}) == len(labels)
    for j, k in enumerate(labels):  # markevery (start, every): the j-th line marks steps j, j + n, ...
        start, every = lines[k].get_markevery()
        assert np.asarray(lines[k].get_xdata())[start::every].tolist() == list(range(j, 9, len(labels)))
    apart = [ln for k, ln in lines.items() if k.startswith("apart")]
    assert apart and all(ln.get_markevery() is None for ln in apart)
    assert not any("apart" in t for t in texts if "on one curve" in t)
    plt.close(fig)


def test_curves_coincide_within_the_tolerance_on_their_shared_steps():
    from kvdiverge.report.coincide import coinciding_groups

    x = np.arange(5.0)
    curves = {
        "a": (x, np.ones(5)),
        "b": (x, np.ones(5) - 0.009),  # 0.009 below a
        "c": (x, np.ones(5) - 0.015),  # 0.015 below a, 0.006 below b: joins a's group through b
        "d": (x[:3], np.ones(3)),  # a's first three steps: lies on a
        "e": (x + 10, np.ones(5)),  # no step shared
        "f": (x, np.linspace(0, 1, 5)),
    }
    assert coinciding_groups(curves, 0.01) == [["a", "b", "c", "d"]]
    assert coinciding_groups(curves, 0.005) == [["a", "d"]]
    assert coinciding_groups({"a": curves["a"], "f": curves["f"]}, 0.01) == []
