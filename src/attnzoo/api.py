"""Python API for researchers who prefer code to the CLI.

    import attnzoo, torch
    cfg = attnzoo.load_config(["model=hybrid_gdn", "model.n_layers=4"])   # the CLI's overrides
    model = attnzoo.build_model(cfg.model, vocab_size=256)              # or build_model("gpt2", vocab_size=256)
    logits = model(torch.randint(0, 256, (2, 64)))                      # (2, 64, 256)
    print(model.cache_bytes(4096), model.flops_per_token(4096))
"""
from __future__ import annotations

from typing import Any, Sequence

from omegaconf import DictConfig


def load_config(overrides: Sequence[str] = (), config_name: str = "train") -> DictConfig:
    """Compose conf/train.yaml with command-line style overrides, outside a Hydra run. The run directory is
    `outputs/api/<date>_<time>` (as the CLI's `outputs/<task>/<date>_<time>`) unless `paths.output_dir=` is
    given, so `attnzoo.training.run.train(cfg)` never writes checkpoints into the current directory itself."""
    import time

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from attnzoo.config.errors import ConfigError
    from attnzoo.config.overrides import check_group_overrides
    from attnzoo.config.paths import CONF_DIR

    bad = check_group_overrides(list(overrides))  # `model/mixer=nope`: one line, not Hydra's MissingConfigException
    if bad is not None:
        raise ConfigError(bad)
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    overrides = list(overrides)
    if not any(o.startswith("paths.output_dir=") for o in overrides):
        overrides.append(f"paths.output_dir=outputs/api/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def load(path, **kwargs):
    """A trained run: `attnzoo.load(run_dir_or_ckpt)` -> LoadedRun(model, lit, config, datamodule, ...);
    see attnzoo.inference.generate (best=True for best.ckpt, device=...)."""
    from attnzoo.inference.generate import load as _load

    return _load(path, **kwargs)


def build_model(cfg: Any = "default", vocab_size: int | None = None, overrides: Sequence[str] = ()):
    """A `DecoderLM` from a model config (DictConfig / dict / ModelConfig) or a preset name in conf/model/."""
    from attnzoo.models.decoder import DecoderLM

    if isinstance(cfg, str):
        cfg = load_config([f"model={cfg}", *overrides]).model
    return DecoderLM(cfg, vocab_size=vocab_size)
