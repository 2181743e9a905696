"""The benchmark harness's rule for judging a ratio against its target, on synthetic rounds
(bench/spread.py): met in every round is yes, a median that misses is no, a median that meets
the target over a spread that crosses it is not shown, for "≥" and "≤" targets alike; and how a
ratio, its verdict and the load are written in a report. Needs no server and runs no benchmark."""

import os
import sys

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import spread  # noqa: E402
from spread import NO, NOT_SHOWN, YES, Ratio  # noqa: E402


@pytest.fixture(autouse=True)
def clean_table():
    """conftest's autouse fixture starts a cluster: these tests compute only."""
    yield


def rounds(side, other):
    """A Ratio of two sides' tps per round, as the harness pairs them."""
    return Ratio.of(side, other)


# --- the rule ----------------------------------------------------------------------------------

def test_at_least_met_in_every_round_is_yes():
    r = rounds([950, 980, 1010], [1000, 1000, 1000])
    assert (r.median, r.lo, r.hi) == pytest.approx((0.98, 0.95, 1.01))
    assert spread.judge(r, ">=", 0.90) == YES


def test_at_least_median_met_but_one_round_below_is_not_shown():
    r = rounds([950, 880, 1010], [1000, 1000, 1000])
    assert r.median == pytest.approx(0.95)
    assert spread.judge(r, ">=", 0.90) == NOT_SHOWN


def test_at_least_median_missed_is_no():
    r = rounds([850, 880, 1010], [1000, 1000, 1000])
    assert spread.judge(r, ">=", 0.90) == NO


def test_at_most_met_in_every_round_is_yes():
    assert spread.judge(Ratio([0.98, 1.01, 1.03]), "<=", 1.05) == YES


def test_at_most_median_met_but_max_above_is_not_shown():
    assert spread.judge(Ratio([0.98, 1.01, 1.12]), "<=", 1.05) == NOT_SHOWN


def test_at_most_median_missed_is_no():
    assert spread.judge(Ratio([1.06, 1.08, 1.01]), "<=", 1.05) == NO


def test_strict_target_on_its_threshold():
    # "> reference": a round equal to the other side does not show it faster.
    assert spread.judge(Ratio([1.0, 1.2, 1.3]), ">", 1.0) == NOT_SHOWN
    assert spread.judge(Ratio([1.0, 1.0, 1.1]), ">", 1.0) == NO
    assert spread.judge(Ratio([1.1, 1.2, 1.3]), ">", 1.0) == YES


def test_judged_on_the_figures_not_their_rounding():
    # 0.899 is written 0.90 but misses 0.90.
    assert spread.judge(Ratio([0.899]), ">=", 0.90) == NO
    assert Ratio([0.899]).cell() == "0.90"


def test_one_round_is_judged_by_itself():
    assert spread.judge(Ratio([0.95]), ">=", 0.90) == YES
    assert spread.judge(Ratio([0.85]), ">=", 0.90) == NO


def test_no_rounds_is_no():
    r = Ratio([])
    assert r.median != r.median
    assert spread.judge(r, ">=", 0.90) == NO
    assert r.cell() == "n/a"


def test_rounds_pair_by_index_and_skip_missing():
    # Round 2 of the second side never ran (None), round 3 of the first: only rounds 1 and 4
    # pair; a zero on the other side is no ratio.
    r = Ratio.of([100, 90, None, 80, 70], [100, None, 50, 100, 0])
    assert r.rounds == pytest.approx([1.0, 0.8])


# --- the cells ---------------------------------------------------------------------------------

def test_cell_median_and_spread():
    assert rounds([950, 880, 1010], [1000, 1000, 1000]).cell() == "0.95 (0.88-1.01)"
    assert Ratio([130307.2, 120000, 140000]).cell(0) == "130,307 (120,000-140,000)"


def test_cell_of_one_round_is_bare():
    assert Ratio([0.98]).cell() == "0.98"


def test_met_cells():
    assert [spread.met_cell(v) for v in (YES, NO, NOT_SHOWN)] == ["yes", "**no**", "*not shown*"]
    assert {spread.CELL_VERDICT[spread.met_cell(v)] for v in (YES, NO, NOT_SHOWN)} == {YES, NO, NOT_SHOWN}


def test_load_cell_and_header():
    assert spread.load_cell([1.0, 2.0, 3.0]) == "2.00 (1.00-3.00)"
    assert spread.load_cell([]) == ""
    header = spread.load_header([0.5, 1.5, 4.0])
    assert header.startswith("load average during the run: 1-min mean 2.00, range 0.50-4.00")
    assert spread.parse_load_header(header) == (2.0, 0.5, 4.0)
    assert spread.parse_load_header("Server: PostgreSQL 16.15; run on 2026-12-01.") is None


def test_load_log_samples_around_a_run():
    log, into = spread.LoadLog(), []
    assert log.around(lambda: 42, into) == 42
    assert len(log.samples) == 2 and into == log.samples


# --- reading reports of either format ------------------------------------------------------------

def test_parse_measured_old_and_new():
    assert spread.parse_measured("0.98") == ("0.98", None)
    assert spread.parse_measured("130,307") == ("130,307", None)
    # Before the spreads, a parenthesis held a note, not a range.
    assert spread.parse_measured("0.99 (2.44 ms vs 2.46 ms, medians)") == ("0.99", None)
    assert spread.measured_text("0.99 (2.44 ms vs 2.46 ms, medians)") == "0.99"
    assert spread.parse_measured("0.95 (0.88-1.01)") == ("0.95", "0.88-1.01")
    assert spread.measured_text("130,307 (120,000-140,000)") == "130,307 (120,000-140,000)"
