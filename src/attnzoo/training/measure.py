"""What a run measures once training is over: a validation of the final weights, throughput, parameters, the
KV cache (analytic bytes, and the bytes a real prefill holds), the decode rate, and on request the quality of a
quantized cache and the loss at other context lengths (analysis/extrapolation.py)."""
from __future__ import annotations

import logging
import math

import torch

from attnzoo.analysis.extrapolation import evaluate_kv_format, evaluate_lengths
from attnzoo.models.decoding import Decoder
from attnzoo.mixers.kv_quant import KVFormat
from attnzoo.models.flops import precision_dtype
from attnzoo.training.callbacks import RunCheckpoint
from attnzoo.training.families import embedding_params
from attnzoo.distributed.fsdp import is_sharded
from attnzoo.training.fsdp import unshard_for_rank_zero

log = logging.getLogger(__name__)


@torch.no_grad()
def measure_inference(model, context_len: int, decode_tokens: int, vocab_size: int, dtype=torch.float32,
                      kv_format=None, compile: bool = False) -> dict:
    """Prefill `context_len` random tokens (batch 1), then decode `decode_tokens` more, greedy, through
    attnzoo.models.decoding.Decoder: the static cache (in `kv_format`; the dynamic one where a mixer has no static
    form), the step compiled with `compile` (its compile happens in an untimed first step).

    Returns cache/bytes_at_ctx (measured from the cache's tensors after the prefill: what it holds), the decode
    rate, and the path it took: perf/decode_static (1: a static cache), perf/decode_compiled (1: compiled)."""
    was_training = model.training
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (context_len,), generator=g).tolist()
    dec = Decoder(model, 1, context_len + decode_tokens + 2, compile=compile, dtype=dtype, kv_format=kv_format)
    rate = dec.decode_rate(prompt, decode_tokens)
    model.train(was_training)
    log.info("attnzoo: decode at %d tokens: %.1f tokens/s (%s)", context_len, rate["tokens_per_sec"], dec.path)
    return {"cache/bytes_at_ctx": float(rate["filled_bytes"]), "perf/decode_tokens_per_sec": rate["tokens_per_sec"],
            "perf/decode_static": float(dec.cache is not None), "perf/decode_compiled": float(dec.compiled)}


def decode_mode(device_type: str, setting) -> str:
    """The decode step the run summary measures (perf/decode_tokens_per_sec), from the device type and
    perf.decode_compile: "compiled" (torch.compile of the static-cache step; on CUDA mode="reduce-overhead",
    i.e. replayed as one CUDA graph: per-token kernel launches dominate an eager step of a small model on a GPU)
    or "eager". auto: compiled on CUDA only (a CPU's first inductor compile takes ~20 s, more than a small run's
    decode probe); true / false: always / never. The summary records which ran: perf/decode_compiled (1 / 0; 0
    also when the compile failed and the decoder fell back to eager)."""
    if setting == "auto":
        return "compiled" if device_type == "cuda" else "eager"
    return "compiled" if setting else "eager"


def decode_compile(run, device) -> bool:
    """decode_mode for this run's perf.decode_compile on `device`, as Decoder's compile= flag."""
    return decode_mode(torch.device(device).type, run.perf.decode_compile) == "compiled"


def inference_kv(run) -> dict:
    """`kv_format=` for the model's caches at inference (inference.kv_cache_dtype), {} for fp32 (the plain
    cache; other formats are for decoder LMs only, checked by validate)."""
    fmt = KVFormat.of(run.inference)
    return {} if fmt.dtype == "fp32" else {"kv_format": fmt}


def final_metrics(trainer, lit, dm, parts: dict, budget: dict, throughput, family) -> dict:
    """Metrics at the end of a run: the last logged values, a validation of the final weights (the last
    scheduled one may be steps earlier), throughput, budget, parameters, cache bytes and inference timing."""
    run, data_cfg = parts["run"], parts["data"]
    model = lit.model
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
    final = trainer.validate(lit, datamodule=dm, verbose=False)[0] if trainer.limit_val_batches else {}
    if final:  # best.ckpt: the final weights too, when their validation is the best of the run
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, RunCheckpoint):
                cb.consider_final_validation(trainer)
    if is_sharded(lit.model):  # FSDP: what rank 0 measures alone below needs the whole model (all ranks gather)
        unshard_for_rank_zero(lit)
    model = lit.model
    infer_dtype = precision_dtype(run.trainer.precision) if "true" in run.trainer.precision else torch.float32
    metrics.update({k: float(v) for k, v in final.items()})
    metrics.update(throughput.last)
    metrics.update({k: float(v) for k, v in budget.items() if isinstance(v, (int, float))})
    metrics["params/total"] = float(model.num_params())
    metrics["params/active"] = float(model.active_params())
    metrics["params/non_embedding"] = float(model.num_params() - embedding_params(model))  # Kaplan et al.'s N
    kv = inference_kv(run)
    metrics["cache/bytes_per_token"] = model.cache_bytes(data_cfg.seq_len, 1, infer_dtype, **kv) / data_cfg.seq_len
    if run.perf.measure_decode and trainer.is_global_zero and family.decoder_only:
        metrics.update(measure_inference(model, data_cfg.seq_len, run.perf.decode_tokens, dm.vocab_size, infer_dtype,
                                         **kv, compile=decode_compile(run, next(model.parameters()).device)))
    if kv and trainer.is_global_zero:  # the quality cost: validation through that cache vs the full forward
        # the final validation's batches (rank 0's shard under DDP), so val/loss_kvq compares with val/loss
        n = (trainer.num_val_batches or [math.inf])[0] if final else math.inf
        n = int(n) if math.isfinite(n) else run.eval.max_batches
        metrics.update(evaluate_kv_format(lit, dm.val_dataloader(), kv["kv_format"], n))
    if run.eval.context_lengths and trainer.is_global_zero and family.decoder_only:
        metrics.update(evaluate_lengths(lit, dm, data_cfg, run.eval.context_lengths, run.eval.max_batches))
        if run.perf.measure_decode:  # the cache really held after L tokens, and the decode rate there
            for L in run.eval.context_lengths:
                at = measure_inference(model, int(L), run.perf.decode_tokens, dm.vocab_size, infer_dtype,
                                       compile=decode_compile(run, next(model.parameters()).device))
                metrics.update({f"{k}@{L}": v for k, v in at.items()})
    if (run.eval.niah_depths or run.eval.niah_tasks) and trainer.is_global_zero and family.decoder_only:
        metrics.update(niah_at_the_end(lit, dm, data_cfg, run))  # the needle depth x length grid
    return metrics


def niah_at_the_end(lit, dm, data_cfg, run) -> dict:
    """The needle-in-a-haystack grid at data.seq_len and each eval.context_length, written to <run dir>/niah.json
    and niah.png (the figure attnzoo-eval --task niah makes). data=needle (eval.niah_depths): the task the run
    trained on, regenerated per cell and scored by val/acc (niah/acc@<length>@<depth>). data=text
    (eval.niah_tasks): RULER's prompts from the run's corpus in its tokens, completed greedily through the
    static-cache decoder and scored by string_match_all (niah/<task>@<length>@<depth>); attnzoo-eval's prompts."""
    from pathlib import Path

    from attnzoo.analysis.niah import needle_cells, text_cells, write
    from attnzoo.training.eval_checks import TEXT_DEPTHS, check_niah_prompts, niah_haystack, niah_lengths

    lengths = niah_lengths(run.eval, data_cfg)
    out = Path(run.paths.output_dir) / "niah.json"
    head = {"task": "niah", "checkpoint": str(out.parent / "checkpoints" / "last.ckpt"), "global_step": int(lit.global_step)}
    if not run.eval.niah_tasks:
        samples = run.eval.niah_samples or 256
        grid = needle_cells(lit, dm, data_cfg, lengths, run.eval.niah_depths, samples, data_cfg.batch_size)
        write({**head, "haystack": "data=needle (the token task the run trained on)", "samples_per_cell": samples,
               "metric": "val/acc: the needle's value tokens right after the query (teacher-forced)", **grid}, out)
        return {f"niah/acc@{L}@{d}": v for L, ds in grid["accuracy"]["needle"].items() for d, v in ds.items()}
    samples, was_training = run.eval.niah_samples or 4, lit.model.training
    text, source = niah_haystack(data_cfg)
    fits = check_niah_prompts(run.eval, data_cfg, dm.encode, text)  # as before training: each task's lengths
    grid: dict = {"new_tokens": {}, "accuracy": {}, "by_length": {}, "by_task": {}}
    lit.model.eval()
    try:
        for task, task_lengths in fits.items():
            cells = text_cells(lit.model, dm.encode, dm.decode, text, [task], task_lengths,
                               run.eval.niah_depths or TEXT_DEPTHS, samples, seed=run.seed, batch=min(samples, 8))
            for key in grid:
                grid[key][task] = cells[key] if key == "new_tokens" else cells[key][task]
    finally:
        lit.model.train(was_training)
    short = {t: [L for L in lengths if L not in fits[t]] for t in fits if len(fits[t]) < len(lengths)}
    for task, ls in short.items():
        print(f"niah: {task} left out at {', '.join(map(str, ls))} tokens (its question and needles do not fit)")
    write({**head, "haystack": source, "samples_per_cell": samples, "seed": run.seed,
           "metric": "string_match_all (RULER): the fraction of a sample's answers in its greedy completion",
           **({"too_short": short} if short else {}), **grid}, out)
    return {f"niah/{t}@{L}@{d}": v for t, ls in grid["accuracy"].items() for L, ds in ls.items() for d, v in ds.items()}

