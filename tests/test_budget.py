"""The suite's time budget (tests/budget.py): a part that outgrows it fails, in units of the machine's speed."""

from __future__ import annotations

from types import SimpleNamespace

import budget
import pytest


def finished_part(monkeypatch, unit: float, durations: list[float], part: str = "serial"):
    monkeypatch.setattr(budget, "measure_unit", lambda copies: unit)
    plugin = budget.SuiteBudget(part, workers=1)
    for i, seconds in enumerate(durations):
        plugin.pytest_runtest_logreport(SimpleNamespace(duration=seconds, nodeid=f"test_{i}"))
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    plugin.pytest_sessionfinish(session, session.exitstatus)
    return plugin, session


def test_a_part_within_its_budget_passes_and_says_where_it_stands(monkeypatch):
    allowed = budget.BUDGETS["serial"].test_seconds * budget.MARGIN  # in seconds at the reference unit
    plugin, session = finished_part(monkeypatch, budget.REFERENCE_UNIT, [allowed * 0.4, allowed * 0.5])
    assert session.exitstatus == pytest.ExitCode.OK
    assert plugin.verdict.startswith("serial part: ") and "2 tests took" in plugin.verdict
    assert "FAILED" not in plugin.verdict


def test_a_part_over_its_budget_fails_and_says_what_to_do(monkeypatch):
    allowed = budget.BUDGETS["serial"].test_seconds * budget.MARGIN
    plugin, session = finished_part(monkeypatch, budget.REFERENCE_UNIT, [allowed * 0.6, allowed * 0.6])
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert "outgrew its time budget by" in plugin.verdict and "tests/budget.py" in plugin.verdict


def test_a_slower_machine_gets_a_proportionally_larger_allowance(monkeypatch):
    allowed = budget.BUDGETS["serial"].test_seconds * budget.MARGIN
    durations = [allowed * 0.6, allowed * 0.6]  # over the budget at the reference speed
    _, session = finished_part(monkeypatch, budget.REFERENCE_UNIT * 2.5, durations)  # a machine 2.5 times slower
    assert session.exitstatus == pytest.ExitCode.OK


def test_an_unknown_part_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(budget, "measure_unit", lambda copies: 1.0)
    with pytest.raises(pytest.UsageError, match="the parts with a budget are parallel, serial, fast"):
        budget.SuiteBudget("everything", workers=1)


@pytest.mark.subprocess
def test_the_unit_is_a_fresh_interpreters_time():
    assert 0 < budget.measure_unit(copies=2, rounds=1) < 600
