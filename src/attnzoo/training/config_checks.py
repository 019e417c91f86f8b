"""Validation of a whole composed run config (`validate`): the typed sections from `config`, the model
family's data and metrics (`families`), the trainer, callbacks, loggers and output directory. Every
ConfigError surfaces here, before any work. A layer above `config` (it knows the data modules and the
model families), so the model-part configs never import it.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnzoo.config.schema import (IMPLS, FSDPConfig, InferenceConfig, ModelConfig, TrainConfig, TrainerConfig, _merge,
                                   layer_mixer_configs, resolve_model, tagged)
from attnzoo.data import DATAMODULES
from attnzoo.distributed.checkpoint_files import check_checkpoint_file, checkpoint_file
from attnzoo.config.errors import ConfigError, check, check_choice
from attnzoo.config.machine import cuda_available, kernel_refusal
from attnzoo.ops.triton_interpreter import interpreting
from attnzoo.config.registry import MIXERS
from attnzoo.config.stops import tokens_per_step
from attnzoo.training.budget import check_budget, check_budget_floor
from attnzoo.training.eval_checks import check_niah, check_niah_prompts, niah_haystack
from attnzoo.training.families import check_data, family_of
from attnzoo.training.launch import is_data_parallel, requested_devices
from attnzoo.training.recipe_checks import check_checkpoints, check_optim, check_scheduler, run_checkpoint

# torch is imported by the checks that need it (devices, kernels), after the value checks: a refused value is
# reported before torch's import (issue 45; tests/test_lean_imports.py)


# trainer.strategy values attnzoo runs: Lightning's own DDP names (its StrategyRegistry, 2.x), and "fsdp", which is
# attnzoo's FSDP2 (training/fsdp.py), not Lightning's FSDP1 of that name; deepspeed / xla are not wired here
_DDP_VARIANTS = ("", "_find_unused_parameters_false", "_find_unused_parameters_true")
STRATEGIES = ("auto", "single_device", *(f"ddp{k}{v}" for k in ("", "_spawn", "_fork", "_notebook")
                                          for v in _DDP_VARIANTS), "fsdp")


def _check_trainer(t: TrainerConfig) -> None:
    check(isinstance(t.strategy, str) and t.strategy in STRATEGIES, "trainer.strategy",
          f"got {t.strategy!r}; allowed: {', '.join(STRATEGIES)} (or a preset: trainer=ddp_cpu, fsdp_cpu, ddp, fsdp)")
    vci = t.val_check_interval
    check(isinstance(vci, (int, float)) and not isinstance(vci, bool) and vci > 0 and (isinstance(vci, int) or vci <= 1),
          "trainer.val_check_interval", f"got {vci!r}; allowed: a positive number of steps, or a fraction in (0, 1]")
    lvb = t.limit_val_batches
    check(isinstance(lvb, (int, float)) and not isinstance(lvb, bool) and lvb >= 0, "trainer.limit_val_batches",
          f"got {lvb!r}; allowed: a number of batches >= 0, or a fraction in [0, 1]")
    check(t.gradient_clip_val is None or t.gradient_clip_val > 0, "trainer.gradient_clip_val",
          f"got {t.gradient_clip_val}; allowed: a positive norm, or null (no clipping)")
    check(t.log_every_n_steps > 0, "trainer.log_every_n_steps", f"must be positive, got {t.log_every_n_steps}")
    check(t.num_nodes >= 1, "trainer.num_nodes", f"must be >= 1, got {t.num_nodes}")
    d = t.devices
    ok = d in ("auto", -1, "-1") or isinstance(d, (list, tuple)) and len(d) > 0 or (str(d).isdigit() and int(d) >= 1)
    check(ok, "trainer.devices", f"got {d!r}; allowed: a count >= 1, a list of device ids, -1 or auto")


def check_devices_present(t: TrainerConfig) -> None:
    """Run time, not config validation (a GPU preset is a valid config on a CPU machine): the requested
    accelerator exists here."""
    if t.accelerator in ("gpu", "cuda"):
        alternative = ("trainer=fsdp_cpu for FSDP over CPU processes" if str(t.strategy) == "fsdp"
                       else "trainer=cpu, or trainer=ddp_cpu for DDP over CPU processes")
        check(cuda_available(), "trainer.accelerator",  # certain no's without torch (config/machine.py)
              f"{t.accelerator} requested but no CUDA device is visible; allowed here: cpu ({alternative})")
        import torch

        fsdp_bf16 = str(t.strategy) == "fsdp" and "bf16" in (t.fsdp.param_dtype, t.fsdp.reduce_dtype)
        check(not fsdp_bf16 or torch.cuda.is_bf16_supported(), "trainer.fsdp.param_dtype",
              f"bf16 on {torch.cuda.get_device_name()}, which has no bf16; allowed: fp16 or null")


FSDP_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")  # Lightning's ModelParallelStrategy (16-true: no)


def _check_fsdp(t: TrainerConfig, model: ModelConfig) -> None:
    """trainer.strategy=fsdp (training/fsdp.py): its options, a decoder LM, precisions Lightning's FSDP2 strategy runs,
    host offload for GPU runs only (several nodes need torchrun / srun: launch.check_launchable). fsdp.param_dtype with an autocast
    precision (bf16-mixed) is allowed: the weights are gathered in param_dtype, autocast picks each op's dtype."""
    strategy = str(t.strategy or "auto")
    f = t.fsdp
    if strategy != "fsdp":  # the section is read by trainer.strategy=fsdp only: a value set beside another is ignored
        as_yaml = {None: "null", True: "true", False: "false"}.get
        for key, default in asdict(FSDPConfig()).items():
            value = getattr(f, key)
            check(value == default, f"trainer.fsdp.{key}", f"{as_yaml(value, value)} is read with "
                  f"trainer.strategy=fsdp only, and this run's strategy is {strategy}; allowed: trainer=fsdp_cpu (or "
                  f"trainer=fsdp on GPUs) with it, or {as_yaml(default, default)} (the default)")
        return
    for key in ("param_dtype", "reduce_dtype"):
        check(getattr(f, key) in (None, "bf16", "fp16", "fp32"), f"trainer.fsdp.{key}",
              f"got {getattr(f, key)!r}; allowed: null (the parameters' own dtype), bf16, fp16, fp32")
    check(family_of(model).name == "decoder", "trainer.strategy",
          f"fsdp shards decoder LMs (block by block); allowed with model={model.name}: ddp (trainer=ddp_cpu / ddp)")
    check(str(t.precision) in FSDP_PRECISIONS, "trainer.precision",
          f"{t.precision} does not run under FSDP (Lightning's ModelParallelStrategy); allowed: "
          f"{', '.join(FSDP_PRECISIONS)}")
    check(not (f.cpu_offload and t.accelerator == "cpu"), "trainer.fsdp.cpu_offload",
          "true on a CPU run (the parameters are in host memory already); allowed: false")


def _check_fsdp_flags(container: dict) -> None:
    """trainer.fsdp's two switches as given, before the schema's bool conversion (which read
    reshard_after_forward=2, FSDP2's integer form, as true)."""
    raw = (container.get("trainer") or {}).get("fsdp") or {}
    for key in ("reshard_after_forward", "cpu_offload"):
        value = raw.get(key, False) if isinstance(raw, dict) else False
        check(isinstance(value, bool), f"trainer.fsdp.{key}", f"got {value!r}; allowed: true or false"
              + (" (FSDP2's integer reshard group sizes are not wired here)" if key == "reshard_after_forward" else ""))


def _check_callbacks(cb: dict, data: Any, model: ModelConfig) -> None:
    check_checkpoints(cb)
    # metrics that exist when checkpoints / early stopping read them: validation metrics of this task
    metrics = family_of(model).metrics(data)
    monitors = [("callbacks.monitor", cb.get("monitor"))]
    if isinstance(cb.get("early_stop"), dict):
        monitors.append(("callbacks.early_stop.monitor", cb["early_stop"].get("monitor")))
    for field_name, m in monitors:
        if m is not None:
            check_choice(m, field_name, metrics)


MIN_FREE_BYTES = 64 << 20  # below this a run would stop at its first checkpoint with ENOSPC


def _check_output_dir(path: str) -> None:
    """The run dir (or its nearest existing parent) must be writable: fail now, not at the first checkpoint."""
    import os
    from pathlib import Path

    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    check(p.is_dir() and os.access(p, os.W_OK | os.X_OK), "paths.output_dir",
          f"{path} is not writable ({p} is {'not a directory' if not p.is_dir() else 'read-only'}); allowed: a writable directory")
    free = shutil.disk_usage(p).free
    check(free >= MIN_FREE_BYTES, "paths.output_dir",
          f"{path}: only {free / 2**20:.1f} MiB free on its filesystem; allowed: >= {MIN_FREE_BYTES >> 20} MiB free "
          f"(checkpoints, logs)")


def _check_eval(ev, model: ModelConfig, data: Any) -> None:
    lengths = list(ev.context_lengths or [])
    check(all(isinstance(L, int) and L >= 2 for L in lengths), "eval.context_lengths",
          f"got {lengths}; allowed: a list of lengths >= 2, e.g. [512, 1024]")
    check(ev.max_batches >= 1, "eval.max_batches", f"must be >= 1, got {ev.max_batches}")
    if lengths and not family_of(model).decoder_only:
        raise ConfigError(f"length evaluation is for decoder LMs; allowed with model={model.name}: []",
                          field="eval.context_lengths")
    if model.position.name == "learned":
        too_long = [L for L in lengths if L > model.max_seq_len]
        check(not too_long, "eval.context_lengths", f"{too_long} exceed the learned position table "
              f"(model.max_seq_len={model.max_seq_len}); allowed: <= {model.max_seq_len}, or another position")
    check_niah(ev, model, data)
    pairs = getattr(data, "num_kv_pairs", None)
    if pairs and lengths:
        short = [L for L in lengths if L < 4 * pairs]
        check(not short, "eval.context_lengths", f"{short} cannot hold {pairs} key-value pairs and their "
              f"queries; allowed: >= {4 * pairs}")


def _check_positions_reach_a_layer(cfg: ModelConfig, mixers: list) -> None:
    """ALiBi biases the attention scores of mha / gqa / mqa layers (mixers/attention.py); a model none of whose
    layers is one trained with no position information at all, silently (retnet, mamba2, ... with alibi)."""
    if cfg.position.name != "alibi" or cfg.name != "decoder":
        return
    from attnzoo.mixers.configs import AttentionConfig

    if not any(isinstance(mc, AttentionConfig) for mc in mixers):
        names = ", ".join(dict.fromkeys(mc.name for mc in mixers))
        raise ConfigError(f"alibi biases the attention scores of mha / gqa / mqa layers, and none of this model's "
                          f"layers ({names}) is one: it would train without positions; allowed: rope, sinusoidal, "
                          f"learned, none", field="model.position.name")


def _check_sample_and_perf(run: Any) -> None:
    """The end-of-run sample (`sample`, as attnzoo-generate's flags) and measurement (`perf`): checked with the rest
    (was: a negative temperature, top_k or max_new_tokens, a top_p outside (0, 1] or a non-positive peak_flops
    passed silently after training, a negative perf.decode_tokens ended the finished run in an IndexError)."""
    s, p = run.sample, run.perf
    check(s.max_new_tokens >= 0, "sample.max_new_tokens", f"must be >= 0 (0: no sample), got {s.max_new_tokens}")
    check(s.temperature >= 0, "sample.temperature", f"must be >= 0 (0: greedy), got {s.temperature}")  # NaN too
    check(s.top_k is None or s.top_k >= 0, "sample.top_k", f"must be >= 0 or null (0 / null: no top-k cut), got "
          f"{s.top_k}")
    check(s.top_p is None or 0 < s.top_p <= 1, "sample.top_p", f"must be in (0, 1] or null (1 / null: no nucleus "
          f"cut), got {s.top_p}")
    check(p.profile_wait >= 0, "perf.profile_wait", f"must be >= 0 (steps before the profiled window), got {p.profile_wait}")
    check(p.profile_steps >= 1, "perf.profile_steps", f"must be >= 1 (steps profiled), got {p.profile_steps}")
    check(p.decode_tokens >= 0, "perf.decode_tokens", f"must be >= 0 (0: no decode steps timed), got "
          f"{p.decode_tokens}")
    check(p.peak_flops is None or (p.peak_flops > 0 and math.isfinite(p.peak_flops)), "perf.peak_flops",
          f"must be a finite positive FLOP/s or null (measured / the device table), got {p.peak_flops}")


def _check_seq_len(model: ModelConfig, data: Any) -> None:
    """Each layer's mixer class refuses a training length it cannot take (`Mixer.check_seq_len`: e.g. the
    block-sparse mixers' whole blocks, a sliding window's sinks fewer than the sequence)."""
    for i, mixer in enumerate(layer_mixer_configs(model) if family_of(model).decoder_only else []):
        MIXERS.get(mixer.name).fact("check_seq_len")(mixer, data.seq_len, f"model.layers[{i}].mixer")


def _check_inference(inf: InferenceConfig, model: ModelConfig, data: Any) -> None:
    """The KV-cache format: a known dtype, G >= 1, R >= 0, int4 only with an even head_dim (where some layer
    is quantized: its mixer class is `kv_quantizable`), decoder LMs only, and one that changes something at
    data.seq_len."""
    from attnzoo.mixers.kv_format import KVFormat, coverage

    decoder = family_of(model).decoder_only
    quantized = decoder and any(MIXERS.get(mc.name).fact("kv_quantizable") for mc in layer_mixer_configs(model))
    KVFormat.of(inf).check(head_dims=[model.head_dim] if quantized else [])
    if inf.kv_cache_dtype != "fp32" and not decoder:
        raise ConfigError(f"KV-cache formats are for decoder LMs; allowed with model={model.name}: fp32",
                          field="inference.kv_cache_dtype")
    if inf.kv_cache_dtype != "fp32":
        coverage(KVFormat.of(inf), [mc.name for mc in layer_mixer_configs(model)], data.seq_len)


def _check_context_parallel(t: TrainerConfig, model: ModelConfig, data: Any) -> None:
    """trainer.context_parallel: DDP, a decoder LM whose every layer has a sharded path, no attention dropout,
    and a sequence length that splits into the layout's equal segments, each longer than any conv tail."""
    from attnzoo.distributed.cp_layout import LAYOUTS, check_layout, resolve_layout

    cp = t.context_parallel
    check(isinstance(cp, int) and cp >= 1, "trainer.context_parallel", f"got {cp!r}; allowed: an integer >= 1")
    check_choice(t.context_parallel_layout, "trainer.context_parallel_layout", LAYOUTS)
    if cp == 1:
        return
    check(is_data_parallel(str(t.strategy)), "trainer.context_parallel",
          f"{cp} needs {cp} processes per sequence; allowed with strategy={t.strategy}: 1 (use trainer=ddp_cpu / ddp "
          f"/ fsdp_cpu / fsdp)")
    d = t.devices
    if str(d).isdigit() or isinstance(d, (list, tuple)):
        world = (int(d) if str(d).isdigit() else len(d)) * t.num_nodes
        check(world % cp == 0, "trainer.context_parallel",
              f"{cp} does not divide the {world} processes (devices x num_nodes); allowed: a divisor of {world}")
    fam = family_of(model)
    check(fam.name == "decoder", "trainer.context_parallel",
          f"is for decoder LMs; allowed with model={model.name} ({fam.name} family): 1")
    mixers = layer_mixer_configs(model)
    able = sorted(n for n in MIXERS.names() if MIXERS.get(n).fact("context_parallel"))
    for i, mc in enumerate(mixers):
        check(MIXERS.get(mc.name).fact("context_parallel"), "trainer.context_parallel",
              f"layer {i} is {mc.name}, which has no sharded form; allowed mixers: {', '.join(able)} (or 1)")
    check(model.dropout == 0, "model.dropout",
          f"{model.dropout} with trainer.context_parallel={cp}: ring attention has no attention-probability "
          "dropout; allowed: 0")
    check(getattr(model.position, "scaling", "none") != "dynamic", "model.position.scaling",
          "dynamic NTK rescales by the largest position in each call, which differs per shard; allowed with "
          "trainer.context_parallel > 1: none, linear, yarn, llama3")
    tail = max([1] + [getattr(mc, "conv_size", 0) - 1 for mc in mixers])
    check_layout(data.seq_len, cp, resolve_layout(t.context_parallel_layout, [mc.name for mc in mixers]), tail)


def _check_length(run: Any, model: ModelConfig, data: Any) -> None:
    """trainer.max_steps / max_tokens / max_flops (attnzoo/config/stops.py): positive or null, at least one given;
    the budgets for decoder LMs (their FLOPs per token are the model's own count), not with linearize's
    stage plan; a token budget of at least one optimizer step."""
    t = run.trainer
    check(t.max_steps is None or t.max_steps > 0, "trainer.max_steps",
          f"must be positive (or null with trainer.max_tokens / max_flops), got {t.max_steps}")
    for key in ("max_tokens", "max_flops"):
        value = getattr(t, key)
        if value is None:
            continue
        check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, f"trainer.{key}",
              f"must be positive or null, got {value!r}")
        check(math.isfinite(value), f"trainer.{key}", f"must be finite, got {value!r}; allowed: a positive number, "
              "or null (no budget)")
        fam = family_of(model)
        check(fam.name == "decoder", f"trainer.{key}", f"is for decoder LMs; allowed with model={model.name} "
              f"({fam.name} family): null (trainer.max_steps)")
        check(run.linearize is None, f"trainer.{key}", "with experiment=linearize: its stages set the steps; "
              "allowed: null")
    if t.max_tokens is not None:
        per_step = tokens_per_step(data.batch_size, data.seq_len, t.accumulate_grad_batches,
                                   max(1, requested_devices(t) * t.num_nodes // t.context_parallel))
        check(t.max_tokens >= per_step, "trainer.max_tokens", f"{t.max_tokens:.4g} is below one batch ({per_step:,} "
              f"tokens a step: data.batch_size x data.seq_len x accumulation x data-parallel ranks); allowed: "
              f">= {per_step}")
    if t.max_flops is not None:  # a floor of one step's FLOPs without the model (issue 45: refused before torch):
        # every decoder LM's forward has its LM head, 2 x d_model x vocab (>= 1) FLOPs a token, trained at 3x;
        # a budget above this floor but below the model's own step is refused once it is built (config/stops.py)
        per_step = tokens_per_step(data.batch_size, data.seq_len, t.accumulate_grad_batches,
                                   max(1, requested_devices(t) * t.num_nodes // t.context_parallel))
        floor = per_step * 6.0 * model.d_model
        check(t.max_flops >= floor, "trainer.max_flops", f"{t.max_flops:.4g} is below one optimizer step (at least "
              f"{floor:.4g} FLOPs: {per_step:,} tokens x 3 x the LM head's 2 x d_model={model.d_model} x vocab per "
              f"token, before the layers add theirs); allowed: a budget of many such steps, or a smaller model / batch")
    check(t.max_steps is not None or t.max_tokens is not None or t.max_flops is not None, "trainer.max_steps",
          "is null and no budget is set; allowed: a positive number of steps, or trainer.max_tokens / max_flops")


def _check_packing(run: Any, model: ModelConfig, data: Any) -> None:
    """data.packing / data.pad_documents: a decoder LM trained by attnzoo-train's LM module on one process per
    sequence (the teacher of experiment=linearize and ring attention take no document masks)."""
    for key in ("packing", "pad_documents"):
        if not getattr(data, key, False):
            continue
        check(family_of(model).name == "decoder", f"data.{key}", f"is for decoder LMs; allowed with "
              f"model={model.name}: false")
        check(run.trainer.context_parallel == 1, f"data.{key}", "with trainer.context_parallel > 1: ring attention "
              "takes no document mask; allowed: false (or trainer.context_parallel=1)")
        check(run.linearize is None, f"data.{key}", "with experiment=linearize: the teacher scores each row as one "
              "text; allowed: false")


def _check_memory(run: Any, model: ModelConfig) -> None:
    """trainer.activation_checkpointing / trainer.ce_chunk_tokens: options of the decoder LM's training step
    (model.DecoderLM's block loop, LitLM's loss); chunked cross-entropy never makes the logits that
    experiment=linearize distils from. Under compile=true the recomputation runs without attnzoo's recompute
    context (torch.compile takes no checkpoint context_fn), which routed FFNs (their load would count twice) and
    context parallelism (the ring must be recomputed sharded) need."""
    t = run.trainer
    check(t.ce_chunk_tokens >= 0, "trainer.ce_chunk_tokens",
          f"got {t.ce_chunk_tokens}; allowed: 0 (full logits) or the tokens per chunk, >= 1 (e.g. 1024)")
    fam = family_of(model)
    options = (("activation_checkpointing", t.activation_checkpointing, "false", ("decoder", "linearize")),
               ("ce_chunk_tokens", t.ce_chunk_tokens > 0, "0", ("decoder",)))
    for key, on, off, families in options:
        if on and fam.name not in families:
            why = ("distillation compares the full logits with the teacher's" if fam.name == "linearize"
                   else "it is an option of the decoder LM (model.DecoderLM)")
            raise ConfigError(f"is not available for model={model.name} ({fam.name} family): {why}; allowed: {off}",
                              field=f"trainer.{key}")
    if t.activation_checkpointing and run.compile:
        moe = getattr(model.ffn, "name", None) == "moe"
        check(not moe and t.context_parallel == 1, "trainer.activation_checkpointing",
              f"with compile=true and {'model/ffn=moe' if moe else 'trainer.context_parallel > 1'}: the compiled "
              "recomputation cannot be told apart from the forward; allowed: false, or compile=false")


def _check_linearize(node: Any, model: ModelConfig) -> None:
    """experiment=linearize: the section's values, and a planned student (attnzoo.training.linearize.apply_linearize,
    which needs model.init_from) — a `linearize` section on any other model is refused."""
    if node is None:
        if model.name == "linearize":
            raise ConfigError("is the student of experiment=linearize; allowed: a `linearize` section (experiment="
                              "linearize) with model.init_from", field="model.name")
        return
    from attnzoo.training.linearize import options

    options(node)
    if model.name != "linearize":
        raise ConfigError("experiment=linearize needs a pretrained model to linearize; allowed: "
                          "model.init_from=<local transformers model dir>", field="model.init_from")


def _check_sections(model: ModelConfig, family) -> None:
    """model.vision / model.connector are read by the families that declare them; elsewhere they would be
    silently ignored, so they are refused (e.g. a connector on an encoder-only model)."""
    from attnzoo.training.families import FAMILIES

    for section in ("vision", "connector"):
        if getattr(model, section, None) is not None and section not in family.sections:
            owners = [n for f in FAMILIES.values() if section in f.sections for n in f.model_names]
            raise ConfigError(f"model={model.name} ({family.name} family) has no {section}; allowed: null, or "
                              f"model={' | '.join(owners)}", field=f"model.{section}")


def validate(cfg: DictConfig) -> dict:
    """Validate a composed train config; return the typed sections. Raises ConfigError (one line)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    model_node = container.pop("model", None)
    data_node = container.pop("data", None)
    logger_node = container.pop("logger", None)
    callbacks_node = container.pop("callbacks", None)
    _check_fsdp_flags(container)
    run: TrainConfig = _merge(TrainConfig, container, "")
    model = resolve_model(model_node)
    _check_positions_reach_a_layer(model, layer_mixer_configs(model))
    family = family_of(model)
    if family.check_model is not None:  # the family's own options (model.encdec)
        family.check_model(model_node)
    data = tagged(DATAMODULES, data_node, "data", default_name="text")
    check_data(model, data)  # a data module the model's family cannot use: refused before any work
    if hasattr(data, "validate"):
        data.validate(model, field="data")
    _check_sections(model, family)
    if family.check_with_data is not None:  # e.g. an image encoder's patches against the data's image size
        family.check_with_data(model, data)
    check_budget(container.get("model_budget"))
    if family.name == "decoder":
        check_budget_floor(container.get("model_budget"), model)
    check_optim(run.optim)
    check_scheduler(run.scheduler, run.trainer)
    _check_length(run, model, data)
    _check_trainer(run.trainer)
    _check_callbacks(callbacks_node or {}, data, model)
    _check_output_dir(run.paths.output_dir)
    if model.position.name != "none":
        check(data.seq_len <= model.max_seq_len, "data.seq_len",
              f"{data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; allowed: <= {model.max_seq_len} "
              f"(or raise model.max_seq_len)")
    check(getattr(data, "num_workers", 0) >= 0, "data.num_workers", f"must be >= 0, got {getattr(data, 'num_workers', 0)}")
    check_choice(run.on_nonfinite, "on_nonfinite", ("stop", "skip", "ignore"))
    _check_eval(run.eval, model, data)
    _check_sample_and_perf(run)
    _check_inference(run.inference, model, data)
    _check_context_parallel(run.trainer, model, data)
    _check_packing(run, model, data)
    _check_memory(run, model)
    _check_seq_len(model, data)
    _check_linearize(run.linearize, model)
    check(run.trainer.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches", "must be >= 1")
    check_choice(
        run.trainer.precision, "trainer.precision", ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
    )
    check_choice(run.trainer.accelerator, "trainer.accelerator", ("cpu", "gpu", "cuda", "auto", "mps"))
    _check_fsdp(run.trainer, model)
    if logger_node is not None and not isinstance(logger_node, dict):
        raise ConfigError("expected a mapping", field="logger")
    for name in (logger_node or {}):
        check_choice(name, f"logger.{name}", ("csv", "tensorboard", "wandb"))
    return {"run": run, "model": model, "data": data, "logger": logger_node or {}, "callbacks": callbacks_node or {}}


# ----------------------------------------------------------------------- kernels, and the checks before Lightning

def run_device_type(trainer_cfg) -> str:
    """The device type a run trains on: cuda for accelerator gpu / cuda (auto: when one is visible), else cpu."""
    acc = str(trainer_cfg.accelerator)
    return "cuda" if acc in ("gpu", "cuda") or (acc == "auto" and cuda_available()) else "cpu"


def fla_kernels_of(model_cfg) -> tuple:
    """The fla functions the model's layers call (each mixer class's `fla_kernel`; ops/dispatch.py FLA_KERNELS)."""
    from attnzoo.config.registry import MIXERS
    from attnzoo.config.schema import layer_mixer_configs

    try:
        names = {getattr(c, "name", None) for c in layer_mixer_configs(model_cfg)}
    except (AttributeError, TypeError):  # a family without decoder layers (vision, encoder-decoder presets)
        return ()
    return tuple(MIXERS.get(n).fact("fla_kernel") for n in sorted(n for n in names if n in MIXERS.names()))


def check_kernels_present(parts: dict) -> None:
    """An explicit model.impl=fla|flex that cannot run on the run's device at its precision (or a layer whose fla
    kernel fla refuses on this device: ops/dispatch.py fla_gates), and an explicit fla with packed documents or
    context parallelism (those calls run the torch chunk form: fla's kernels are not given the document resets or
    the shards' states): one line, before any work."""
    model_cfg, run, data = parts["model"], parts["run"], parts["data"]
    impl = getattr(model_cfg, "impl", "auto")
    check_choice(impl, "model.impl", IMPLS)
    if impl not in ("fla", "flex"):  # auto / torch: nothing to refuse here (nor torch to import: issue 45)
        return
    device_type = run_device_type(run.trainer)
    if device_type != "cuda" and not (impl == "fla" and interpreting()):  # certain without asking what is installed
        raise kernel_refusal(impl, device_type, ["auto", "torch"])
    from attnzoo.ops.dispatch import check_request, run_compute_dtype

    check_request(impl, device_type, run_compute_dtype(run.trainer)[0],
                  fla_kernels_of(model_cfg))
    if impl != "fla":
        return
    for key in ("packing", "pad_documents"):
        if getattr(data, key, False):
            raise ConfigError(f"fla is not given packed documents' resets (data.{key}=true runs the torch chunk "
                              f"form); allowed: model.impl=auto or torch with data.{key}=true", field="model.impl")
    if run.trainer.context_parallel > 1:
        raise ConfigError("fla is not given the shards' states of context parallelism (trainer.context_parallel > 1 "
                          "runs the torch chunk form); allowed: model.impl=auto or torch with it", field="model.impl")


def preflight(cfg: DictConfig) -> None:
    """The refusals of `train()` that need neither Lightning nor the data (the config, the devices, the launcher,
    the kernels), made by `attnzoo-train` before it imports Lightning, so that a refused value is reported in
    the time it takes to import torch rather than Lightning (issue 45). `train()` makes the same checks again.
    A config that `model.init_from` or `experiment=linearize` rewrites is left to `train()`, which applies them
    first."""
    from attnzoo.training.launch import check_launchable

    if OmegaConf.select(cfg, "model.init_from") or OmegaConf.select(cfg, "linearize") is not None:
        return
    parts = validate(cfg)
    run = parts["run"]
    ckpt = checkpoint_file(run_checkpoint(run), Path(run.paths.output_dir))  # the file; its contents: train()
    if ckpt is not None:
        check_checkpoint_file(ckpt)
    check_devices_present(parts["run"].trainer)
    check_launchable(parts["run"].trainer)
    check_kernels_present(parts)
    if hasattr(parts["data"], "check_corpus"):  # the text corpus against its tokenizer (data/configs.py)
        tok = parts["data"].check_corpus(run.paths.cache_dir)
        if tok is not None and run.eval.niah_tasks:  # the end-of-run needle prompts fit a length, in its tokens
            check_niah_prompts(run.eval, parts["data"], tok.encode, niah_haystack(parts["data"])[0])
