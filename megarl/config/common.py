"""Helpers every config section uses: range checks as `ConfigError`, choices, shared messages."""
from __future__ import annotations

from megarl.common.errors import ConfigError
from megarl.common.fields import check_bounds

_COLD = ("temperature 0 samples every completion of a group alike: the advantages are all 0 and "
         "nothing is learned")


def _check(section, prefix: str) -> None:
    """The declared ranges of a section's numeric fields (megarl.common.fields), as ConfigError."""
    try:
        check_bounds(section, prefix)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(map(str, allowed))}; got {value!r}")
