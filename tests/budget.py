"""The suite's time budget, checked on whatever machine runs it: `pytest --budget PART` (the Makefile passes it).

A budget is the tests' time (set-up, call and tear-down, summed over every test: independent of how many workers
share it) in units of this machine's speed: one unit is how long a fresh interpreter takes to import torch and run
a fixed single-threaded workload, the two things the suite does most (it starts notebook kernels, torchrun workers
and interpreters, and runs small models). Measured at the start of the part, so a slower or busier machine gets a
proportionally larger allowance; the part fails when its tests outgrow the budget by more than MARGIN, so growth
shows in the submission that causes it. The end of the run prints the part's wall time and its tests' time.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

UNIT_SCRIPT = ("import torch\ntorch.set_num_threads(1)\ntorch.manual_seed(0)\na = torch.randn(256, 256)\n"
               "for _ in range(200):\n    a = torch.tanh(a @ a)\n")


@dataclass(frozen=True)
class Budget:
    test_seconds: float  # the tests' time on the reference machine
    wall_target: str  # what that time means there, for the message


# Measured on the reference machine: a 2-core Intel Xeon with AVX-512 and AMX (native bf16), torch 2.13.0+cpu,
# where one unit took REFERENCE_UNIT seconds (two copies at once). The parts' test times there, with a little room.
REFERENCE_UNIT = 1.25
BUDGETS = {
    # 800 until notebooks 6.8 (a server, its static twin and transformers serve, whose start alone takes ~27 s) and 9.2
    # (a learning-rate sweep and the T4 plan) added ~100 s of smoke runs; the suite still lands within 12 minutes
    "parallel": Budget(960, "the parallel part within 9 minutes on 2 cores"),
    "serial": Budget(90, "the serial part within 2 minutes"),
    "fast": Budget(150, "make test-fast within 2 minutes on 2 cores"),
}
MARGIN = 1.3


def measure_unit(copies: int = 1, rounds: int = 2) -> float:
    """The median wall time of UNIT_SCRIPT in a fresh interpreter, in seconds, with `copies` of it running at once (as
    many as the part has workers): a machine shared with other programs, or with fewer cores than workers, gives each
    copy what it gives each worker."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", UNIT_SCRIPT]) for _ in range(copies)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"the budget's unit script failed (exit code {proc.returncode})")
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class SuiteBudget:
    """A pytest plugin for the controlling process: sums the tests' durations (reports from xdist workers arrive
    here too) and compares them with the part's budget at the end."""

    def __init__(self, part: str, workers: int):
        if part not in BUDGETS:
            raise pytest.UsageError(f"--budget {part}: the parts with a budget are {', '.join(BUDGETS)}")
        self.part, self.budget = part, BUDGETS[part]
        self.started = time.perf_counter()
        self.unit = measure_unit(workers)
        self.test_seconds, self.tests = 0.0, set()
        self.verdict = ""

    def pytest_runtest_logreport(self, report):
        self.test_seconds += report.duration
        self.tests.add(report.nodeid)

    @property
    def allowed(self) -> float:
        return self.budget.test_seconds / REFERENCE_UNIT * self.unit * MARGIN

    def pytest_sessionfinish(self, session, exitstatus):
        wall = time.perf_counter() - self.started
        units = self.test_seconds / self.unit
        budget_units = self.budget.test_seconds / REFERENCE_UNIT
        self.verdict = (f"{self.part} part: {wall:.0f} s wall; {len(self.tests)} tests took {self.test_seconds:.0f} s "
                        f"= {units:.0f} units of {self.unit:.2f} s (this machine's start-up and compute unit); "
                        f"budget {budget_units:.0f} units ({self.budget.wall_target}), "
                        f"fails above {budget_units * MARGIN:.0f}")
        if self.test_seconds > self.allowed and session.exitstatus == pytest.ExitCode.OK:
            self.verdict += (f"\nFAILED: the {self.part} part outgrew its time budget by "
                             f"{units / budget_units - 1:.0%}: make the new tests cheaper (smaller sizes, a shared "
                             "fixture, the slow marker for a cross-product) or raise the budget in tests/budget.py "
                             "and say why")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(self.verdict)
