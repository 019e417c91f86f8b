"""What a finished run reports: `summary.json` (the final metrics, what the model really is per layer, the data, a
text sample, the resolved config) and the summary block printed at its end.

    run_summary(...)    -> summary.json's content (the sample is generated here, on rank 0)
    finish(...)         rank 0: writes summary.json, logs the end-of-run metrics, closes the loggers, prints
    format_summary(s)   the printed block; describe_model(model) its model line (also RunHeader's, at the start)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from attnzoo.mixers.kv_quant import coverage
from attnzoo.ops.dispatch import model_kernels, run_compute_dtype
from attnzoo.training.checkpoint_io import flatten
from attnzoo.training.csv_logger import RunTensorBoardLogger, run_hparams
from attnzoo.training.measure import inference_kv


def decode_path(m: dict) -> str:
    """How the decode rate was measured (training/measure.measure_inference): static cache, compiled or not."""
    if "perf/decode_static" not in m:
        return ""
    cache = "static cache" if m["perf/decode_static"] else "dynamic cache"
    return f" ({'compiled' if m.get('perf/decode_compiled') else 'eager'}, {cache})"


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
    """The model line: `gqa x4 d_model=128 heads=4/2kv ffn=swiglu pos=rope norm=rmsnorm(pre) vocab=256`."""
    cfg = model.cfg
    kinds = [m.name for m in model.layer_mixers]
    mix = kinds[0] if len(set(kinds)) == 1 else "[" + ",".join(kinds) + "]"
    heads = heads_of(model)
    return (
        f"{mix} x{cfg.n_layers} d_model={cfg.d_model}" + (f" heads={heads}" if heads else "") + f" ffn={cfg.ffn.name} "
        f"pos={cfg.position.name} norm={cfg.norm.name}({cfg.norm_position}) vocab={cfg.vocab_size}"
    )


def kernels_of(model, trainer_cfg, device: torch.device) -> list[str]:
    """Per layer, the kernel its training call ran (ops/dispatch.py) on `device` in the run's compute dtype."""
    return model_kernels(model, device.type, run_compute_dtype(trainer_cfg)[0])


def kv_quant_section(run, model, seq_len: int) -> dict:
    """summary.json's `kv_quant`: what inference.kv_cache_dtype stored (which layers, how many tokens held
    quantized at data.seq_len; kv_quant.coverage), {} for fp32."""
    kv = inference_kv(run)
    return {"kv_quant": coverage(kv["kv_format"], [m.name for m in model.layer_mixers], seq_len)} if kv else {}


def spent(length: dict | None) -> str:
    """The summary's note on what the run trained on: `(trainer.max_flops: 3,072 tokens, 2.19e+09 FLOPs)`."""
    if not length:
        return ""
    return f"   ({length['limit']}: {length['tokens']:,} tokens, {length['flops']:.3g} FLOPs)"


def checkpoint_disk(out: Path) -> dict:
    """What the run's checkpoints/ holds on disk: bytes (every file once, a sharded checkpoint's folder counted
    through its link once) and the steps of the step checkpoints kept."""
    from attnzoo.distributed.checkpoint_files import kept_steps

    folder = out / "checkpoints"
    files = {p.resolve() for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()
    return {"bytes": sum(p.stat().st_size for p in files), "steps_kept": kept_steps(out)}


def format_summary(summary: dict) -> str:
    """The block a run prints at its end (between two rules of `=`), from its summary.json content."""
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
        f"at {summary['context_len']} tokens   decode {g('perf/decode_tokens_per_sec', '{:,.1f}')} tokens/s"
        + decode_path(m),
        f"  wall       {summary['wall_seconds']:.1f} s" + (f" (first step done {summary['first_step_seconds']:.1f} s "
                                                       f"after the {summary.get('first_step_origin', 'command')})"
                                                       if summary.get("first_step_seconds") is not None else "")
        + f"   steps {summary['global_step']}" + spent(summary.get("length")),
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
    disk = summary.get("checkpoints")
    if disk and disk["bytes"]:
        kept = disk["steps_kept"]
        lines.insert(-1, f"  ckpt disk  {disk['bytes'] / 2**20:,.1f} MiB in checkpoints/" + (
            f" ({len(kept)} step checkpoints: {', '.join(map(str, kept[:6]))}{' ...' if len(kept) > 6 else ''})"
            if kept else ""))
    prof = summary.get("profile")
    if prof:  # perf.profile: the window's costliest ops (per step), the trace beside them
        top = ", ".join(f"{op['name']} {op['self_ms_per_step']:.1f}" for op in prof["top_ops"][:3])
        lines.insert(-1, f"  profile    steps {prof['steps'][0]}-{prof['steps'][1] - 1}: {top} ms/step; {prof['trace']}")
    if summary.get("sample"):
        lines += ["  sample     " + repr(summary["sample"])[:400]]
    lines.append("=" * 72)
    return "\n".join(lines)


def run_summary(trainer, lit, dm, parts, metrics, throughput, family, container, out: Path, t_start: float) -> dict:
    """summary.json's content: status, metrics, what the model really is (per layer), data, a text sample."""
    run, data_cfg = parts["run"], parts["data"]
    model = lit.model
    sample = None
    if (family.decoder_only and run.sample.max_new_tokens > 0 and hasattr(dm, "encode") and run.sample.prompt
            and trainer.is_global_zero):
        ids = torch.tensor([dm.encode(run.sample.prompt)], device=lit.device)
        g = torch.Generator(device=lit.device).manual_seed(run.seed)
        outp = model.generate(ids, run.sample.max_new_tokens, temperature=run.sample.temperature,  # top_k 0: no
                              top_k=run.sample.top_k or None, top_p=run.sample.top_p, generator=g,  # cut (--top-k 0)
                              **inference_kv(run))
        sample = dm.decode(outp[0].tolist())
    return {
        "status": "ok",
        "metrics": metrics,
        "output_dir": str(out),
        "global_step": trainer.global_step,
        "wall_seconds": time.perf_counter() - t_start,
        # the command's start (or train()'s call in a library process) to the end of the first optimizer step
        "first_step_seconds": throughput.first_step_seconds,
        "first_step_origin": throughput.first_step_origin,
        "context_len": data_cfg.seq_len,
        "peak_flops": throughput.peak or 0.0,
        "peak_source": throughput.peak_source,
        # the dtype the MFU peak and the kernels are for, and where it comes from (ops/dispatch.run_compute_dtype)
        "compute_dtype": str(run_compute_dtype(run.trainer)[0]).removeprefix("torch."),
        "compute_dtype_source": run_compute_dtype(run.trainer)[1],
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
        **next((cb.summary_section() for cb in trainer.callbacks if hasattr(cb, "summary_section")), {}),  # profile
        "checkpoints": checkpoint_disk(out),  # disk use, and the step checkpoints kept (callbacks.step_checkpoints)
        "seed": run.seed,
        "world_size": trainer.world_size,
        "sample": sample,
        "config": container,
    }


def run_overrides(out: Path) -> list[str]:
    """The run's command-line overrides, as recorded in <out>/.hydra/overrides.yaml ([] when not run by the CLI)."""
    try:
        return [str(o) for o in OmegaConf.load(out / ".hydra" / "overrides.yaml") or []]
    except (OSError, ValueError):
        return []


def finish(trainer, out: Path, summary: dict, loggers: list) -> None:
    """Rank 0 writes summary.json, logs the end-of-run metrics, closes the loggers and prints the summary."""
    if not trainer.is_global_zero:
        return
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
