"""Policy simulator: replay acceptance processes under cost models through the engine's own step (``runner.py``),
on a simulated target, drafter and virtual clock (``pair.py``), driving the real policy objects."""

from specdec.simulate.costs import COSTS, CostModel, fit_costs, load_costs
from specdec.simulate.runner import RunResult, simulate
from specdec.simulate.workloads import WORKLOADS, Workload, get_workload

__all__ = [
    "COSTS",
    "WORKLOADS",
    "CostModel",
    "RunResult",
    "Workload",
    "fit_costs",
    "get_workload",
    "load_costs",
    "simulate",
]
