"""Name -> (class, config dataclass) registries for mixers, FFNs and data modules.

A class registers itself with `@register_mixer("name", ConfigClass)` (`register_ffn`, `register_data`) in its own
module; the registry finds those modules by name (every module of the package: plugin discovery, so this base layer
never imports the layers above it; `lint-imports` checks that).

Config checks need the config dataclasses, not the classes: the built-in entries are also *declared* in a torch-free
module (`specs`: `declare(name, ConfigClass, "module.of.the.class")`), so that `attnzoo-train` refuses a bad value
before it imports torch or Lightning (issue 45). `Entry.cls` imports the class's module on first use. A module of
the package that the specs neither declare nor list as a helper (a mixer file dropped into `mixers/`) is imported
before the names are listed, so a plugin needs no declaration: it only costs that import.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import Any, Callable, Optional


class Entry:
    """A registered name: its config dataclass, and its class (imported from `module` when first asked for)."""

    def __init__(self, name: str, config_cls: type, module: Optional[str] = None, cls: Optional[type] = None):
        self.name, self.config_cls, self.module, self._cls = name, config_cls, module, cls

    @property
    def cls(self) -> type:
        if self._cls is None:
            importlib.import_module(self.module)  # its @register_* binds the class
            if self._cls is None:
                raise RuntimeError(f"{self.module} was declared to register '{self.name}' and did not")
        return self._cls

    def fact(self, key: str, default: Any = None) -> Any:
        """What config checks ask of the class (`context_parallel`, `kv_quantizable`, ...): declared on the config
        dataclass (torch-free), else the class's own (a plugin's)."""
        if hasattr(self.config_cls, key):
            return getattr(self.config_cls, key)
        return getattr(self.cls, key, default)


class Registry:
    def __init__(self, kind: str, modules: Callable[[], list[str]], specs: Optional[str] = None, facts: tuple = ()):
        """`modules()`: the modules whose import registers every class; `specs`: the torch-free module that declares
        the built-in entries and names the helper modules (`helpers(...)`) that register nothing; `facts`: class
        attributes a config dataclass states for its class (copied onto the class when it registers)."""
        self.kind, self.facts = kind, facts
        self._entries: dict[str, Entry] = {}
        self._modules, self._specs = modules, specs
        self._helpers: set[str] = set()
        self._loaded = self._specs_loaded = False

    # ---------------------------------------------------------------------------------------- declaring
    def declare(self, name: str, config_cls: type, module: str) -> None:
        """A built-in entry, from the specs module: the class is `module`'s `@register(name, config_cls)`."""
        self._entries.setdefault(name, Entry(name, config_cls, module))

    def helpers(self, *modules: str) -> None:
        """Modules of the package that register nothing (their import is not needed to list the names)."""
        self._helpers.update(modules)

    def register(self, name: str, config_cls: type) -> Callable[[type], type]:
        def deco(cls: type) -> type:
            for key in self.facts:  # stated once, on the config dataclass (torch-free)
                if hasattr(config_cls, key):
                    setattr(cls, key, getattr(config_cls, key))
            entry = self._entries.get(name)
            if entry is None:  # a plugin: registered by its own import
                self._entries[name] = Entry(name, config_cls, cls.__module__, cls)
            elif entry._cls is not None and entry._cls is not cls:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            elif entry.config_cls is not config_cls:
                raise ValueError(f"{self.kind} '{name}' is declared with {entry.config_cls.__qualname__} and registered "
                                 f"with {config_cls.__qualname__}")
            else:
                entry._cls = cls
            return cls

        return deco

    # ---------------------------------------------------------------------------------------- looking up
    def _ensure_specs(self) -> None:
        if self._specs_loaded:
            return
        self._specs_loaded = True
        if self._specs is None or self.undeclared_modules():  # a module the specs do not know may register
            self._ensure()

    def undeclared_modules(self) -> list[str]:
        """The modules the specs neither declare a class in nor list as helpers (a plugin's; none when the specs are
        complete, so that listing the names imports no class)."""
        if self._specs is None:
            return []
        importlib.import_module(self._specs)
        known = self._helpers | {e.module for e in self._entries.values()} | {self._specs}
        return [m for m in self._modules() if m not in known]

    def _ensure(self) -> None:
        if not self._loaded:
            self._loaded = True
            for name in self._modules():
                importlib.import_module(name)

    def load_all(self) -> None:
        """Import every class (the model builders, tests that walk the whole registry)."""
        self._ensure_specs()
        self._ensure()

    def names(self) -> list[str]:
        self._ensure_specs()
        return sorted(self._entries)

    def get(self, name: Any) -> Entry:
        self._ensure_specs()
        if name not in self._entries:
            from attnzoo.config.errors import ConfigError

            raise ConfigError(f"unknown {self.kind} '{name}'; allowed: {', '.join(self.names())}", field=f"{self.kind}.name")
        return self._entries[name]


def package_modules(package: str, skip: Callable[[str], bool] = lambda name: False) -> Callable[[], list[str]]:
    """A registry's `modules`: every module of `package` (found by name, the package itself not imported)."""

    def modules() -> list[str]:
        spec = importlib.util.find_spec(package)
        return [f"{package}.{info.name}" for info in pkgutil.iter_modules(spec.submodule_search_locations)
                if not skip(info.name)]

    return modules


MIXERS = Registry("mixer", package_modules("attnzoo.mixers"), specs="attnzoo.mixers.configs",
                  facts=("context_parallel", "full_causal_attention", "kv_quantizable", "bidirectional", "fla_kernel"))
FFNS = Registry("ffn", lambda: ["attnzoo.layers.ffn", "attnzoo.layers.moe"], specs="attnzoo.layers.ffn_configs")
register_mixer = MIXERS.register
register_ffn = FFNS.register
