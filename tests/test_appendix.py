import pytest
from labkit import appendix
from labkit.results import Goal, Record


def _rec(chapter, goals):
    return Record("x.y", chapter, "t", "m", rows=[{"a": 1}], goals=goals,
                  provenance={"mode": "gpu", "device": "NVIDIA H200", "date": "2026-12-02T10:00:00"})


def test_margin_orients_both_kinds_of_goal():
    assert appendix.margin(Goal("g", 0.95, ">=", 0.9)) == pytest.approx(0.95 / 0.9)
    assert appendix.margin(Goal("g", 2.0, "<=", 1.0)) == pytest.approx(0.5)


def test_table_and_figure_show_missed_goals():
    recs = [_rec("a", [Goal("fast", 1.2, ">=", 1.1), Goal("slow", 0.5, ">=", 0.8)]), _rec("b", [Goal("c", 1, ">=", 1)])]
    table = appendix.goals_frame(recs)
    assert list(table["status"]) == ["met", "MISSED", "met"]
    assert set(table["device"]) == {"NVIDIA H200"}
    fig = appendix.goals_figure(recs)
    assert len(fig.data) == 2 and len(fig.layout.updatemenus[0].buttons) == 2
    with pytest.raises(ValueError, match="no recorded goals"):
        appendix.goals_figure([_rec("a", [])])
