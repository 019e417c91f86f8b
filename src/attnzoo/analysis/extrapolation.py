"""Length extrapolation: the trained model evaluated at context lengths other than the training length.

`eval.context_lengths=[128,256,512]` makes every run log, at each length L,
  val/loss@L, val/ppl@L   the validation text cut into L-token blocks (text), or the synthetic task
                          generated at length L with the same settings and seed (MQAR keeps its N pairs,
                          so only the distances between a key and its query grow)
  val/acc@L               synthetic tasks: accuracy on the answer positions
  cache/bytes_at_ctx@L    the inference cache after L tokens (the mixers' analytic bytes, equal to the
                          measured ones: tests/test_mixers_contract.py; measured after a real prefill of
                          L tokens when perf.measure_decode is on)
  perf/decode_tokens_per_sec@L   batch-1 greedy decode rate after that prefill (perf.measure_decode)
over at most `eval.max_batches` batches of `data.batch_size * data.seq_len / L` sequences (the same number
of tokens per batch as training). Decoder LMs only.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import DataLoader

from attnzoo.config.errors import ConfigError


def loader_at(dm, data_cfg, length: int) -> DataLoader:
    batch = max(1, data_cfg.batch_size * data_cfg.seq_len // length)
    if hasattr(dm, "val_ids"):  # text: the held-out tokens in blocks of `length`
        from attnzoo.data.text import Blocks

        blocks = Blocks(dm.val_ids, length)
        if len(blocks) == 0:
            raise ConfigError(f"the validation text has {len(dm.val_ids)} tokens, too few for one {length}-token "
                              f"block; allowed: lengths < {len(dm.val_ids)}", field="eval.context_lengths")
        return DataLoader(blocks, batch_size=batch, shuffle=False)
    # a synthetic task at another length: a fresh module with seq_len = length (a minimal train split: the
    # model was never trained at this length, so only the validation stream matters)
    cfg = dataclasses.replace(data_cfg, seq_len=length, train_size=data_cfg.batch_size)
    other = type(dm)(cfg, cache_dir=getattr(dm, "cache_dir", "~/.cache/attnzoo"), seed=dm.seed)
    other.setup("validate")
    return DataLoader(other.val_set, batch_size=batch, shuffle=False)


@torch.no_grad()
def evaluate_loader(lit, loader, max_batches: int | None = None, kv_format=None) -> dict:
    """val/loss, val/ppl (and val/acc when batches carry answer masks) of a decoder LM's LightningModule
    over a loader, as its validation computes them; `tokens`: the positions counted. With `kv_format`
    (attnzoo.mixers.kv_quant.KVFormat) the logits come through a cache in that format, teacher-forced in the calls
    that make every token see the cache as one-token decoding would (`kv_quant.logits_through_cache`)."""
    from attnzoo.mixers.kv_quant import logits_through_cache

    was_training = lit.model.training
    lit.model.eval()
    total = count = correct = 0.0
    has_mask = False
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = [b.to(lit.device).long() if b.dtype != torch.bool else b.to(lit.device) for b in batch]
            cached = None if kv_format is None else logits_through_cache(lit.model, batch[0], kv_format)
            _, t, c, logits = lit._loss(batch, return_logits=True, logits=cached)
            ok = logits.argmax(-1) == batch[1]
            if len(batch) > 2:
                has_mask = True
                ok = ok & batch[2]
            total, count, correct = total + float(t), count + float(c), correct + float(ok.sum())
    finally:
        lit.model.train(was_training)
    loss = total / max(count, 1.0)
    out = {"val/loss": loss, "val/ppl": float(torch.exp(torch.tensor(min(loss, 50.0)))), "tokens": count}
    if has_mask:
        out["val/acc"] = correct / max(count, 1.0)
    return out


def evaluate_lengths(lit, dm, data_cfg, lengths, max_batches: int = 8) -> dict:
    out: dict = {}
    for length in lengths:
        res = evaluate_loader(lit, loader_at(dm, data_cfg, int(length)), max_batches)
        out.update({f"{k}@{length}": v for k, v in res.items() if k != "tokens"})
        out[f"cache/bytes_at_ctx@{length}"] = float(lit.model.cache_bytes(int(length)))
    return out


def evaluate_kv_format(lit, loader, kv_format, max_batches: int | None = None) -> dict:
    """The quality cost of a KV-cache format: val/loss_kvq (and val/acc_kvq) through a cache in `kv_format`,
    and its difference from the full forward over the same batches, which equals the full-precision cache
    (cached == full forward: tests/test_mixers_contract.py): val/loss_kvq_delta = loss_kvq - loss."""
    ref = evaluate_loader(lit, loader, max_batches)
    got = evaluate_loader(lit, loader, max_batches, kv_format=kv_format)
    out = {"val/loss_kvq": got["val/loss"], "val/loss_kvq_delta": got["val/loss"] - ref["val/loss"]}
    if "val/acc" in got:
        out.update({"val/acc_kvq": got["val/acc"], "val/acc_kvq_delta": got["val/acc"] - ref["val/acc"]})
    return out
