"""The one-line configuration error and its two checks; no imports from the package, so every layer
(config, registries, mixers, data, training) can raise it without an import cycle."""
from __future__ import annotations

from typing import Any, List


class ConfigError(ValueError):
    """A bad configuration value. `str(err)` is one line: `field: what is wrong; allowed: ...`."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        text = f"{field}: {message}" if field and not message.startswith(field) else message
        super().__init__(" ".join(text.split()))


def check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(message, field=field)


def check_choice(value: Any, field: str, allowed: List[str] | tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"got {value!r}; allowed: {', '.join(map(str, allowed))}", field=field)
