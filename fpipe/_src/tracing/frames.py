"""Where in the user's code an error happened: the last frame outside torch and fpipe."""

from __future__ import annotations

import linecache
import os
import traceback

import torch

__all__ = ["user_line"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FPIPE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def user_line(frames: list[traceback.FrameSummary]) -> str:
    """`file:line (`code`)` of the last of `frames` in the user's code, for an error message."""
    user = [
        f
        for f in frames
        if not f.filename.startswith((_TORCH_DIR, _FPIPE_DIR))
        and "/torch/" not in f.filename
        and "/functorch/" not in f.filename
    ]
    if not user:
        return "an unknown line"
    f = user[-1]
    code = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f"{f.filename}:{f.lineno} (`{code}`)"
