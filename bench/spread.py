"""How sure a benchmark's ratio is: the rounds behind it, the rule that judges it against its
target, and the machine's load while it ran. Shared by bench.py, editions.py, pooler.py and
citus.py; pure Python, no server (tests/static/test_bench_harness.py tests it).

A ratio between two sides is computed per round: round r of one side over round r of the other.
The rounds alternate (the order of the variants reversed every other round), so the two runs of
a round saw the same minute of this shared machine; a ratio of two medians would pair one side's
quiet minute with the other's busy one. The reported ratio is the median of the rounds' ratios,
with their minimum and maximum, the spread.

The rule, for a target such as "≥ 0.90" or "≤ 1.05":
- yes: the median and every round meet it;
- no: the median misses it;
- not shown: the median meets it, but the spread crosses it (the minimum is below a "≥" or ">"
  target, the maximum above a "≤" or "<" one): the run does not show the target is met, and a
  second run could as well miss it.
A value measured once (one round) has no spread and is judged by that value alone.
"""

import operator
import os
import re
import statistics

YES, NO, NOT_SHOWN = "yes", "no", "not shown"
# How the verdicts are written in a report's met column: a miss in bold (as the reports always
# had it), a median that meets its target over a spread that crosses it in italics, so neither
# reads as a plain yes.
VERDICT_CELL = {YES: "yes", NO: "**no**", NOT_SHOWN: "*not shown*"}
# What a met column may say, in a report of either format (before the spreads there were only
# yes and **no**), back to the verdict.
CELL_VERDICT = {"yes": YES, "**no**": NO, "no": NO, "*not shown*": NOT_SHOWN, "not shown": NOT_SHOWN,
                "**not shown**": NOT_SHOWN}

OPERATORS = {">=": operator.ge, "≥": operator.ge, ">": operator.gt,
             "<=": operator.le, "≤": operator.le, "<": operator.lt}
# "≤ 1.05": a larger value is the wrong side.
UPPER = {"<=", "≤", "<"}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def number(x, digits=2):
    """A figure as the reports write it: thousands separated, `digits` decimals, n/a for none."""
    return "n/a" if x is None or x != x else f"{x:,.{digits}f}"


class Ratio:
    """A figure over rounds (usually a ratio): the median of the rounds' values and their
    minimum and maximum. `load` holds the load average samples taken around the runs behind it."""

    def __init__(self, rounds, load=()):
        self.rounds = [x for x in rounds if x is not None and x == x]
        self.load = [x for x in load if x is not None and x == x]
        self.median = median(self.rounds)
        self.lo = min(self.rounds) if self.rounds else float("nan")
        self.hi = max(self.rounds) if self.rounds else float("nan")

    @classmethod
    def of(cls, side, other, load=()):
        """Round r of `side` over round r of `other` (lists of figures per round, the rounds
        alternating); a round that one side lacks, or whose other side is zero, is left out."""
        return cls([a / b for a, b in zip(side, other) if a is not None and b], load)

    def cell(self, digits=2):
        """`median (min-max)`; the bare median when there is one round (no spread to show)."""
        if len(self.rounds) < 2:
            return number(self.median, digits)
        return f"{number(self.median, digits)} ({number(self.lo, digits)}-{number(self.hi, digits)})"

    def judge(self, op, goal):
        return judge(self, op, goal)

    def __repr__(self):
        return f"Ratio({self.rounds!r})"


def judge(ratio, op, goal):
    """YES, NO or NOT_SHOWN: `ratio` (a Ratio) against the target `op goal`, e.g. (">=", 0.90).
    The median decides whether it is met; the spread, whether the run shows it (see the module)."""
    meets = OPERATORS[op]
    if not meets(ratio.median, goal):  # a NaN median meets nothing
        return NO
    worst = ratio.hi if op in UPPER else ratio.lo
    return YES if meets(worst, goal) else NOT_SHOWN


def met_cell(verdict):
    return VERDICT_CELL[verdict]


def loadavg():
    """The 1-minute load average now (NaN where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


class LoadLog:
    """The load average samples of a whole run: each run of a comparison samples before and
    after itself (loadavg) into the log and into its own list, so the report can give both the
    load over the whole run and over each comparison."""

    def __init__(self):
        self.samples = []

    def sample(self):
        x = loadavg()
        self.samples.append(x)
        return x

    def around(self, run, into=None):
        """run()'s result; the load before and after it appended to `into` (a list) too."""
        before = self.sample()
        result = run()
        after = self.sample()
        if into is not None:
            into += [before, after]
        return result


def load_summary(samples):
    """(mean, min, max) of load average samples, or None without any."""
    xs = [x for x in samples if x is not None and x == x]
    if not xs:
        return None
    return statistics.fmean(xs), min(xs), max(xs)


def load_cell(samples):
    """`mean (min-max)` of the samples, for a comparison's row; empty without samples."""
    s = load_summary(samples)
    return "" if s is None else f"{s[0]:.2f} ({s[1]:.2f}-{s[2]:.2f})"


LOAD_HEADER = "load average during the run: 1-min mean"


def load_header(samples):
    """The report's line on the machine's load over the whole run."""
    s = load_summary(samples)
    if s is None:
        return "Load average during the run: not available on this system."
    return (f"{LOAD_HEADER.capitalize()} {s[0]:.2f}, range {s[1]:.2f}-{s[2]:.2f} ({len(samples)} samples, "
            "before and after each run; the benchmark's own processes count in it).")


def parse_load_header(line):
    """(mean, min, max) from a line load_header wrote, or None."""
    m = re.search(re.escape(LOAD_HEADER) + r" ([\d.]+), range ([\d.]+)-([\d.]+)", line, re.I)
    return tuple(float(x) for x in m.groups()) if m else None


def rule_text(goal_word="target"):
    """The paragraph a report opens with on how its ratios are judged."""
    return (f"How a {goal_word} is judged: a ratio is the median of the rounds' ratios (round r of one "
            "side over round r of the other; the rounds alternate, the order reversed every other "
            "round), written `median (min-max)` with the spread over the rounds. Met: yes when the "
            "median and every round meet the target; **no** when the median misses it; *not shown* "
            "when the median meets it but the spread crosses it (the minimum below a ≥ target, the "
            "maximum above a ≤ one). A figure without a range was measured once (one round), so it "
            "has no spread and is judged by itself. The 1-minute load average is sampled before and "
            "after each run; a row's load is its mean (min-max) over that comparison's runs.")


# A measured cell of a report, of either format: `0.98`, `130,307`, `0.99 (2.44 ms vs 2.46 ms,
# medians)` (before the spreads: the parenthesis was a note) or `0.98 (0.91-1.04)` (a spread).
MEASURED = re.compile(r"^(?P<median>[\d.,]+|n/a)(?: \((?P<lo>[\d.,]+|n/a)-(?P<hi>[\d.,]+|n/a)\))?")


def parse_measured(text):
    """(median, spread or None) as written in a measured cell: `0.98 (0.91-1.04)` gives
    ("0.98", "0.91-1.04"); a cell of the format before the spreads, ("0.98", None)."""
    text = text.strip()
    m = MEASURED.match(text)
    if not m:
        return text, None
    spread = f"{m['lo']}-{m['hi']}" if m["lo"] is not None else None
    return m["median"], spread


def measured_text(text):
    """A measured cell as the per-version summary shows it: `median (min-max)`, or the bare
    figure of a report without spreads (its old notes in parentheses dropped)."""
    med, spread = parse_measured(text)
    return med if spread is None else f"{med} ({spread})"
