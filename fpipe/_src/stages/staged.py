"""Staged: a joint graph cut into per-stage programs, as data (what split.py makes, the runtime runs).

A `Place` is (kind, stage), kind "F" (forward), "B" (full backward), or "I"/"W" (the input- and
weight-gradient halves of a backward, split_iw.py). A `Program` is one place's graph; `Staged`
holds every program and which program produces and which programs read each value. This module
imports nothing from fpipe, so split.py, split_iw.py and the runtimes (run.py, run_dist.py,
agree.py) all build on it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Place", "Program", "Staged"]

Place = tuple[str, int]  # ("F" | "B", stage)
_ORDER = {"F": 0, "B": 1, "I": 2, "W": 3}


@dataclasses.dataclass
class Program:
    """One stage's piece of the joint graph: `gm(*inputs) -> outputs` (both lists of names).
    `compile`: None, or `torch.compile`'s keyword arguments: the runtime then runs `gm` (or a
    variant of it) compiled, each at its first run."""

    place: Place
    gm: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    compile: dict[str, Any] | None = None

    @property
    def n_nodes(self) -> int:
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function")


@dataclasses.dataclass
class Staged:
    """A joint graph cut into programs, with the bookkeeping the runtime needs."""

    n_stages: int
    programs: dict[Place, Program]
    param_inputs: list[str]  # placeholder names, in flat order
    data_inputs: list[str]
    const_inputs: list[str]
    ct_input: str
    out_names: list[str]  # joint outputs: values first, then gradients
    n_outs: int
    producer: dict[str, Place]  # which program computes each non-input value
    consumers: dict[str, list[Place]]  # which programs read each value
    meta: dict[str, tuple[torch.Size, torch.dtype]]
    # Values traced with a non-contiguous layout (a transpose): a rank that receives one lays it
    # out the same way, since the program may view it in a way only that layout allows.
    strides: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # A parameter's gradient computed on several stages: each further stage's contribution is an
    # output of its own, appended after the gradients (its index -> the gradient's index), summed
    # into the gradient (NOTE [tied gradients] in split_tied.py).
    partial_of: dict[int, int] = dataclasses.field(default_factory=dict)

    def parts_of(self, i: int) -> list[str]:
        """Output i's name and the names of the contributions added into it."""
        return [self.out_names[i], *(self.out_names[k] for k, j in self.partial_of.items() if j == i)]

    def place_inputs(self, place: Place) -> list[str]:
        return self.programs[place].inputs if place in self.programs else []

    def deps(self, place: Place) -> set[Place]:
        """The programs (same microbatch) whose outputs `place` reads."""
        return {self.producer[v] for v in self.place_inputs(place) if v in self.producer}

    def describe(self) -> str:
        lines = []
        for place in sorted(self.programs, key=lambda p: (_ORDER[p[0]], p[1])):
            prog = self.programs[place]
            lines.append(
                f"{place[0]}{place[1]}: {prog.n_nodes} ops, {len(prog.inputs)} inputs, {len(prog.outputs)} outputs"
            )
        return "\n".join(lines)
