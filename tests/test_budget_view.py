"""The cross-domain view: the budget rows regrouped into a few lines per domain, drawn on
one time axis and printed in 100 columns, with nothing lost that the rows say."""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest

from qlink._budget_view import format_share, group_rows
from qlink.budget import BUDGETS, budget_rows
from tests.test_crossdomain import _table

TRANSPORTS = {"shm", "tcp", "ucx"}


@pytest.fixture(scope="module")
def rows():
    return budget_rows(_table())


def test_a_few_grouped_lines_carry_every_figure_of_the_rows(rows):
    lines = group_rows(rows)
    # 4 QEC figures x 2 distances, 2 KV figures x 2 models: 12 lines where the table has ~100 rows
    assert len(lines) == 12 and len([r for r in rows if not r["stage"]]) > 60
    assert [ln.domain for ln in lines] == ["qec"] * 8 + ["ai"] * 4
    assert len({ln.label for ln in lines}) == len(lines)  # no two lines with the same label
    by_label = {ln.label: ln for ln in lines}
    react = by_label["reaction time, d=11"]
    assert {s.name for s in react.series if s.basis == "measured"} == TRANSPORTS
    for s in react.series:  # p50 and p99 of the same transport on one series, from the rows
        want = {r["stat"]: r["value_us"] for r in rows
                if r["what"] == "QEC d=11 reaction time" and r["transport"] == s.name}
        assert (s.center_us, s.tail_us) == (want["p50"], want["p99"])
    assert react.budgets == (("reaction (Willow)", BUDGETS["qec.reaction"].limit_ns / 1e3),)
    kv = by_label["Llama-3-70B, 4k prompt"]
    assert [n for n, _ in kv.budgets] == ["KV transfer", "TTFT"]  # both budgets of the row pair, smallest first
    assert {s.name for s in kv.series if s.basis == "modeled"} == {"nvlink4", "pcie5-x16", "ib-ndr", "nvqlink"}
    # every measured or modeled value of a non-stage row shows up on some line (the link-part rows repeat
    # the modeled round trip, so they are left out of the view on purpose)
    shown = {(s.name, s.basis, v) for ln in lines for s in ln.series for v in (s.center_us, s.tail_us)}
    for r in rows:
        if not r["stage"] and "link part only" not in r["what"]:
            assert (r["transport"], r["basis"], r["value_us"]) in shown, r


def test_an_unknown_row_gets_a_line_of_its_own_and_an_engine_label():
    extra = [dict(domain="ai", what="tiny-llama TTFT (vLLM engine, 64 tokens)", transport="shm", basis="measured",
                  stat="p50", value_us=12_000.0, budget=BUDGETS["ai.ttft"].name, budget_us=250_000.0,
                  share_pct=4.8, stage="", engine="vllm")]
    [line] = group_rows(extra)
    assert line.label == "tiny-llama TTFT" and [s.name for s in line.series] == ["vllm shm"]
    assert line.budgets == (("TTFT", 250_000.0),)


@pytest.mark.parametrize("pct, text", [(0.4, "<1 %"), (38.0, "38 %"), (199.0, "199 %"), (652.8, "6.5×"),
                                       (1658.7, "17×"), (501031.0, ">999×"), (math.nan, "—")])
def test_shares_past_200_percent_read_as_multiples(pct, text):
    assert format_share(pct) == text


def test_the_console_summary_fits_100_columns(rows):
    from qlink.run import print_cross_domain_tables

    buf = io.StringIO()
    with redirect_stdout(buf):
        print_cross_domain_tables(rows, notes=["KV llama-3-70b over ucx: not measured (TimeoutError: the peer "
                                               "did not answer within 600 s; the transport may be down) " * 2])
    text = buf.getvalue()
    assert max(len(x) for x in text.splitlines()) <= 100
    assert "%" in text and "×" in text and "501031" not in text
    for ln in group_rows(rows):  # every line of the view is printed
        assert ln.label in text
    assert "reaction time, d=5 · shm" in text  # the per-stage summary


def test_the_figure_has_one_row_per_line_and_a_legend_for_every_series(rows, tmp_path):
    from matplotlib.image import imread

    from qlink._budget_figure import fig_cross_domain
    from qlink.crossdomain import plot_cross_domain

    fig = fig_cross_domain(rows)
    strip, qec, ai = fig.axes[:3]
    assert [t.get_text() for t in qec.get_yticklabels()] == [ln.label for ln in group_rows(rows)[:8]]
    assert len(ai.get_yticklabels()) == 4
    assert qec.get_xscale() == ai.get_xscale() == "log" and qec.get_xlim() == ai.get_xlim() == strip.get_xlim()
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {f"{t} (measured here)" for t in TRANSPORTS} | {"nvqlink (modeled)", "nvlink4 (modeled)"} <= legend
    png = plot_cross_domain(rows, tmp_path / "x.png")
    h, w = imread(str(png)).shape[:2]
    assert w <= 1600 and h <= 2000  # one page at 200 dpi, not a scroll of bars
