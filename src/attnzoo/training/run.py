"""`attnzoo-train` (= `python -m attnzoo.training.run`): a Hydra app over conf/train.yaml.

`train(cfg)` does the work and returns the final metrics (importable, tested directly);
`main()` is the console entry point: it reports a bad config in one line (exit 2) and, under
`-m` multirun, records a failing job in its own directory and lets the sweep go on.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from attnzoo.training.checkpoint_io import flatten  # noqa: F401  (attnzoo.training.run.flatten, as before)
from attnzoo.config.errors import ConfigError
from attnzoo.training.config_checks import check_devices_present, validate
from attnzoo.config.paths import CONF_DIR

log = logging.getLogger("attnzoo")

def run_label(max_len: int = 120) -> str:
    """The job's own overrides as a name (`mixer=gqa,num_kv_pairs=8,lr=0.003`), '' outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
    except Exception:  # noqa: BLE001 - not under Hydra
        return ""
    keep = [o for o in task if not o.startswith(("hydra.", "paths.", "+sweeps=", "sweeps=", "ckpt_path=", "logger="))]
    return ",".join(short_override(o) for o in keep)[:max_len]


def short_override(override: str) -> str:
    """`optim.lr=0.003` -> `lr=0.003`, `model/mixer=gqa` -> `mixer=gqa`: the key's last part, the value as
    given (only the characters a folder name cannot hold, `/` and NUL, become `-`)."""
    key, eq, value = override.lstrip("+~").partition("=")
    key = key.split("/")[-1].split(".")[-1]
    return f"{key}{eq}{value}".replace("/", "-").replace("\0", "-")


def build_loggers(logger_cfg: dict, out: Path, container: dict, resume_step: int | None = None) -> list:
    """The configured loggers; `resume_step` (a resumed run's checkpoint step) continues csv/metrics.csv."""
    from attnzoo.training.csv_logger import ResumableCSVLogger, RunTensorBoardLogger

    loggers = []
    for name, opts in (logger_cfg or {}).items():
        opts = dict(opts or {})
        if name == "csv":
            loggers.append(ResumableCSVLogger(save_dir=str(out), name="csv", version="", resume_step=resume_step))
        elif name == "tensorboard":
            # <run>/tensorboard/<overrides>: `tensorboard --logdir <sweep dir>` names each run by its overrides
            # a resume continues the run's own event folder (its label may differ: a larger max_steps) and drops
            # the events logged after the checkpoint step (SummaryWriter's purge_step)
            tb_root, version, extra = out / "tensorboard", run_label(), {}
            if resume_step is not None and tb_root.is_dir():
                earlier = sorted(p.name for p in tb_root.iterdir() if p.is_dir())
                version, extra = (earlier[0] if earlier else version), {"purge_step": resume_step}
            loggers.append(RunTensorBoardLogger(save_dir=str(out), name="tensorboard", version=version,
                                                default_hp_metric=False, **extra))
        elif name == "wandb" and is_rank_zero():  # one wandb run per job, not one per rank
            from attnzoo.training.wandb_logger import make_wandb_logger

            wb = make_wandb_logger(opts, out, container, resume=resume_step is not None)
            if wb is not None:
                loggers.append(wb)
    return loggers


def resolve_ckpt(ckpt_path: str | None, out: Path) -> tuple[str | None, dict | None]:
    """`last` -> <out>/checkpoints/last.ckpt; check the file is a complete, loadable checkpoint.
    Returns (path, checkpoint) — the checkpoint memory-mapped — or (None, None)."""
    from attnzoo.training.checkpoint_io import check_checkpoint

    if ckpt_path is None:
        return None, None
    if ckpt_path == "last":
        p = out / "checkpoints" / "last.ckpt"
        if not p.exists():
            raise ConfigError(f"no checkpoint at {p}; allowed: `last` with hydra.run.dir set to the earlier run's directory, or a .ckpt path", field="ckpt_path")
    else:
        p = Path(ckpt_path).expanduser()
    return str(p), check_checkpoint(p)


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@torch.no_grad()
def measure_inference(model, context_len: int, decode_tokens: int, vocab_size: int, dtype=torch.float32,
                      kv_format=None) -> dict:
    """Prefill `context_len` random tokens (batch 1) into a fresh cache (keys/values in `kv_format`, see
    DecoderLM.new_cache), then decode `decode_tokens` more.

    Returns cache/bytes_at_ctx (measured from the cache's tensors after the prefill) and the decode rate."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (1, context_len), generator=g).to(device)
    cache = model.new_cache(1, context_len + decode_tokens + 1, dtype, device, kv_format=kv_format)
    logits = model(prompt, cache=cache)
    at_ctx = cache.nbytes()
    nxt = logits[:, -1:].argmax(-1)
    nxt = model(nxt, cache=cache)[:, -1:].argmax(-1)  # warm-up step, not timed
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        nxt = model(nxt, cache=cache)[:, -1:].argmax(-1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    model.train(was_training)
    return {"cache/bytes_at_ctx": float(at_ctx), "perf/decode_tokens_per_sec": decode_tokens / dt}


def format_summary(summary: dict) -> str:
    m = summary["metrics"]

    def g(key, fmt="{:.4f}"):
        v = m.get(key)
        return "n/a" if v is None else fmt.format(v)

    lines = [
        "=" * 72,
        f"attnzoo run summary  ({summary['output_dir']})",
        f"  model      {summary['model']['describe']}",
        f"  params     total {int(m.get('params/total', 0)):,}   active {int(m.get('params/active', 0)):,}",
        f"  val        loss {g('val/loss')}   ppl {g('val/ppl', '{:.2f}')}" + (f"   acc {g('val/acc')}" if 'val/acc' in m else ""),
        f"  speed      {g('perf/tokens_per_sec', '{:,.0f}')} tokens/s   step {g('perf/step_ms', '{:.1f}')} ms   "
        f"MFU {g('perf/mfu', '{:.1%}')} (peak {summary['peak_flops'] / 1e9:,.1f} GFLOP/s, {summary['peak_source']})",
        f"  kv-cache   {g('cache/bytes_per_token', '{:,.0f}')} bytes/token   {g('cache/bytes_at_ctx', '{:,.0f}')} bytes "
        f"at {summary['context_len']} tokens   decode {g('perf/decode_tokens_per_sec', '{:,.1f}')} tokens/s",
        f"  wall       {summary['wall_seconds']:.1f} s   steps {summary['global_step']}" + spent(summary.get("length")),
    ]
    if "val/loss_kvq" in m:  # inference.kv_cache_dtype other than fp32: bytes above are that format's
        kv_dtype = ((summary.get("config") or {}).get("inference") or {}).get("kv_cache_dtype")
        lines.insert(-1, f"  kv-quant   {kv_dtype} cache: val loss {g('val/loss_kvq')} ({g('val/loss_kvq_delta', '{:+.4f}')} "
                         f"vs full precision)" + (f"   acc {g('val/acc_kvq')}" if "val/acc_kvq" in m else ""))
        if summary.get("kv_quant"):  # what that cache stored: which layers, how many tokens quantized
            lines.insert(-1, f"             {summary['kv_quant']}")
    kernels = summary["model"].get("kernels") or []
    if any(k != "torch" for k in kernels):  # a GPU run with the fast paths (ops/dispatch.py): which layer ran what
        lines.insert(3, f"  kernels    {','.join(kernels)}   (model.impl={summary['model'].get('impl')})")
    data = summary.get("data") or {}
    if data.get("tokenizer_file"):  # model.init_from with a tokenizer.json: the text is in the model's own tokens
        lines.insert(-1, f"  data       {data['name']} encoded with {data['tokenizer_file']} (the imported model's "
                         f"tokenizer; vocab {summary['model']['vocab_size']:,})")
    lin = summary.get("linearize")
    if lin:  # experiment=linearize: what was replaced, and the student against its teacher
        copied = sorted({p for parts in lin["copied"].values() for p in parts})
        lines.insert(-1, f"  linearize  layers {lin['layers']} -> {','.join(sorted(set(lin['mixers'])))} (copied "
                         f"{'/'.join(copied) or 'nothing'}); {lin['stage1_steps']} + {lin['stage2_steps']} steps; val "
                         f"loss {g('val/loss')} vs teacher {g('val/loss_teacher')}")
    if summary.get("sample"):
        lines += ["  sample     " + repr(summary["sample"])[:400]]
    lines.append("=" * 72)
    return "\n".join(lines)


def run_device_type(trainer_cfg) -> str:
    """The device type a run trains on: cuda for accelerator gpu / cuda (auto: when one is visible), else cpu."""
    acc = str(trainer_cfg.accelerator)
    return "cuda" if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()) else "cpu"


def check_kernels_present(model_cfg, trainer_cfg) -> None:
    """An explicit model.impl=fla|flex that cannot run on the run's device: one line, before any work."""
    from attnzoo.ops.dispatch import check_request

    check_request(getattr(model_cfg, "impl", "auto"), run_device_type(trainer_cfg))


def kernels_of(model, trainer_cfg, device: torch.device) -> list[str]:
    """Per layer, the kernel its training call ran (ops/dispatch.py) on `device` at the run's precision."""
    from attnzoo.ops.dispatch import model_kernels, precision_compute_dtype

    return model_kernels(model, device.type, precision_compute_dtype(trainer_cfg.precision))


def kv_heads_of(model) -> int | None:
    """KV heads of the first layer that has any (mha: n_heads, mqa: 1, gqa: its groups), as built."""
    return next((m.n_kv_heads for m in getattr(model, "mixers", []) if hasattr(m, "n_kv_heads")), None)


def heads_of(model) -> str:
    """The layers' heads as built: `4/2kv` when every layer that has heads has these, else per layer kind
    (`gated_deltanet:4,gqa:4/1kv`); layers without heads are left out ('' when none has any). Attention:
    query heads / KV heads; recurrent mixers: q/k heads, and `/Nv` when the value heads differ."""
    per_kind: dict[str, str] = {}
    for m in getattr(model, "mixers", []):
        shape = m.layer_shape() if hasattr(m, "layer_shape") else {}
        if "n_heads" in shape:
            heads = f"{shape['n_heads']}" + (f"/{shape['n_kv_heads']}kv" if "n_kv_heads" in shape else "")
        elif "n_qk_heads" in shape:
            v = shape.get("n_v_heads", shape["n_qk_heads"])
            heads = f"{shape['n_qk_heads']}" + (f"/{v}v" if v != shape["n_qk_heads"] else "")
        else:
            continue
        per_kind.setdefault(f"{shape['mixer']}:{heads}", heads)
    if len(set(per_kind.values())) == 1:
        return next(iter(per_kind.values()))
    return ",".join(per_kind)


def describe_model(model) -> str:
    cfg = model.cfg
    kinds = [m.name for m in model.layer_mixers]
    mix = kinds[0] if len(set(kinds)) == 1 else "[" + ",".join(kinds) + "]"
    heads = heads_of(model)
    return (
        f"{mix} x{cfg.n_layers} d_model={cfg.d_model}" + (f" heads={heads}" if heads else "") + f" ffn={cfg.ffn.name} "
        f"pos={cfg.position.name} norm={cfg.norm.name}({cfg.norm_position}) vocab={cfg.vocab_size}"
    )


def train(cfg: DictConfig, on_accept=None) -> dict:
    """Train one run from a composed config; returns the final metrics (also written to summary.json).
    `on_accept()` is called once the run is accepted (config valid, run dir free, resume compatible),
    before anything is written to the run dir (the CLI writes `.hydra/` there then)."""
    from attnzoo.interop.hf import apply_init_from
    from attnzoo.training.launch import check_launchable
    from attnzoo.training.linearize import apply_linearize
    from attnzoo.training.rundir import run_dir_lock

    t_start = time.perf_counter()
    cfg = apply_init_from(cfg)  # model.init_from: the model section from that transformers config.json
    cfg = apply_linearize(cfg)  # experiment=linearize: that section becomes the student's (chosen layers linear)
    parts = validate(cfg)  # every config error surfaces here, before any work
    check_devices_present(parts["run"].trainer)
    check_launchable(parts["run"].trainer)  # several devices: through attnzoo's DDP launcher only
    check_kernels_present(parts["model"], parts["run"].trainer)
    out = Path(parts["run"].paths.output_dir).expanduser()
    from attnzoo.training.console import ConsoleLog

    console = ConsoleLog(out / "train.log") if is_rank_zero() else contextlib.nullcontext()

    def accepted() -> None:  # train.log: what the run printed, from its start; nothing for a refused run
        if on_accept is not None:
            on_accept()
        if isinstance(console, ConsoleLog):
            console.start()

    try:
        with run_dir_lock(out), console:  # one live run per run dir (refused in one line before anything is written)
            return _train(cfg, parts, out, t_start, accepted)
    except OSError as e:
        import errno

        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk filled up during the run: one line, not a traceback
            raise ConfigError(f"no space left writing {e.filename or out} ({e.strerror}); the last complete "
                              f"checkpoint is kept; allowed: free space, then resume with --resume {out}",
                              field="paths.output_dir") from e
        raise


def _train(cfg: DictConfig, parts: dict, out: Path, t_start: float, on_accept=None) -> dict:
    """The steps of one run, in order; each is a function below."""
    import lightning as L

    from attnzoo.training.launch import launch_workers, processes_to_launch

    run = parts["run"]
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    ckpt_path, ckpt = resolve_ckpt(run.ckpt_path, out)
    L.seed_everything(run.seed, workers=True, verbose=False)
    dm, budget = prepare_data(parts, container)
    from attnzoo.interop.hf import check_init_vocab

    check_init_vocab(container["model"], dm.vocab_size)  # an imported model's embedding fits the data's ids
    if ckpt is not None:  # before anything is built or written: a refused resume leaves the run dir as it was
        from attnzoo.training.checkpoint_io import check_resume_compatible

        check_resume_compatible((ckpt.get("hyper_parameters") or {}).get("cfg"), container, ckpt_path)
    n_workers = processes_to_launch(run.trainer)
    if n_workers:  # DDP on this node: fresh worker processes on this job's resolved config
        if on_accept is not None:
            on_accept()
        launch_workers(container, out, n_workers)
        summary = json.loads((out / "summary.json").read_text())
        if summary.get("status") == "preempted":  # SIGTERM passed on to the workers: they saved last.ckpt
            return {"status": "preempted", "global_step": summary["global_step"]}
        return summary["metrics"]
    family, lit = build_module(container, dm, run)  # the model's own checks (e.g. a causal decoder) refuse here
    parts["length"] = resolve_run_length(run, parts["data"], lit, family, container)
    if on_accept is not None:
        on_accept()
    out.mkdir(parents=True, exist_ok=True)
    loggers = build_loggers(parts["logger"], out, container, None if ckpt is None else int(ckpt["global_step"]))
    trainer, throughput = build_trainer(parts, out, loggers)
    for lg in loggers:
        lg.log_hyperparams(flatten(container))
    preempted = fit(trainer, lit, dm, ckpt_path, out)
    if preempted is not None:
        return preempted
    metrics = final_metrics(trainer, lit, dm, parts, budget, throughput, family)
    summary = run_summary(trainer, lit, dm, parts, metrics, throughput, family, container, out, t_start)
    finish(trainer, out, summary, loggers)
    return metrics


def prepare_data(parts: dict, container: dict):
    """The data module (tokenizer trained and cached once, before any worker starts) and the matched
    parameter budget, which may set a width in container["model"] (in place)."""
    from attnzoo.training.budget import apply_budget
    from attnzoo.data import build_datamodule

    run = parts["run"]
    dm = build_datamodule(parts["data"], cache_dir=run.paths.cache_dir, seed=run.seed)
    dm.setup("fit")
    return dm, apply_budget(container, dm.vocab_size)


def build_module(container: dict, dm, run):
    """(family, LightningModule). The model config is resolved once, after its last change (the budget's
    width), and every part of the run reads that one object."""
    from attnzoo.config.schema import resolve_model
    from attnzoo.training.families import family_of

    family = family_of(container["model"])
    lit = family.build_lit(container, resolve_model(container["model"], vocab_size=dm.vocab_size), dm)
    if container["model"].get("init_from"):  # the imported weights (a resume has the model's own in its checkpoint)
        from attnzoo.interop.hf import init_weights_from

        lit.load_pretrained(lambda module: init_weights_from(module, container["model"]),
                            resuming=run.ckpt_path is not None)
    if run.compile:
        lit.compile_model()
    return family, lit


def resolve_run_length(run, data_cfg, lit, family, container: dict):
    """trainer.max_steps / max_tokens / max_flops -> the run's steps (attnzoo/config/stops.py), written where the
    Trainer, the learning-rate schedule and the saved config read them. None for families other than the
    decoder LM (their length is max_steps; no token or FLOP budget)."""
    from attnzoo.models.flops import train_flops_per_token
    from attnzoo.training.launch import requested_devices
    from attnzoo.config.stops import run_length, tokens_per_step

    t = run.trainer
    if family.name != "decoder":
        return None
    data_parallel = max(1, requested_devices(t) * t.num_nodes // t.context_parallel)
    length = run_length(t.max_steps, t.max_tokens, t.max_flops,
                        tokens_per_step(data_cfg.batch_size, data_cfg.seq_len, t.accumulate_grad_batches, data_parallel),
                        train_flops_per_token(lit.model, data_cfg.seq_len))
    if length.limit != "trainer.max_steps" or t.max_steps is None:
        t.max_steps = container["trainer"]["max_steps"] = lit.max_steps = length.steps
        print(f"attnzoo: {length.limit}={getattr(t, length.limit.split('.')[1]):.4g} -> {length.steps} steps of "
              f"{length.tokens_per_step:,} tokens ({length.flops_per_step:.3g} FLOPs) each", flush=True)
    return length


def build_trainer(parts: dict, out: Path, loggers: list):
    """The Lightning Trainer with the run's callbacks; returns (trainer, throughput monitor)."""
    import lightning as L

    from attnzoo.training.callbacks import PreemptionCheckpoint, RunCheckpoint, ThroughputMonitor, TrainingSpend
    from attnzoo.training.checkpoint_io import AtomicCheckpointIO
    from attnzoo.data.sampling import DataPositionCallback

    run, data_cfg = parts["run"], parts["data"]
    cb_cfg = dict(parts["callbacks"] or {})
    ckpt_every = int(cb_cfg.get("checkpoint_every_n_steps") or 0) or run.trainer.val_check_interval
    throughput = ThroughputMonitor(data_cfg.seq_len, run.trainer.precision, run.perf.peak_flops)
    from attnzoo.training.csv_logger import ResumableCSVLogger, RowBeforeCheckpoint

    csv_loggers = [lg for lg in loggers if isinstance(lg, ResumableCSVLogger)]
    callbacks = [
        DataPositionCallback(),  # first: the data position must be current when checkpoints are written
        PreemptionCheckpoint(out / "checkpoints" / "last.ckpt"),
        throughput,
        *([TrainingSpend(parts["length"])] if parts.get("length") else []),  # train/tokens, train/flops
        *[RowBeforeCheckpoint(lg) for lg in csv_loggers],  # the step's CSV row (perf included) before its checkpoint
        # last.ckpt every `ckpt_every` steps (resume point) and at the final step; written to a temp file, renamed
        RunCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=ckpt_every,
                      enable_version_counter=False),
    ]
    monitor = cb_cfg.get("monitor") or "val/loss"
    if cb_cfg.get("save_best", True):
        callbacks.append(
            RunCheckpoint(dirpath=out / "checkpoints", filename="best", monitor=monitor,
                          mode="max" if monitor.endswith("acc") else "min", save_top_k=1, auto_insert_metric_name=False,
                          enable_version_counter=False)
        )
    if cb_cfg.get("early_stop"):
        from lightning.pytorch.callbacks import EarlyStopping

        es = dict(cb_cfg["early_stop"])
        callbacks.append(EarlyStopping(monitor=es.get("monitor", monitor), mode=es.get("mode", "max"),
                                       stopping_threshold=es.get("threshold"), patience=es.get("patience", 10**9),
                                       check_on_train_epoch_end=False))
    from attnzoo.training.console import RunHeader, RunProgressBar, quiet_lightning

    callbacks.append(RunHeader(describe_model))  # in place of Lightning's module table (its FLOPs column reads 0)
    if run.trainer.enable_progress_bar:  # steps to max_steps, with the run's ETA
        callbacks.append(RunProgressBar(refresh_rate=1 if sys.stderr.isatty() else 20))  # also readable when piped
    quiet_lightning()
    trainer_kwargs = run.trainer.lightning_kwargs()
    trainer = L.Trainer(**trainer_kwargs, logger=loggers or False, callbacks=callbacks, default_root_dir=str(out),
                        plugins=[AtomicCheckpointIO()], use_distributed_sampler=False,  # our sampler shards
                        enable_model_summary=False)
    return trainer, throughput


def fit(trainer, lit, dm, ckpt_path, out: Path) -> dict | None:
    """trainer.fit; None when training finished, {"status": "preempted", ...} after a SIGTERM."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        trainer.fit(lit, datamodule=dm, ckpt_path=ckpt_path)
    except SIGTERMException:
        # preempted (SLURM sends SIGTERM first): last.ckpt was written by PreemptionCheckpoint
        if trainer.is_global_zero:
            (out / "summary.json").write_text(json.dumps({"status": "preempted", "global_step": trainer.global_step,
                                                         "output_dir": str(out)}, indent=2))
            print(f"attnzoo: SIGTERM at step {trainer.global_step}; saved {out / 'checkpoints' / 'last.ckpt'}; "
                  f"resume with: attnzoo-train --resume {out}", flush=True)
        return {"status": "preempted", "global_step": trainer.global_step}
    return None


def inference_kv(run) -> dict:
    """`kv_format=` for the model's caches at inference (inference.kv_cache_dtype), {} for fp32 (the plain
    cache; other formats are for decoder LMs only, checked by validate)."""
    from attnzoo.mixers.kv_quant import KVFormat

    fmt = KVFormat.of(run.inference)
    return {} if fmt.dtype == "fp32" else {"kv_format": fmt}


def kv_quant_section(run, model, seq_len: int) -> dict:
    """summary.json's `kv_quant`: what inference.kv_cache_dtype stored (which layers, how many tokens held
    quantized at data.seq_len; kv_quant.coverage), {} for fp32."""
    from attnzoo.mixers.kv_quant import coverage

    kv = inference_kv(run)
    return {"kv_quant": coverage(kv["kv_format"], [m.name for m in model.layer_mixers], seq_len)} if kv else {}


def final_metrics(trainer, lit, dm, parts: dict, budget: dict, throughput, family) -> dict:
    """Metrics at the end of a run: the last logged values, a validation of the final weights (the last
    scheduled one may be steps earlier), throughput, budget, parameters, cache bytes and inference timing."""
    from attnzoo.models.flops import precision_dtype

    run, data_cfg = parts["run"], parts["data"]
    model = lit.model
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
    final = trainer.validate(lit, datamodule=dm, verbose=False)[0] if trainer.limit_val_batches else {}
    if final:  # best.ckpt: the final weights too, when their validation is the best of the run
        from attnzoo.training.callbacks import RunCheckpoint

        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, RunCheckpoint):
                cb.consider_final_validation(trainer)
    infer_dtype = precision_dtype(run.trainer.precision) if "true" in run.trainer.precision else torch.float32
    metrics.update({k: float(v) for k, v in final.items()})
    metrics.update(throughput.last)
    metrics.update({k: float(v) for k, v in budget.items() if isinstance(v, (int, float))})
    metrics["params/total"] = float(model.num_params())
    metrics["params/active"] = float(model.active_params())
    kv = inference_kv(run)
    metrics["cache/bytes_per_token"] = model.cache_bytes(data_cfg.seq_len, 1, infer_dtype, **kv) / data_cfg.seq_len
    if run.perf.measure_decode and trainer.is_global_zero and family.decoder_only:
        metrics.update(measure_inference(model, data_cfg.seq_len, run.perf.decode_tokens, dm.vocab_size, infer_dtype,
                                         **kv))
    if kv and trainer.is_global_zero:  # the quality cost: validation through that cache vs the full forward
        from attnzoo.analysis.extrapolation import evaluate_kv_format

        # the final validation's batches (rank 0's shard under DDP), so val/loss_kvq compares with val/loss
        n = (trainer.num_val_batches or [math.inf])[0] if final else math.inf
        n = int(n) if math.isfinite(n) else run.eval.max_batches
        metrics.update(evaluate_kv_format(lit, dm.val_dataloader(), kv["kv_format"], n))
    if run.eval.context_lengths and trainer.is_global_zero and family.decoder_only:
        from attnzoo.analysis.extrapolation import evaluate_lengths

        metrics.update(evaluate_lengths(lit, dm, data_cfg, run.eval.context_lengths, run.eval.max_batches))
        if run.perf.measure_decode:  # the cache really held after L tokens, and the decode rate there
            for L in run.eval.context_lengths:
                at = measure_inference(model, int(L), run.perf.decode_tokens, dm.vocab_size, infer_dtype)
                metrics.update({f"{k}@{L}": v for k, v in at.items()})
    return metrics


def spent(length: dict | None) -> str:
    """The summary's note on what the run trained on: `(trainer.max_flops: 3,072 tokens, 2.19e+09 FLOPs)`."""
    if not length:
        return ""
    return f"   ({length['limit']}: {length['tokens']:,} tokens, {length['flops']:.3g} FLOPs)"


def run_summary(trainer, lit, dm, parts, metrics, throughput, family, container, out: Path, t_start: float) -> dict:
    """summary.json's content: status, metrics, what the model really is (per layer), data, a text sample."""
    run, data_cfg = parts["run"], parts["data"]
    model = lit.model
    sample = None
    if (family.decoder_only and run.sample.max_new_tokens > 0 and hasattr(dm, "encode") and run.sample.prompt
            and trainer.is_global_zero):
        ids = torch.tensor([dm.encode(run.sample.prompt)], device=lit.device)
        g = torch.Generator(device=lit.device).manual_seed(run.seed)
        outp = model.generate(ids, run.sample.max_new_tokens, temperature=run.sample.temperature,
                              top_k=run.sample.top_k, top_p=run.sample.top_p, generator=g, **inference_kv(run))
        sample = dm.decode(outp[0].tolist())
    return {
        "status": "ok",
        "metrics": metrics,
        "output_dir": str(out),
        "global_step": trainer.global_step,
        "wall_seconds": time.perf_counter() - t_start,
        "context_len": data_cfg.seq_len,
        "peak_flops": throughput.peak or 0.0,
        "peak_source": throughput.peak_source,
        "model": {"describe": describe_model(model), "mixers": [m.name for m in model.layer_mixers],
                  "d_model": model.cfg.d_model, "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
                  "n_kv_heads": kv_heads_of(model), "ffn": model.cfg.ffn.name, "vocab_size": model.cfg.vocab_size,
                  "family": family.name, "layers": [m.layer_shape() for m in getattr(model, "mixers", [])
                                                    if hasattr(m, "layer_shape")],
                  # model.impl and, per layer, the kernel it trained with here (torch | fla | flex; docs/gpu.md)
                  "impl": getattr(model.cfg, "impl", "auto"), "kernels": kernels_of(model, run.trainer, lit.device)},
        "data": {"name": data_cfg.name, "seq_len": data_cfg.seq_len, "batch_size": data_cfg.batch_size,
                 **getattr(dm, "info", {})},
        **lit.summary_sections(),  # the module's own record (experiment=linearize: what was replaced)
        **kv_quant_section(run, model, data_cfg.seq_len),
        **({"length": parts["length"].summary(run.trainer.max_tokens, run.trainer.max_flops)}
           if parts.get("length") else {}),
        "seed": run.seed,
        "world_size": trainer.world_size,
        "sample": sample,
        "config": container,
    }


def finish(trainer, out: Path, summary: dict, loggers: list) -> None:
    """Rank 0 writes summary.json, logs the end-of-run metrics, closes the loggers and prints the summary."""
    if not trainer.is_global_zero:
        return
    from attnzoo.training.csv_logger import RunTensorBoardLogger, run_hparams

    metrics = summary["metrics"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for lg in loggers:
        if isinstance(lg, RunTensorBoardLogger):  # the HParams tab: the run's overrides, key fields, final metrics
            lg.log_final(run_hparams(flatten(summary["config"]), run_overrides(out)), metrics, trainer.global_step)
            continue
        lg.log_metrics({k: v for k, v in metrics.items() if k.startswith(("cache/", "params/", "perf/decode"))
                        or k.endswith(("_kvq", "_kvq_delta"))}, step=trainer.global_step)
        lg.finalize("success")
        if type(lg).__name__ == "WandbLogger":  # close this job's run so the next job gets its own
            lg.experiment.finish()
    print(format_summary(summary), flush=True)


def run_overrides(out: Path) -> list[str]:
    """The run's command-line overrides, as recorded in <out>/.hydra/overrides.yaml ([] when not run by the CLI)."""
    try:
        return [str(o) for o in OmegaConf.load(out / ".hydra" / "overrides.yaml") or []]
    except (OSError, ValueError):
        return []


def _previous_status(out: Path) -> str | None:
    try:
        return json.loads((out / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def _run_job(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        multirun = False
    target = cfg.get("optimized_metric") or "val/loss"
    if multirun:
        # a sweep rerun into the same sweep dir: finished jobs are skipped, interrupted ones resume
        out = Path(cfg.paths.output_dir)
        if _previous_status(out) == "ok":
            print(f"attnzoo: {out} finished earlier; skipped", flush=True)
            return json.loads((out / "summary.json").read_text())["metrics"].get(target)
        if cfg.get("ckpt_path") is None and (out / "checkpoints" / "last.ckpt").is_file():
            from omegaconf import open_dict

            with open_dict(cfg):
                cfg.ckpt_path = "last"
            print(f"attnzoo: resuming {out} from its last.ckpt", flush=True)
    out = Path(cfg.paths.output_dir)
    from attnzoo.training.console import is_new_run_dir, remove_new_run_dir

    new_dir = not multirun and is_new_run_dir(out)  # Hydra made it for this run: a refusal leaves nothing
    if (out / ".hydra").exists():  # an earlier run's dir: its record is rewritten only once this run is accepted
        on_accept = lambda: save_hydra_record(cfg, out)  # noqa: E731
    else:  # a new dir: recorded now, so a job refused in a sweep still shows its overrides in the report
        save_hydra_record(cfg, out)
        on_accept = None
    try:
        metrics = train(cfg, on_accept=on_accept)
    except (ConfigError, FileNotFoundError) as e:
        if not multirun:
            if new_dir:
                remove_new_run_dir(out)
            print(f"attnzoo: error: {e}", file=sys.stderr)
            sys.exit(2)
        _record_failure(cfg, e)
        return float("nan")  # a failed trial to a sweeper that optimizes (Optuna), ignored by the others
    except Exception as e:  # noqa: BLE001 - a failing sweep job must not take the others with it
        if not multirun:
            raise
        _record_failure(cfg, e)
        return float("nan")  # a failed trial to a sweeper that optimizes (Optuna), ignored by the others
    if metrics.get("status") == "preempted":
        # SIGTERM ends the process, not just this job: a local sweep stops, a requeued job resumes
        sys.exit(0)
    return metrics.get(target)


def save_hydra_record(cfg: DictConfig, out: Path) -> None:
    """What Hydra writes to <run dir>/.hydra (config.yaml, hydra.yaml, overrides.yaml), written by us
    (conf/hydra/default.yaml sets output_subdir: null) so that a refused run cannot overwrite the
    record of the run that owns the directory (issue 12: the report then listed the refused overrides)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
    except ValueError:  # not under Hydra (tests call train() directly)
        return
    d = out / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, d / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hc}), d / "hydra.yaml")
    OmegaConf.save(hc.overrides.task, d / "overrides.yaml")


def _record_failure(cfg: DictConfig, err: BaseException) -> None:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.txt").write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    (out / "summary.json").write_text(json.dumps({"status": "failed", "error": f"{type(err).__name__}: {err}",
                                                 "output_dir": str(out)}, indent=2))
    print(f"attnzoo: job failed ({type(err).__name__}: {err}); recorded in {out}/error.txt", file=sys.stderr)


def check_group_overrides(args: list[str]) -> str | None:
    """One-line error for `group=option` overrides naming an option that does not exist (before Hydra's
    multi-line report). Handles `a,b` multirun lists; leaves sweep functions and `+`/`~` forms to Hydra."""
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "+", "~", "hydra")):
            continue
        key, value = arg.split("=", 1)
        key = key.removeprefix("override ").strip()
        group_dir = CONF_DIR / key
        if not group_dir.is_dir() or "(" in value:
            continue
        allowed = sorted(p.stem for p in group_dir.glob("*.yaml"))
        # `logger=[csv,tensorboard]`: several options of one group at once (Hydra's list syntax)
        for option in value.strip().removeprefix("[").removesuffix("]").split(","):
            option = option.strip()
            if option and option != "null" and option not in allowed:
                return f"{key}: unknown option {option!r}; allowed: {', '.join(allowed)}"
    return None


def first_job_override(arg: str) -> str | None:
    """`key=a,b`, `key=range(1,5)`, `key=tag(log, interval(1e-4, 3e-2))` -> `key=<its first value>`: one
    job's form of a sweep override, so a multirun's keys can be checked by composing one job. Other
    overrides unchanged; None when Hydra cannot parse or enumerate it (`glob(*)`): Hydra reports it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Transformer

    try:
        o = OverridesParser.create().parse_override(arg)
        if not o.is_sweep_override():
            return arg
        first = o.value().start if o.is_interval_sweep() else next(iter(o.sweep_iterator(Transformer.encode)))
    except Exception:  # noqa: BLE001 - any parse problem: Hydra's own report
        return None
    return f"{arg.split('=', 1)[0]}={first}"


def check_unknown_keys(args: list[str]) -> str | None:
    """One-line error for `a.b=value` naming a key the composed config does not have (`model.n_head=4`:
    Hydra reports it in five lines; here `model.n_head: unknown key; did you mean model.n_heads? ...`).
    A multirun (`-m`, attnzoo-sweep's `hydra.searchpath` + `+sweeps=NAME`, Optuna's search ranges) is
    checked as its first job would be composed. Any other composition problem is left to Hydra's report."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return None  # --help, --cfg, shell completion (-sc install=bash): Hydra's own business
    overrides = [a for a in args if "=" in a and (a.startswith("hydra.searchpath=")  # attnzoo-sweep's sweeps/
                                                  or not a.startswith(("-", "hydra.", "hydra/")))]
    one_job = {a: first_job_override(a) for a in overrides}  # each override as the first job sees it
    if None in one_job.values():
        return None

    def composed(ov):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                return compose(config_name="train", overrides=[one_job[a] for a in ov])
        finally:
            GlobalHydra.instance().clear()

    try:
        composed(overrides)
        return None
    except ConfigCompositionException as e:
        bad = next((a for a in overrides if f"'{a.split('=', 1)[0]}'" in str(e)), None)
        if bad is None or bad.startswith(("+", "~", "hydra.")) or "/" in bad.split("=", 1)[0]:
            return None
    except Exception:  # noqa: BLE001 - anything else: Hydra reports it as usual
        return None
    key = bad.split("=", 1)[0]
    parent, _, leaf = key.rpartition(".")
    try:
        node = composed([a for a in overrides if a != bad])
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001
        return None
    keys = list(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return f"{key}: unknown key; {hint}allowed keys: {', '.join(map(str, keys))} (add a new key with +{bad})"


def resume_argv(argv: list[str]) -> list[str]:
    """`--resume RUN_DIR [overrides...]` -> the run's own overrides (from RUN_DIR/.hydra/overrides.yaml),
    then the given ones, then `hydra.run.dir=RUN_DIR ckpt_path=last`. Other argv pass through unchanged."""
    if "--resume" not in argv:
        return argv
    i = argv.index("--resume")
    if i + 1 >= len(argv):
        raise ConfigError("needs the run directory: attnzoo-train --resume RUN_DIR [overrides...]", field="--resume")
    run_dir = Path(argv[i + 1]).expanduser().resolve()
    saved = run_dir / ".hydra" / "overrides.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no .hydra/overrides.yaml)", field="--resume")
    if not (run_dir / "checkpoints" / "last.ckpt").is_file():
        raise ConfigError(f"{run_dir} has no checkpoints/last.ckpt to resume from", field="--resume")
    own = [o for o in (OmegaConf.load(saved) or []) if not str(o).startswith(("ckpt_path=", "hydra.run.dir="))]
    if any(str(o).startswith("+sweeps=") for o in own):  # a sweep job: its sweep file must be found again
        from attnzoo.config.paths import sweeps_dir

        own.insert(0, f"hydra.searchpath=[file://{sweeps_dir().parent}]")
    rest = argv[:i] + argv[i + 2:]
    return [*map(str, own), *rest, f"hydra.run.dir={run_dir}", "ckpt_path=last"]


def main() -> None:
    import hydra

    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        sys.argv[1:] = resume_argv(sys.argv[1:])
    except ConfigError as e:
        print(f"attnzoo: error: {e}", file=sys.stderr)
        sys.exit(2)
    problem = check_group_overrides(sys.argv[1:]) or check_unknown_keys(sys.argv[1:])
    if problem:
        print(f"attnzoo: error: {problem}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")(_run_job)()


if __name__ == "__main__":
    main()
