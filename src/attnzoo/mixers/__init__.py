"""Token mixers. Importing this package imports every module in it, so each `@register_mixer` runs.

A new mixer = one file here + one yaml in conf/model/mixer/; the shared tests pick it up from the registry.
"""
import importlib
import pkgutil

from attnzoo.mixers.base import Mixer  # noqa: F401

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")
