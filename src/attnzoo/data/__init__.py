"""Data: tokenizers, the embedded text corpus and (later) synthetic tasks, each a LightningDataModule.

A data module registers `@register_data("name", ConfigDataclass)`; its config dataclass must have
`name`, `seq_len` and `batch_size`. `build_datamodule(cfg, cache_dir)` constructs it.

The registry imports every module of this package except helpers named `_*` (e.g. `_shards_loader`, which imports
litdata): those are imported by the data module that uses them, when it reads its data, so a `data=text` run never
imports litdata.
"""
from attnzoo.config.registry import Registry, package_modules

# every module but the helpers named `_*` (imported where they are used, see above); the config dataclasses of the
# built-in ones are declared in `configs.py` (torch-free: config checks never import torch or Lightning)
DATAMODULES = Registry("data", package_modules(__name__, skip=lambda name: name.startswith("_")),
                       specs="attnzoo.data.configs")
register_data = DATAMODULES.register


def build_datamodule(cfg, cache_dir: str, seed: int = 0):
    return DATAMODULES.get(cfg.name).cls(cfg, cache_dir=cache_dir, seed=seed)
