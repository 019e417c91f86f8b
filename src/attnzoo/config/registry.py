"""Name -> (class, config dataclass) registries for mixers and FFNs.

A new mixer is one file in `mixers/` that decorates its class with `@register_mixer("name", ConfigClass)`;
`mixers/__init__.py` imports every module of the package, so nothing else needs editing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type
    config_cls: type


class Registry:
    def __init__(self, kind: str, loader: Callable[[], None]):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._loader = loader
        self._loaded = False

    def register(self, name: str, config_cls: type) -> Callable[[type], type]:
        def deco(cls: type) -> type:
            if name in self._entries and self._entries[name].cls is not cls:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._entries[name] = Entry(name, cls, config_cls)
            return cls

        return deco

    def _ensure(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._loader()

    def names(self) -> list[str]:
        self._ensure()
        return sorted(self._entries)

    def get(self, name: Any) -> Entry:
        self._ensure()
        if name not in self._entries:
            from attnzoo.config.errors import ConfigError

            raise ConfigError(f"unknown {self.kind} '{name}'; allowed: {', '.join(self.names())}", field=f"{self.kind}.name")
        return self._entries[name]


def _importer(*modules: str) -> Callable[[], None]:
    """A registry's loader: import the modules whose import registers the entries (plugin discovery by
    name, so this base layer never imports the layers above it; `lint-imports` checks that)."""
    import importlib

    def load() -> None:
        for name in modules:
            importlib.import_module(name)

    return load


MIXERS = Registry("mixer", _importer("attnzoo.mixers"))  # mixers/__init__.py imports every mixer module
FFNS = Registry("ffn", _importer("attnzoo.layers.ffn", "attnzoo.layers.moe"))
register_mixer = MIXERS.register
register_ffn = FFNS.register
