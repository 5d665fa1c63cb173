"""How deep the property tests go: one hypothesis profile scales every test's example count.

A test asks for ``examples(N)``, where N is its count under the default profile (``dev``, the
counts the tests were written with); ``STORE_TEST_PROFILE=ci`` doubles each, ``deep`` makes it
ten times (``tools/soak_state_machine.py`` goes further still).  ``tests/conftest.py`` loads the
profile before any test module is imported.
"""

from __future__ import annotations

import os

from hypothesis import settings

VARIABLE = "STORE_TEST_PROFILE"
SCALE = {"dev": 100, "ci": 200, "deep": 1000}  # percent of each test's own count


def load() -> str:
    name = os.environ.get(VARIABLE, "dev")
    if name not in SCALE:
        raise ValueError(f"{VARIABLE}={name!r} is not a profile; known: {', '.join(SCALE)}")
    for profile, percent in SCALE.items():
        settings.register_profile(profile, max_examples=percent)  # a test without its own count
    settings.load_profile(name)
    return name


def examples(count: int) -> int:
    """``count`` examples under the default profile, scaled by the one loaded."""
    return max(1, count * settings.default.max_examples // SCALE["dev"])
