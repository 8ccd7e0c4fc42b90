"""Schedules as data: build, print, parse and register pipeline schedules."""

from ._src.schedule import Action as Action
from ._src.schedule import Schedule as Schedule
from ._src.schedule import build as build
from ._src.schedule import names as names
from ._src.schedule import parse as parse
from ._src.schedule import register as register
