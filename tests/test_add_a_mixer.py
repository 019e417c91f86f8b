"""Adding a mixer is one file in the mixers package and one yaml in conf/model/mixer/, nothing else.

A toy mixer (the running mean of a value projection: causal, a fixed-size state) is written into a folder that
joins the `attnzoo.mixers` package's path, where the package's own discovery (mixers/__init__.py imports every
module of its path) imports it, as it would a file dropped into src/attnzoo/mixers/; its yaml goes into a copy of
conf/. Then `model/mixer=toy` composes, validates, trains two steps, and the built model runs forward, backward
and a cached decode equal to the full forward, with its cache bytes as measured. Every other part of the package
asks the class what it needs (tests/test_mixer_knowledge.py), so none was edited.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
import shutil
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import attnzoo.mixers
from attnzoo.config.errors import ConfigError
from attnzoo.config.paths import CONF_DIR
from attnzoo.config.registry import MIXERS
from attnzoo.config.schema import resolve_model
from attnzoo.models.decoder import DecoderLM
from tests.conftest import SESSION_CACHE

TOY = '''"""A toy token mixer: y_t = W_o mean(W_v x_1 .. W_v x_t), the running mean of a value projection."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.layers.kv_cache import LayerCache
from attnzoo.mixers.base import Mixer, dtype_bytes


class RunningSumCache(LayerCache):
    """total (B, d_model): the sum of the values so far; seen: how many."""

    def __init__(self, total: torch.Tensor) -> None:
        self.total, self.seen = total, 0

    @property
    def seq_len(self) -> int:
        return self.seen


@dataclass
class ToyConfig:
    name: str = "toy"


@register_mixer("toy", ToyConfig)
class RunningMean(Mixer):
    def __init__(self, cfg: ToyConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.v_proj = nn.Linear(self.d_model, self.d_model, bias=False)
        self.o_proj = nn.Linear(self.d_model, self.d_model, bias=False)

    def forward(self, x, *, positions, cache=None):
        v = self.v_proj(x).cumsum(1)  # (B, T, d)
        start = 0 if cache is None else cache.seen
        if cache is not None:
            v = v + cache.total[:, None].to(v.dtype)
            cache.total, cache.seen = v[:, -1].to(cache.total.dtype), start + x.shape[1]
        count = torch.arange(start + 1, start + x.shape[1] + 1, device=x.device, dtype=v.dtype)
        return self.o_proj(v / count[:, None])

    def new_cache(self, batch, max_len, dtype, device):
        return RunningSumCache(torch.zeros(batch, self.d_model, dtype=dtype, device=device))

    def cache_bytes(self, context_len, batch=1, dtype=torch.float32):
        return batch * self.d_model * dtype_bytes(dtype)

    def flops_per_token(self, context_len):
        return 2.0 * (self.v_proj.weight.numel() + self.o_proj.weight.numel())
'''
YAML = "# A toy mixer: the running mean of a value projection (tests/test_add_a_mixer.py).\nname: toy\n"


@pytest.fixture
def toy_conf(tmp_path):
    """A folder on the mixers package's path holding toy.py (imported by the package's discovery, as a file in
    src/attnzoo/mixers/ is), and a copy of conf/ with model/mixer/toy.yaml; both undone afterwards."""
    folder = tmp_path / "mixers"
    folder.mkdir()
    (folder / "toy.py").write_text(TOY)
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "mixer" / "toy.yaml").write_text(YAML)
    attnzoo.mixers.__path__.append(str(folder))
    try:
        for info in pkgutil.iter_modules(attnzoo.mixers.__path__):  # mixers/__init__.py's discovery loop
            if info.name != "base":
                importlib.import_module(f"attnzoo.mixers.{info.name}")
        assert "toy" in MIXERS.names()
        yield conf
    finally:
        attnzoo.mixers.__path__.remove(str(folder))
        MIXERS._entries.pop("toy", None)  # the registry outlives the test: leave it as it was
        sys.modules.pop("attnzoo.mixers.toy", None)
        if hasattr(attnzoo.mixers, "toy"):
            delattr(attnzoo.mixers, "toy")


def _compose(conf, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="train", overrides=overrides + [f"paths.cache_dir={SESSION_CACHE}"])


def test_a_new_mixer_is_one_file_and_one_yaml(toy_conf, tmp_path):
    from attnzoo.training.config_checks import validate
    from attnzoo.training.run import train

    cfg = _compose(toy_conf, ["debug=smoke", "data.max_chars=300000", "data.tokenizer=char", "model/mixer=toy",
                              "trainer.max_steps=2", f"paths.output_dir={tmp_path / 'run'}"])
    assert cfg.model.mixer.name == "toy"
    validate(cfg)  # the run's checks ask the class (context parallel, KV formats, sequence length, kernels)
    metrics = train(cfg)
    assert math.isfinite(float(metrics["train/loss"]))

    # the model by itself: forward + backward, cached decode == full forward, measured cache bytes == analytic
    model = DecoderLM(resolve_model(cfg.model), vocab_size=32).double()
    idx = torch.randint(0, 32, (2, 12))
    logits = model(idx)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        cache = model.new_cache(2, 12, torch.float64)
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), logits, atol=1e-10, rtol=0)
        assert cache.nbytes() == model.cache_bytes(12, batch=2, dtype=torch.float64)

    # what the rest of the package asks, answered by Mixer's defaults
    toy = model.mixers[0]
    assert toy.dispatch_family() == "other" and not toy.kv_quantizable and not toy.context_parallel
    from attnzoo.interop.hf import arch_for

    with pytest.raises(ConfigError, match="toy: this mixer has no transformers causal-LM counterpart"):
        arch_for(model)
