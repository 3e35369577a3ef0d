"""Field checks shared by the config sections' ``__post_init__``; each raises ``ConfigError``."""

from __future__ import annotations

from collections.abc import Sequence

from hfschema.layout import ConfigError

__all__ = ["check_choice", "check_non_negative", "check_positive"]


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """``key``'s ``value`` must be one of ``choices``."""
    if value not in choices:
        raise ConfigError(
            "{p}{key}={value!r} is not one of: {choices}",
            key=key,
            value=value,
            choices=", ".join(choices),
        )


def check_positive(section: object, keys: Sequence[str]) -> None:
    """Each of ``keys`` of ``section`` must be > 0 (or None)."""
    for key in keys:
        value = getattr(section, key)
        if value is not None and value <= 0:
            raise ConfigError("{p}{key}={value} must be > 0", key=key, value=value)


def check_non_negative(section: object, keys: Sequence[str]) -> None:
    """Each of ``keys`` of ``section`` must be >= 0."""
    for key in keys:
        value = getattr(section, key)
        if value < 0:
            raise ConfigError("{p}{key}={value} must be >= 0", key=key, value=value)
