"""Schedules as plain data: who runs which action when, and what it costs, with nothing run.

The bottom layer with `tracing` (neither imports the other; they import nothing of fpipe):
`schedule_data` (`Action`, `Schedule`, the text form), the built-in builders (`schedule_builders`,
`schedule_v`) registered by name in `schedule`, `simulate` (validation, makespan, bubble), `comm`
(the communication plan each rank issues, and the NCCL in-order deadlock check) and `render`
(ASCII/SVG timelines, installed as what `Schedule.render` calls: NOTE [schedule layering];
importing the package installs it). The modules `render` and `simulate` are offered as modules:
a face never binds a module's name to something else.
The public face is `fpipe.schedules`; what the packages above use is below.
"""

from . import render, simulate
from .comm import CommGroup, CommPlan, Transfer, comm_plan
from .render import to_svg
from .schedule import build, names, register, stages_per_rank
from .schedule_data import Action, Schedule, execution_order, parse
from .simulate import Simulation, validate, validate_comm

__all__ = [
    "Action", "CommGroup", "CommPlan", "Schedule", "Simulation", "Transfer", "build", "comm_plan",
    "execution_order", "names", "parse", "register", "render", "simulate", "stages_per_rank", "to_svg",
    "validate", "validate_comm",
]  # fmt: skip
