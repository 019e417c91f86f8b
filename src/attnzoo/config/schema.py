"""Structured-config schemas and cross-field validation.

Hydra composes plain yaml from `conf/`; `validate()` then merges every section into its dataclass schema
(`OmegaConf.structured`), which rejects unknown keys and wrong types, and runs the cross-field checks.
Mixer, FFN and data sections are polymorphic (tagged by `name`): their schema is the dataclass that the
named class registered. Every failure is a `ConfigError` whose message is one line naming the field and
what is allowed; `attnzoo-train` prints it and exits with status 2 before any work is done.
The top-level schemas are also stored in Hydra's ConfigStore (no group, so `--help` lists only real config
groups: `attnzoo_train_schema`, `attnzoo_model_schema`) for tooling.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


from attnzoo.config.errors import ConfigError, check, check_choice  # noqa: F401  (re-exported: attnzoo.config.schema.ConfigError)
from attnzoo.config.run_configs import (EvalConfig, InferenceConfig, PathsConfig, PerfConfig,  # noqa: F401 (re-exported)
                                        SampleConfig)


# ----------------------------------------------------------------------------- model parts


ROPE_SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")  # position.rope_frequencies
IMPLS = ("auto", "torch", "fla", "flex")  # model.impl: which kernels the mixers run (ops/dispatch.py, docs/gpu.md)


@dataclass
class PositionConfig:
    name: str = "rope"  # rope | alibi | sinusoidal | learned | none
    theta: float = 10000.0  # RoPE base
    rotary_fraction: float = 1.0  # partial rotary: fraction of each head's dims that rotate
    # RoPE context extension (position.rope_frequencies): none | linear | dynamic | yarn | llama3
    scaling: str = "none"
    factor: float = 1.0  # target length / original length
    original_max_len: Optional[int] = None  # the length trained at (null: model.max_seq_len)
    beta_fast: float = 32.0  # yarn: channels turning more often than this over the original length are kept
    beta_slow: float = 1.0  # yarn: channels turning less often than this are interpolated
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are interpolated
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept


@dataclass
class NormConfig:
    name: str = "rmsnorm"  # rmsnorm | layernorm
    eps: float = 1e-6


@dataclass
class ModelConfig:
    name: str = "decoder"
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2  # GQA groups; mha forces n_heads, mqa forces 1
    head_dim: Optional[int] = None  # default d_model // n_heads
    vocab_size: Optional[int] = None  # filled from the tokenizer / task
    max_seq_len: int = 2048  # learned positions table size; longest prompt+generation
    norm_position: str = "pre"  # pre (modern) | post (original Transformer)
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    # gpt2: every Linear/Embedding weight ~ N(0, init_std), residual output projections / sqrt(2 n_layers)
    # (Radford et al. 2019); pytorch: each module's own default (Linear: U(+-1/sqrt(fan_in)), Embedding:
    # N(0, 1)), as Zoology's and the reference MQAR models train
    init: str = "gpt2"
    mixer: Any = None  # {name: gqa, ...}: the default mixer of every layer
    ffn: Any = None  # {name: swiglu, ...}
    position: PositionConfig = field(default_factory=PositionConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    # Hybrids: a list (or comma string) of mixer names tiled over the layers, e.g. [gdn, gdn, gdn, attn].
    # A name is a key of `mixers` (a named mixer config) or a registered mixer name (its defaults, or
    # `mixer` itself when the names match).
    pattern: Any = None
    mixers: Dict[str, Any] = field(default_factory=dict)
    encdec: Any = None  # encoder-decoder / encoder-only options (attnzoo.models.encoder_decoder.EncDecOptions), model=encdec|encoder
    vision: Any = None  # the image encoder (attnzoo.models.vision.VisionOptions), model=vit|swin|vlm
    connector: Any = None  # how image tokens meet the text (attnzoo.models.vision.ConnectorConfig), model=vlm
    # a local transformers model directory (config.json + *.safetensors): the architecture comes from its
    # config.json and training starts from its weights (attnzoo.interop.hf.apply_init_from; docs/hf.md)
    init_from: Optional[str] = None
    # kernels (ops/dispatch.py, docs/gpu.md): auto = fla's Triton kernels for the linear family and flex_attention
    # for sliding windows on CUDA when installed (the `gpu` extra), torch elsewhere; torch | fla | flex to force
    impl: str = "auto"
    # standard | mup: the maximal update parametrization (Yang et al. 2022, Tensor Programs V, arXiv:2203.03466;
    # models/mup.py, docs/mup.md): hidden weights' init std and AdamW learning rate scaled by the width multiplier
    # m = d_model / mup_base_width, logits * 1/m, q.k scale 1/d for softmax attention, so tuned hyper-parameters
    # transfer across widths
    parametrization: str = "standard"
    mup_base_width: Optional[int] = None  # the d_model the hyper-parameters were tuned at (mup: required)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on hidden matrices + AdamW: training/optimizers.py, docs/optimizers.md)
    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.95  # muon only, as the next three: Nesterov momentum, then ns_steps Newton-Schulz iterations
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "auto"  # auto (bf16 on CUDA, else the parameters' precision) | bf16 | fp32 | fp64


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine | noam | constant | wsd
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the decay's floor (cosine, wsd), as a fraction of optim.lr
    # wsd (warmup-stable-decay, training/schedules.py): the final decay's length, in steps, or as a fraction of
    # trainer.max_steps when decay_steps is null; and its shape: linear | cosine | 1-sqrt
    decay_steps: Optional[int] = None
    decay_fraction: float = 0.2
    decay_shape: str = "1-sqrt"


@dataclass
class FSDPConfig:
    """trainer.strategy=fsdp (FSDP2, `fully_shard` per block and the root; attnzoo/training/fsdp.py)."""

    param_dtype: Optional[str] = None  # compute / all-gather dtype: null (the parameters' own) | bf16 | fp16 | fp32
    reduce_dtype: Optional[str] = "fp32"  # gradient reduce-scatter dtype: fp32 | bf16 | null (param_dtype)
    reshard_after_forward: bool = True  # free each block's gathered weights after its forward (ZeRO-3; false: ZeRO-2)
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state in host memory (GPU runs only)


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    strategy: Any = "auto"
    max_steps: Optional[int] = 1000  # null: the length is the budget's alone (max_tokens / max_flops)
    # budgets (attnzoo/config/stops.py): the run stops at whichever of max_steps / max_tokens / max_flops comes first
    max_tokens: Optional[float] = None  # training tokens, all ranks together (decoder LMs)
    max_flops: Optional[float] = None  # training FLOPs by the model's own count (3x forward per token; decoder LMs)
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = 1.0
    accumulate_grad_batches: int = 1
    val_check_interval: Any = 200
    check_val_every_n_epoch: Optional[int] = None
    limit_val_batches: Any = 1.0
    log_every_n_steps: int = 10
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    deterministic: bool = False
    benchmark: Optional[bool] = None
    # sequence parallelism (attnzoo/distributed/context_parallel.py): each sequence split over this many ranks (world = DP x CP)
    context_parallel: int = 1
    context_parallel_layout: str = "auto"  # auto | zigzag | contiguous (auto: zigzag when a layer is full causal attention)
    # memory (decoder LMs; docs/benchmarks.md#memory-activation-checkpointing-and-chunked-cross-entropy):
    activation_checkpointing: bool = False  # keep each block's input only; recompute the block in backward
    ce_chunk_tokens: int = 0  # >0: training loss from the hidden states this many tokens at a time (no full logits)
    # TF32 for fp32 matmuls on CUDA (torch.set_float32_matmul_precision("high")); trainer=gpu turns it on, CPU runs
    # ignore it (docs/gpu.md#gpu-defaults-tf32-fused-adamw-decode)
    tf32: bool = False
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # read when strategy=fsdp (docs/distributed.md)

    def lightning_kwargs(self) -> dict:
        """The fields Lightning's Trainer takes (context parallelism and the memory options are attnzoo's own)."""
        from dataclasses import asdict

        kw = asdict(self)
        for own in ("context_parallel", "context_parallel_layout", "activation_checkpointing", "ce_chunk_tokens",
                    "max_tokens", "max_flops", "fsdp", "tf32"):
            kw.pop(own)
        return kw


@dataclass
class TrainConfig:
    task_name: str = "train"
    seed: int = 1337
    ckpt_path: Optional[str] = None  # a .ckpt path, `last` (this run dir's checkpoints/last.ckpt) or `step:N`
    branch_from: Optional[str] = None  # a stable scheduler=wsd run's dir: start at its step checkpoint where this
    # run's decay starts (a cooldown; training/recipe_checks.run_checkpoint)
    compile: bool = False
    optimized_metric: str = "val/loss"  # what main() returns to a Hydra sweeper
    model_budget: Optional[Any] = None  # {params: N | match: {model keys}, count: non_embedding|total, tol: 0.02}
    on_nonfinite: str = "stop"  # NaN/inf training loss: stop (error naming the step) | skip (the step) | ignore
    model: ModelConfig = field(default_factory=ModelConfig)
    data: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    logger: Any = None
    callbacks: Any = None
    sample: SampleConfig = field(default_factory=SampleConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    linearize: Any = None  # experiment=linearize: attnzoo.training.linearize.LinearizeConfig (checked by validate)


def _store_schemas() -> None:
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError:  # pragma: no cover
        return
    cs = ConfigStore.instance()
    # stored without a group, so `attnzoo-train --help` lists only the real config groups
    cs.store(name="attnzoo_train_schema", node=TrainConfig)
    cs.store(name="attnzoo_model_schema", node=ModelConfig)


_store_schemas()


# ----------------------------------------------------------------------------- merging


@functools.lru_cache(maxsize=None)
def _structured(schema: type) -> DictConfig:
    """The schema's typed OmegaConf node, built once per dataclass (introspecting a dataclass costs ~5x a merge:
    a run's or a sweep grid's validation merges the same dozen schemas over and over)."""
    return OmegaConf.structured(schema)


def _merge(schema: type, node: Any, prefix: str) -> Any:
    """Merge a plain config node into a dataclass schema; return the typed dataclass instance."""
    if node is None:
        node = {}
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, dict):
        raise ConfigError(f"expected a mapping, got {type(node).__name__}", field=prefix)
    try:
        merged = OmegaConf.merge(_structured(schema), node)  # merge copies its first argument: the cache holds
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        where = (f"{prefix}.{key}" if prefix else key) if key else (prefix or "config")
        if "not in" in msg or "Key '" in msg:
            import difflib

            # the section the key is in (trainer.fsdp.nosuch: trainer.fsdp's keys, not the top level's)
            names = [f.name for f in _fields(_section_schema(schema, key.split(".")[:-1]))]
            close = difflib.get_close_matches(key.split(".")[-1], names, n=1)
            hint = f"did you mean {where.rsplit('.', 1)[0] + '.' if '.' in where else ''}{close[0]}? " if close else ""
            raise ConfigError(f"unknown key; {hint}allowed keys: {', '.join(names)}", field=where) from None
        raise ConfigError(msg, field=where) from None


def _section_schema(schema: type, path: list) -> type:
    """The dataclass of the section at `path` under `schema` (Optional[...], dict[str, ...] unwrapped); the deepest."""
    import dataclasses
    import typing

    for part in path:
        try:
            hint = typing.get_type_hints(schema).get(part)
        except (NameError, TypeError):
            return schema
        inner = [hint, *typing.get_args(hint), *(a for t in typing.get_args(hint) for a in typing.get_args(t))]
        found = next((t for t in inner if dataclasses.is_dataclass(t)), None)
        if found is None:
            return schema
        schema = found
    return schema


def _fields(schema: type):
    import dataclasses

    return dataclasses.fields(schema)


def tagged(registry, node: Any, prefix: str, default_name: str | None = None) -> Any:
    """Typed config for a polymorphic section tagged by `name` (mixer, ffn, data)."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if node is None:
        node = {}
    if isinstance(node, str):
        node = {"name": node}
    if not isinstance(node, dict):
        raise ConfigError(f"expected a mapping with a 'name', got {type(node).__name__}", field=prefix)
    name = node.get("name", default_name)
    if name not in registry.names():
        raise ConfigError(f"unknown {registry.kind} {name!r}; allowed: {', '.join(registry.names())}", field=f"{prefix}.name")
    entry = registry.get(name)
    node = {**node, "name": name}
    return _merge(entry.config_cls, node, prefix)


# ----------------------------------------------------------------------------- model


# a mixer's own sizes, null meaning "the model's": 0 or a negative value was taken for null by `cfg.x or default`
# (retnet n_heads 0), or reached a tensor constructor ("negative dimension"); refused for every mixer here
MIXER_SIZE_KEYS = ("n_heads", "n_kv_heads", "head_dim", "v_head_dim")


def _check_mixer_sizes(mc, field: str) -> None:
    for key in MIXER_SIZE_KEYS:
        value = getattr(mc, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"got {value!r}; allowed: an integer >= 1, or null (the model's)", field=f"{field}.{key}")
    # a mixer's own norm eps (its output / latent / group norms): 0 or less was taken as given (a 0-norm output
    # divides by 0), NaN made every output NaN; refused for every mixer with one here (was: rwkv7's <= 0 only)
    eps = getattr(mc, "norm_eps", None)
    if eps is not None and not (eps > 0 and math.isfinite(eps)):
        raise ConfigError(f"must be > 0, got {eps}; allowed: a small finite positive number, e.g. 1e-5",
                          field=f"{field}.norm_eps")


def resolve_model(node: Any, vocab_size: int | None = None) -> ModelConfig:
    """Validate a model section and return the typed `ModelConfig` (mixer/ffn typed too, `layers` resolved)."""
    from attnzoo.config.registry import FFNS, MIXERS

    if isinstance(node, ModelConfig):
        if vocab_size is not None:
            node.vocab_size = vocab_size
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    node = dict(node or {})
    raw_mixer, raw_ffn, raw_mixers = node.pop("mixer", None), node.pop("ffn", None), node.pop("mixers", None) or {}
    cfg: ModelConfig = _merge(ModelConfig, node, "model")
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    cfg.mixer = tagged(MIXERS, raw_mixer, "model.mixer", default_name="gqa")
    cfg.ffn = tagged(FFNS, raw_ffn, "model.ffn", default_name="swiglu")
    if not isinstance(raw_mixers, dict):
        raise ConfigError("expected a mapping of name -> mixer config", field="model.mixers")
    cfg.mixers = {k: tagged(MIXERS, v, f"model.mixers.{k}") for k, v in raw_mixers.items()}

    check(cfg.d_model > 0, "model.d_model", f"must be positive, got {cfg.d_model}")
    check(cfg.n_layers > 0, "model.n_layers", f"must be positive, got {cfg.n_layers}")
    check(cfg.n_heads > 0, "model.n_heads", f"must be positive, got {cfg.n_heads}")
    if cfg.head_dim is None:
        check(
            cfg.d_model % cfg.n_heads == 0,
            "model.d_model",
            f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}; allowed: a multiple of n_heads "
            f"(or set model.head_dim)",
        )
    if cfg.head_dim is not None:
        check(cfg.head_dim > 0, "model.head_dim", f"must be positive or null (d_model / n_heads), got {cfg.head_dim}")
    else:
        cfg.head_dim = cfg.d_model // cfg.n_heads  # resolved here, once: every part reads model.head_dim
    check(cfg.norm.eps > 0, "model.norm.eps", f"must be positive, got {cfg.norm.eps}")
    check(cfg.max_seq_len > 0, "model.max_seq_len", f"must be positive, got {cfg.max_seq_len}")
    check(cfg.n_kv_heads > 0, "model.n_kv_heads", f"must be positive, got {cfg.n_kv_heads}")
    # n_heads % n_kv_heads is checked by the parts that use model.n_kv_heads (gqa / sliding-window layers,
    # the encoder-decoder's gqa attention), so mha / mqa / recurrent models are not refused for a field they ignore
    check_choice(cfg.norm_position, "model.norm_position", ("pre", "post"))
    check_choice(cfg.init, "model.init", ("gpt2", "pytorch"))
    check_choice(cfg.impl, "model.impl", IMPLS)
    _check_parametrization(cfg)
    check_choice(cfg.position.name, "model.position.name", ("rope", "alibi", "sinusoidal", "learned", "none"))
    check(0.0 < cfg.position.rotary_fraction <= 1.0, "model.position.rotary_fraction", "must be in (0, 1]")
    check_choice(cfg.position.scaling, "model.position.scaling", ROPE_SCALINGS)
    _check_rope(cfg.position, cfg.head_dim)
    if cfg.position.scaling != "none":
        check(cfg.position.name == "rope", "model.position.scaling", f"applies to rope only; allowed with "
              f"position {cfg.position.name}: none")
    check_choice(cfg.norm.name, "model.norm.name", ("rmsnorm", "layernorm"))
    check(0.0 <= cfg.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {cfg.dropout}")
    if cfg.vocab_size is not None:
        check(cfg.vocab_size > 0, "model.vocab_size", "must be positive")
    check(cfg.init_std > 0 and math.isfinite(cfg.init_std), "model.init_std", f"must be > 0, got {cfg.init_std}; "
          f"allowed: a finite positive std (0.02: GPT-2's; under mup the std at mup_base_width)")
    mixers = layer_mixer_configs(cfg)
    for i, mc in enumerate(mixers):
        _check_mixer_sizes(mc, f"model.layers[{i}].mixer")
        if hasattr(mc, "validate"):
            mc.validate(cfg, field=f"model.layers[{i}].mixer")
    if hasattr(cfg.ffn, "validate"):
        cfg.ffn.validate(cfg, field="model.ffn")
    return cfg


def _check_parametrization(cfg: ModelConfig) -> None:
    """model.parametrization=mup (models/mup.py): the decoder LM trained from its own init, with a base width."""
    check_choice(cfg.parametrization, "model.parametrization", ("standard", "mup"))
    if cfg.parametrization == "standard":  # read by RWKV-7's default LoRA ranks (was: -32 a complex-number traceback)
        check(cfg.mup_base_width is None or cfg.mup_base_width > 0, "model.mup_base_width",
              f"got {cfg.mup_base_width}; allowed: null, or a positive width (the d_model RWKV-7's default LoRA ranks "
              f"and, with model.parametrization=mup, the hyper-parameters were sized at)")
        return
    check(cfg.mup_base_width is not None and cfg.mup_base_width > 0, "model.mup_base_width",
          f"got {cfg.mup_base_width}; allowed with model.parametrization=mup: the d_model the hyper-parameters "
          f"were tuned at, a positive width (e.g. {cfg.d_model} for this width itself)")
    check(cfg.name == "decoder", "model.parametrization", f"mup is implemented for the decoder LM; allowed with "
          f"model.name={cfg.name}: standard")
    check(cfg.init == "gpt2", "model.init", "mup scales the gpt2 init (init_std is the std at mup_base_width); "
          "allowed with model.parametrization=mup: gpt2")
    check(cfg.init_from is None, "model.init_from", "imported weights keep their own parametrization; allowed "
          "with model.parametrization=mup: null")


def _check_rope(pos: PositionConfig, head_dim: int) -> None:
    """RoPE's knobs within the ranges position.rope_frequencies is defined on (no division by zero, no
    frequency band ordered backwards, no head without a rotating channel); transformers' rope_config_validation
    asks the same of its factor >= 1."""
    check(pos.factor >= 1, "model.position.factor", f"must be >= 1 (target / original length; 1: no extension), "
          f"got {pos.factor}")
    check(pos.original_max_len is None or pos.original_max_len > 0, "model.position.original_max_len",
          f"must be positive or null (model.max_seq_len), got {pos.original_max_len}")
    if pos.name != "rope":
        return
    check(pos.theta > 1, "model.position.theta", f"must be > 1 (the RoPE base: frequencies theta^(-2i/d); "
          f"10000 usual), got {pos.theta}")
    rot = int(head_dim * pos.rotary_fraction) // 2 * 2  # position.RotaryEmbedding.rotary_dim
    check(rot >= 2, "model.position.rotary_fraction", f"{pos.rotary_fraction} of head_dim={head_dim} rotates no "
          f"channel pair; allowed: >= {2 / head_dim:.4g}")
    if pos.scaling == "dynamic":
        check(rot > 2, "model.position.rotary_fraction", f"{pos.rotary_fraction} of head_dim={head_dim} rotates 2 "
              f"channels; dynamic NTK scales theta by a power dim/(dim-2); allowed: >= {4 / head_dim:.4g}")
    if pos.scaling == "yarn":
        check(pos.beta_slow > 0, "model.position.beta_slow", f"must be > 0 (turns over the original length), "
              f"got {pos.beta_slow}")
        check(pos.beta_fast > pos.beta_slow, "model.position.beta_fast", f"must exceed beta_slow={pos.beta_slow} "
              f"(fast channels turn more often), got {pos.beta_fast}")
    if pos.scaling == "llama3":
        check(pos.low_freq_factor > 0, "model.position.low_freq_factor", f"must be > 0 (the longest kept wavelength "
              f"is original_max_len / low_freq_factor), got {pos.low_freq_factor}")
        check(pos.high_freq_factor > pos.low_freq_factor, "model.position.high_freq_factor",
              f"must exceed low_freq_factor={pos.low_freq_factor}, got {pos.high_freq_factor}")


def parse_pattern(pattern: Any) -> list[str] | None:
    if pattern is None:
        return None
    if isinstance(pattern, str):
        items = [p.strip() for p in pattern.replace(";", ",").split(",") if p.strip()]
    elif isinstance(pattern, (list, tuple, ListConfig)):
        items = [str(p).strip() for p in pattern]
    else:
        raise ConfigError(f"expected a list or comma string of mixer names, got {type(pattern).__name__}", field="model.pattern")
    if not items:
        raise ConfigError("is empty; give at least one mixer name", field="model.pattern")
    return items


def layer_mixer_configs(cfg: ModelConfig) -> list[Any]:
    """The mixer config of each layer: `cfg.mixer` everywhere, or the tiled `cfg.pattern`."""
    from attnzoo.config.registry import MIXERS

    items = parse_pattern(cfg.pattern)
    if items is None:
        return [cfg.mixer] * cfg.n_layers
    if cfg.n_layers % len(items) != 0:
        raise ConfigError(
            f"length {len(items)} does not divide n_layers={cfg.n_layers}; allowed: a pattern whose length divides n_layers",
            field="model.pattern",
        )
    resolved = {}
    for name in items:
        if name in resolved:
            continue
        if name in cfg.mixers:
            resolved[name] = cfg.mixers[name]
        elif cfg.mixer is not None and getattr(cfg.mixer, "name", None) == name:
            resolved[name] = cfg.mixer
        elif name in MIXERS.names():
            resolved[name] = tagged(MIXERS, {"name": name}, f"model.pattern[{name}]")
        else:
            allowed = sorted(set(cfg.mixers) | set(MIXERS.names()))
            raise ConfigError(f"unknown mixer {name!r}; allowed: {', '.join(allowed)}", field="model.pattern")
    return [resolved[items[i % len(items)]] for i in range(cfg.n_layers)]
