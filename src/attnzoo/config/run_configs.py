"""The run's smaller sections (config/schema.TrainConfig holds them): the end-of-run sample, the performance
measurements and profile, extra evaluations, the inference KV-cache format, and the paths. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from attnzoo.config.errors import ConfigError


@dataclass
class SampleConfig:
    prompt: str = "def "
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: Optional[int] = 40
    top_p: Optional[float] = None


@dataclass
class PerfConfig:
    peak_flops: Optional[float] = None  # override the measured / table peak (FLOP/s, dense)
    measure_decode: bool = True  # end-of-run prefill + decode measurement (cache/bytes_at_ctx, decode tok/s)
    decode_tokens: int = 32
    # the measured decode step compiled (attnzoo.models.decoding): auto = on CUDA only | true | false
    decode_compile: Any = "auto"
    # a torch.profiler trace of optimizer steps [profile_wait, profile_wait + profile_steps) in <run>/profile/
    # (training/profiling.py): trace.json, top_ops.txt, on CUDA memory_snapshot.pickle; the top ops in the summary
    profile: bool = False
    profile_wait: int = 5
    profile_steps: int = 3

    def __post_init__(self) -> None:
        if self.decode_compile not in ("auto", True, False):
            raise ConfigError(f"got {self.decode_compile!r}; allowed: auto, true, false", field="perf.decode_compile")


@dataclass
class EvalConfig:
    context_lengths: List[int] = field(default_factory=list)  # extra evaluation lengths (attnzoo.analysis.extrapolation)
    max_batches: int = 8  # batches per length
    # the needle-in-a-haystack grid at data.seq_len and each context length at the end of the run (niah.json,
    # niah.png; analysis/niah.py). data=needle: the depths of the task it trained on (niah/acc@<length>@<depth>);
    # data=text: RULER's tasks named in niah_tasks (data/needles.py) at these depths ([]: 0, 0.5, 1), completed
    # greedily (niah/<task>@<length>@<depth>); []: none
    niah_depths: List[float] = field(default_factory=list)
    niah_tasks: List[str] = field(default_factory=list)
    niah_samples: Optional[int] = None  # examples per (length, depth) (null: 256 on data=needle, 4 prompts on text)


@dataclass
class InferenceConfig:
    """The KV-cache format at inference (attnzoo.mixers.kv_quant; docs/attention.md#kv-cache-quantization)."""

    kv_cache_dtype: str = "fp32"  # fp32 (as computed) | bf16 | int8 | int4 (KIVI; mha/gqa/mqa layers)
    kv_group_size: int = 32  # G: tokens per key scale (per channel), channels per value scale (per token)
    kv_residual: int = 32  # R: the most recent R tokens (up to R + G - 1) stay in full precision


@dataclass
class PathsConfig:
    output_dir: str = "outputs"
    cache_dir: str = "~/.cache/attnzoo"
