"""Length extrapolation: the trained model evaluated at context lengths other than the training length.

`eval.context_lengths=[128,256,512]` makes every run log, at each length L,
  val/loss@L, val/ppl@L   the validation text cut into L-token blocks (text), or the synthetic task
                          generated at length L with the same settings and seed (MQAR keeps its N pairs,
                          so only the distances between a key and its query grow)
  val/acc@L               synthetic tasks: accuracy on the answer positions
  cache/bytes_at_ctx@L    the inference cache after L tokens (the mixers' analytic bytes, equal to the
                          measured ones: tests/test_mixers_contract.py)
over at most `eval.max_batches` batches of `data.batch_size * data.seq_len / L` sequences (the same number
of tokens per batch as training). Decoder LMs only.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import DataLoader

from .errors import ConfigError


def loader_at(dm, data_cfg, length: int) -> DataLoader:
    batch = max(1, data_cfg.batch_size * data_cfg.seq_len // length)
    if hasattr(dm, "val_ids"):  # text: the held-out tokens in blocks of `length`
        from .data.text import Blocks

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
def evaluate_loader(lit, loader, max_batches: int | None = None) -> dict:
    """val/loss, val/ppl (and val/acc when batches carry answer masks) of a decoder LM's LightningModule
    over a loader, as its validation computes them; `tokens`: the positions counted."""
    was_training = lit.model.training
    lit.model.eval()
    total = count = correct = 0.0
    has_mask = False
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = [b.to(lit.device).long() if b.dtype != torch.bool else b.to(lit.device) for b in batch]
            _, t, c, logits = lit._loss(batch, return_logits=True)
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
