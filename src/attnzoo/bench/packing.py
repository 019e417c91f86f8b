"""`attnzoo-bench packing`: training throughput in real (non-padding) tokens/s on the embedded corpus's documents,
packed with document masks (data.packing) against one document per row padded (data.pad_documents), and the plain
stream without masks (documents run together: what the masks cost). Each layout trains the same model on its
first batches through LitLM's loss (forward, backward, AdamW step); all layouts see the same documents and
predict the same targets, so real tokens/s is the fair comparison."""
from __future__ import annotations

import time

import torch

from attnzoo.bench.common import sync, windowed
from attnzoo.config.registry import MIXERS
from attnzoo.mixers.base import HF_LINEAR_ATTENTION

HELP = "packed documents (document masks) vs padded documents vs the plain stream: real tokens/s in training"

QUICK = {"mixers": ["gqa", "gated_deltanet"], "seq_len": [64], "batch_size": 2, "d_model": 32, "layers": 1,
         "steps": 2, "max_chars": 60_000, "vocab_size": 300}

LAYOUTS = {"packed": {"packing": True}, "padded": {"pad_documents": True}, "stream": {}}


def add_arguments(p) -> None:
    p.add_argument("--mixers", nargs="+", default=["gqa", "gated_deltanet", "sliding_window"])
    p.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed training steps per layout (after 2 warm-up steps)")
    p.add_argument("--max-chars", type=int, default=2_000_000, help="corpus characters (the default corpus)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--cache-dir", default="~/.cache/attnzoo")
    p.add_argument("--device", default=None, help="default: cuda where a GPU is present, else cpu")
    p.add_argument("--compile", action="store_true", help="the model under torch.compile (compile=true), every layout")


def _data(layout: str, seq_len: int, args):
    from attnzoo.data.text import TextDataConfig, TextDataModule

    cfg = TextDataConfig(max_chars=args.max_chars, vocab_size=args.vocab_size, seq_len=seq_len,
                         batch_size=args.batch_size, **LAYOUTS[layout])
    dm = TextDataModule(cfg, cache_dir=args.cache_dir, seed=0)
    dm.setup()
    return dm


def _batches(dm, n: int, device):
    loader = dm.train_dataloader()
    out = []
    for batch in loader:
        out.append(tuple(t.to(device) for t in batch))
        if len(out) == n:
            break
    return out


def _lit(mixer: str, seq_len: int, vocab: int, args):
    from attnzoo.training.lit_lm import LitLM

    model = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": max(1, args.d_model // 64),
             "n_kv_heads": max(1, args.d_model // 128), "mixer": {"name": mixer}, "max_seq_len": seq_len}
    if windowed(mixer):
        model["mixer"]["window"] = min(256, seq_len // 2)
    if MIXERS.get(mixer).cls.hf_layer == HF_LINEAR_ATTENTION:  # Gated DeltaNet at Qwen3-Next's head size, 128
        model["n_heads"] = model["n_kv_heads"] = max(1, args.d_model // 128)
    torch.manual_seed(0)
    return LitLM({"model": model, "trainer": {"max_steps": 10}}, vocab_size=vocab).to(args.device)


def _step(lit, opt, batch, device) -> tuple[float, float]:
    """One training step (LitLM's loss, backward, AdamW): (seconds, loss)."""
    sync(device)
    t0 = time.perf_counter()
    loss = lit._loss(batch)[0]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0, float(loss.detach())


def _interleaved(runs: dict, device) -> dict:
    """runs: layout -> (lit, batches). Two warm-up steps each, then the timed steps round-robin over the layouts
    (a drift in the machine's speed touches every layout alike). layout -> (seconds, real tokens, mean loss)."""
    opts = {name: torch.optim.AdamW(lit.parameters(), lr=1e-3) for name, (lit, _) in runs.items()}
    out = {name: [0.0, 0, []] for name in runs}
    n = min(len(b) for _, b in runs.values())
    for i in range(n):
        for name, (lit, batches) in runs.items():
            seconds, loss = _step(lit, opts[name], batches[i], device)
            if i >= 2:  # warm-up: the first two steps
                out[name][0] += seconds
                out[name][1] += lit.tokens_in_batch(batches[i])
                out[name][2].append(loss)
    return {name: (s, t, sum(losses) / max(1, len(losses))) for name, (s, t, losses) in out.items()}


def run(args) -> dict:
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(args.device)
    rows = []
    for seq_len in args.seq_len:
        data = {layout: _data(layout, seq_len, args) for layout in LAYOUTS}
        batches = {layout: _batches(dm, args.steps + 2, device) for layout, dm in data.items()}
        for mixer in args.mixers:
            rates, runs = {}, {}
            for layout, dm in data.items():
                lit = _lit(mixer, seq_len, dm.vocab_size, args)
                if args.compile:
                    lit.compile_model()
                runs[layout] = (lit, batches[layout])
            measured = _interleaved(runs, device)
            for layout, dm in data.items():
                seconds, tokens, loss = measured[layout]
                rows_per_epoch = len(dm.train_set)
                real = sum(int(dm.train_set[i][3].sum()) for i in range(rows_per_epoch)) if layout == "padded" \
                    else rows_per_epoch * seq_len
                rates[layout] = tokens / seconds
                rows.append({"mixer": mixer, "seq_len": seq_len, "layout": layout, "rows/epoch": rows_per_epoch,
                             "padding %": 100.0 * (1 - real / (rows_per_epoch * seq_len)),
                             "real tokens/s": tokens / seconds, "epoch s (est.)": real / (tokens / seconds),
                             "loss": loss})
            for r in rows[-len(LAYOUTS):]:
                r["vs padded"] = rates[r["layout"]] / rates["padded"]
    return {
        "title": "Sequence packing: real tokens/s, packed documents vs padded documents vs the plain stream",
        "columns": ["mixer", "seq_len", "layout", "rows/epoch", "padding %", "real tokens/s", "vs padded",
                    "epoch s (est.)", "loss"],
        "rows": rows,
        "notes": [f"d_model {args.d_model}, {args.layers} layers, batch {args.batch_size}, {args.steps} timed steps "
                  f"after 2 warm-up steps, the layouts' steps interleaved, device {args.device}, {args.max_chars:,} corpus characters"
                  f"{', torch.compile' if args.compile else ''}. packed: "
                  "document masks (attention block-diagonal, recurrent state reset per document); padded: one "
                  "document per row, padded; stream: the documents run together, no masks (what the masks cost). "
                  "epoch s = the layout's real tokens in one epoch / its real tokens/s. loss: the mean training loss "
                  "over the timed steps (different batches per layout: a sanity check, not a comparison)."],
    }
