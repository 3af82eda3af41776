"""On/off switches read from the environment (`CBCORE_PACKED_LINEAR`, `CBCORE_SELF_CHECK`): one parser, so every
switch takes the same spellings and refuses the same typos."""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on", "")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool = True) -> bool:
    """The switch `name`: 1/true/yes/on (or empty) turn it on, 0/false/no/off turn it off, unset gives `default`;
    anything else raises ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    value = value.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={value!r}: expected 1 or 0")
