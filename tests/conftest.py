"""Shared pytest configuration for the test suite (fixtures live next to the tests that use them)."""

from __future__ import annotations


def pytest_configure(config):
    # Hypothesis, when it reports a failing example, imports a module that touches the deprecated
    # `mypy_extensions.TypedDict`; with filterwarnings=error that warning would hide the real
    # failure behind an INTERNALERROR. Narrowly allowed here (not a torch or fpipe warning).
    config.addinivalue_line(
        "filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
    )
