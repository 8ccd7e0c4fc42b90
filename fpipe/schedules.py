"""Schedules as data: build, print, parse, register, validate, simulate and draw pipeline schedules.

A schedule is a value: per rank, the ordered actions (`F` forward, `B` full backward, `I`
input-gradient backward, `W` weight-gradient backward) over (stage, microbatch), plus which rank
holds each stage. See docs/SCHEDULES.md.

Importing `render` here also installs it as what `Schedule.render` calls; fpipe/__init__.py
imports this module, so that holds in every process that imports fpipe (NOTE [schedule layering]
in fpipe/_src/schedules/schedule_data.py).
"""

from ._src.schedules.render import render as render
from ._src.schedules.render import to_svg as to_svg
from ._src.schedules.schedule import build as build
from ._src.schedules.schedule import names as names
from ._src.schedules.schedule import register as register
from ._src.schedules.schedule_data import Action as Action
from ._src.schedules.schedule_data import Schedule as Schedule
from ._src.schedules.schedule_data import parse as parse
from ._src.schedules.simulate import Simulation as Simulation
from ._src.schedules.simulate import dependencies as dependencies
from ._src.schedules.simulate import simulate as simulate
from ._src.schedules.simulate import validate as validate
