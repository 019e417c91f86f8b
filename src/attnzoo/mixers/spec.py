"""What the config checks ask of a mixer (`MixerSpec`), and the conv check every mixer config shares: torch-free
(mixers/configs.py).
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from attnzoo.config.errors import ConfigError


class MixerSpec:
    """What the config checks ask of a mixer (defaults; a config dataclass overrides them as class attributes).

    - `context_parallel`: a path for a sequence split over ranks (trainer.context_parallel; Mixer's docstring);
    - `full_causal_attention`: causal softmax over the whole past (the context-parallel `auto` layout is zigzag);
    - `kv_quantizable`: a plain KV cache, so the inference KV formats apply (mixers/kv_quant.py);
    - `bidirectional`: runs with causal=false over a key padding mask (the encoder-decoder's attention kinds);
    - `fla_kernel`: the fla function its fast path calls (ops/dispatch.py FLA_KERNELS), if any;
    - `check_seq_len(seq_len, field)`: refuse a training length (data.seq_len) it cannot take.
    """

    context_parallel: ClassVar[bool] = False
    full_causal_attention: ClassVar[bool] = False
    kv_quantizable: ClassVar[bool] = False
    bidirectional: ClassVar[bool] = False
    fla_kernel: ClassVar[Optional[str]] = None

    def check_seq_len(self, seq_len: int, field: str) -> None:
        """One-line ConfigError naming `field`.<key> when this mixer cannot train on `seq_len` tokens. Default: any."""


def validate_conv(cfg: Any, field: str) -> None:
    """A mixer config's `conv_size` (short causal conv, on the input or on q/k/v): >= 0, causal mixers only."""
    if cfg.conv_size < 0:
        raise ConfigError(f"must be >= 0 (0 = no conv), got {cfg.conv_size}", field=f"{field}.conv_size")
    if cfg.conv_size > 0 and not getattr(cfg, "causal", True):
        raise ConfigError("the conv is causal; allowed with causal=false: 0", field=f"{field}.conv_size")
