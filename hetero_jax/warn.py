"""Warnings that point at the user's line.

`warn(message)`: `warnings.warn` with the stack level of the first frame outside this package,
so a warning raised deep in the engine (a constructor called by `Engine.from_preset`, called
by the user) is reported at the user's call, not at `serving/engine.py`; from a script inside
the package (the CLI), at its outermost frame. Plain Python: imports no jax.
"""
from __future__ import annotations

import os
import sys
import warnings

PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    frame, level = sys._getframe(1), 2  # level 2: warn's caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
