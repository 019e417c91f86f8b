"""Data: tokenizers, the embedded text corpus and (later) synthetic tasks, each a LightningDataModule.

A data module registers `@register_data("name", ConfigDataclass)`; its config dataclass must have
`name`, `seq_len` and `batch_size`. `build_datamodule(cfg, cache_dir)` constructs it.

The registry imports every module of this package except helpers named `_*` (e.g. `_shards_loader`, which imports
litdata): those are imported by the data module that uses them, when it reads its data, so a `data=text` run never
imports litdata.
"""
import importlib
import pkgutil

from attnzoo.config.registry import Registry


def _load() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):  # a helper imported where it is used (see above)
            continue
        importlib.import_module(f"{__name__}.{info.name}")


DATAMODULES = Registry("data", _load)
register_data = DATAMODULES.register


def build_datamodule(cfg, cache_dir: str, seed: int = 0):
    return DATAMODULES.get(cfg.name).cls(cfg, cache_dir=cache_dir, seed=seed)
