"""benchmarks/mttr_compare.py's report, from runs given here (the runs themselves are
mttr.py's, tested with it): medians, the ratio and the range rule per cell."""

from __future__ import annotations

from benchmarks.mttr_compare import markdown, summarize


def _run(system: str, row: str, recovery_s: float | None, lost: int = 0) -> dict:
    return {"system": system, "row": row, "recovery_s": recovery_s, "steps_lost": lost,
            "path": "in-place"}


def test_each_cell_gives_both_medians_the_ratio_and_whether_after_is_within_before():
    runs = {"before": [_run("d", "crash", t) for t in (0.8, 0.6, 1.0)]
            + [_run("d", "silent", t) for t in (5.0, 5.2)],
            "after": [_run("d", "crash", t) for t in (0.7, 0.9, 0.5)]
            + [_run("d", "silent", t) for t in (6.0, 6.4, None)]}
    cells = summarize(runs)
    crash, silent = cells["d:crash"], cells["d:silent"]
    assert (crash["before"]["median_s"], crash["after"]["median_s"]) == (0.8, 0.7)
    assert crash["after_over_before"] == 0.875 and crash["within_before_range"] is True
    # a run with no recovery (a timeout) has no time; its steps lost still count
    assert silent["after"]["recovery_s"] == [6.0, 6.4] and silent["after"]["median_s"] == 6.2
    assert len(silent["after"]["steps_lost"]) == 3
    assert silent["within_before_range"] is False
    text = markdown({"before": {"commit": "aaa"}, "after": {"commit": "bbb"}, "command": "x",
                     "seeds": [1], "cells": cells})
    assert "| d:crash | 0.8 (0.8, 0.6, 1.0) | 0.7 (0.7, 0.9, 0.5) | 0.875 | yes |" in text
    assert "| d:silent |" in text and "| no |" in text
