"""`attnzoo-bench decode`: decode tokens/s by mixer x context x batch, eager and compiled, against the bytes a step
must read (weights + the cache at that context) and the machine's measured memory bandwidth; transformers' static
cache + torch.compile as the peer on the Llama-shaped model (gqa, same weights).

Each measurement is `Decoder.decode_rate`'s loop (attnzoo.models.decoding): greedy steps of every row through the
static cache, timed after one untimed step (the compile). The cache is put at the context directly: its tensors
filled with random values and every row's position set to the context (a decode step reads the same bytes whatever
the values; a real prefill of 8 rows x 8k tokens would cost minutes). A mixer whose static cache does not grow with
its length (a state, a window's ring) keeps one decoder, one compile, for every context.

bytes / token = (weights read by a step + batch x the cache bytes a step reads at the context) / batch: every
parameter but the embedding table (one row of it), and `decode_read_bytes(context)` per row (the whole cache,
`cache_bytes`, for every mixer but NSA / MoBA, whose steps gather their selected blocks; full attention's static
cache reads its padded slots too, max_len = context + steps + 2). roofline tokens/s = bandwidth / bytes per
token, the bandwidth measured here (torch.sum over 256 MiB, best of 5, all threads).

The attainable roofline: a decode step is matrix-vector products over the weights (and, for attention, over the
cache), so it can read no faster than torch's own GEMV does here. `gemv_bandwidth` times plain `F.linear` over
every matrix of the same model, one after another, `batch` vectors each (nothing else: no attention, no norms, no
Python between them beyond one call per matrix): GEMV roofline tokens/s = that bandwidth / bytes per token. The
ratio to it says how much of a step is the mixer's reads and how much is overhead, whatever the CPU's GEMV kernel
reaches of the memory bandwidth.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.bench.common import sync, windowed
from attnzoo.models.decoding import Decoder, untimed_steps
from attnzoo.models.decoder import DecoderLM

HELP = "decode tokens/s by mixer x context x batch: bytes per token, %% of the memory roofline, eager vs compiled, vs transformers"

QUICK = {"mixers": ["gqa", "gated_deltanet"], "contexts": [32, 64], "batches": [1, 2], "d_model": 64, "n_layers": 2,
         "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "vocab": 256, "steps": 4, "bandwidth_mib": 16}


def add_arguments(p) -> None:
    p.add_argument("--mixers", nargs="+", default=["gqa", "mla", "sliding_window", "gated_deltanet", "rwkv7"])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=1408, help="SwiGLU hidden width (Llama's 8/3 d_model, rounded up to 64)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--window", type=int, default=512, help="sliding_window's W")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement (best of 3 runs)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--no-peer", action="store_true", help="skip transformers (static cache + compile)")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer read to measure the memory bandwidth")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of both sides (tests: eager)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (compiled with mode=reduce-overhead: CUDA graphs)")


def check(args) -> None:
    """Before any work: known mixers with a static cache, positive sizes (one line each)."""
    from attnzoo.config.errors import ConfigError

    for flag in ("contexts", "batches"):
        bad = [v for v in getattr(args, flag) if v < 1]
        if bad:
            raise ConfigError(f"got {bad[0]}; allowed: integers >= 1", field=f"--{flag}")
    if args.steps < 1:
        raise ConfigError(f"must be >= 1, got {args.steps}", field="--steps")
    from attnzoo.inference.generate import check_device

    check_device(args.device)
    for mixer in args.mixers:
        missing = model_for(args, mixer, meta=True).static_cache_missing()  # an unknown name: the registry's line
        if missing:
            raise ConfigError(f"{mixer} has no static cache yet; allowed: mixers with one (docs/inference.md)",
                              field="--mixers")


def model_for(args, mixer: str, meta: bool = False) -> DecoderLM:
    torch.manual_seed(0)
    cfg = {"name": mixer, **({"window": args.window} if windowed(mixer) else {})}
    if meta:  # the shape only
        with torch.device("meta"):
            return _model(args, cfg)
    return _model(args, cfg).to(args.device)


def _model(args, cfg: dict) -> DecoderLM:
    return DecoderLM({"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
                      "n_kv_heads": args.n_kv_heads, "mixer": cfg, "ffn": {"name": "swiglu", "d_ff": args.d_ff}, "tie_embeddings": False,
                      "max_seq_len": max(args.contexts) + args.steps + 8}, vocab_size=args.vocab).eval()


def bandwidth(mib: int, device="cpu") -> float:
    """Bytes/s reading `mib` MiB (torch.sum, all threads, best of 5)."""
    buf = torch.ones(mib * 2 ** 18, device=device)  # fp32
    buf.sum()
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        buf.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def gemv_bandwidth(model, batch: int, device="cpu", reps: int = 5) -> float:
    """Bytes/s torch reads `model`'s matrices at when each multiplies `batch` vectors: F.linear over every nn.Linear
    weight (the LM head included), one after another, best of `reps` (module docstring)."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    xs = [torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    for x, w in zip(xs, weights):
        F.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for x, w in zip(xs, weights):
            F.linear(x, w)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return sum(w.numel() * w.element_size() for w in weights) / best


def weight_bytes(model) -> int:
    """Bytes of parameters a decode step reads: all but the embedding table, of which one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed.weight
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def grows(model) -> bool:
    """The static cache's buffers grow with max_len (full attention), or not (a state, a ring)."""
    a, b = (model.new_static_cache(1, n, torch.float32, "meta").allocated_bytes() for n in (64, 128))
    return a != b


def seek(dec: Decoder, context: int) -> None:
    """Every row at position `context`, the cache's tensors random (a decode reads them whatever they hold)."""
    g = torch.Generator(device=dec.cache.pos.device).manual_seed(0)
    for c in dec.cache.layers:
        for t in c.tensors():
            t.copy_(0.02 * torch.randn(t.shape, generator=g, dtype=t.dtype, device=t.device))
    dec.cache.pos.fill_(context)


def rate(dec: Decoder, context: int, steps: int) -> float:
    """Best of 3 runs of `steps` greedy steps from `context` (one untimed step first)."""
    dev = dec.cache.pos.device
    tok = torch.zeros(dec.batch, 1, dtype=torch.long, device=dev)
    seek(dec, context)
    for _ in range(untimed_steps(dev.type)):  # CUDA graphs are recorded on the second call
        dec._step(tok, None, None, None, None)
    best = float("inf")
    for _ in range(3):
        seek(dec, context)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = dec._step(tok, None, None, None, None)[0]
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return dec.batch * steps / best


def peer_rate(args, context: int, steps: int) -> tuple[float, float]:
    """(ours compiled, transformers static cache + torch.compile) tokens/s at batch 1 on the same Llama weights."""
    from transformers import StaticCache

    from attnzoo.bench.hf import build_pair

    shape = SimpleNamespace(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                            n_kv_heads=args.n_kv_heads, d_ff=args.d_ff,
                            vocab=args.vocab, contexts=[context], new_tokens=steps + 8)
    ours, hf = (m.to(args.device) for m in build_pair(shape))
    max_len = context + steps + 2
    ours_rate = rate(Decoder(ours, 1, max_len, backend=args.backend), context, steps)
    cache = StaticCache(config=hf.config, max_cache_len=max_len)
    mode = "reduce-overhead" if torch.device(args.device).type == "cuda" and args.backend == "inductor" else None
    fwd = torch.compile(hf.forward, fullgraph=True, backend=args.backend, mode=mode)  # as ours: CUDA graphs on a GPU

    def hf_step(tok, pos):
        out = fwd(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        dev = args.device
        tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        hf_step(tok, torch.tensor([context], device=dev))
        best = float("inf")
        for _ in range(3):
            sync(dev)
            t0 = time.perf_counter()
            for i in range(steps):
                tok = hf_step(tok, torch.tensor([context + i], device=dev))
            sync(dev)
            best = min(best, time.perf_counter() - t0)
    return ours_rate, steps / best


@torch.no_grad()
def run(args) -> dict:
    check(args)
    bw = bandwidth(args.bandwidth_mib, args.device)
    modes = [("eager", False)] + ([] if args.no_compile else [("compiled", True)])
    rows, failures = [], []
    for mixer in args.mixers:
        model = model_for(args, mixer)
        w = weight_bytes(model)
        per_context = grows(model)
        for batch in args.batches:
            shared = {}
            gemv = gemv_bandwidth(model, batch, args.device)
            for context in args.contexts:
                cache_b = model.cache_bytes(context, 1, torch.float32)
                bpt = (w + batch * model.decode_read_bytes(context, 1, torch.float32)) / batch
                row = {"mixer": mixer, "context": context, "batch": batch, "weights MB": w / 1e6,
                       "cache MB/row": cache_b / 1e6, "bytes/token MB": bpt / 1e6, "roofline tok/s": bw / bpt,
                       "GEMV GB/s": gemv / 1e9, "GEMV roofline tok/s": gemv / bpt}
                for name, comp in modes:
                    max_len = context + args.steps + 2 if per_context else max(args.contexts) + args.steps + 2
                    dec = shared.get(name) if not per_context else None
                    if dec is None:
                        dec = Decoder(model, batch, max_len, compile=comp, backend=args.backend)
                        shared[name] = dec
                    row[f"{name} tok/s"] = rate(dec, context, args.steps)
                    if comp and not dec.compiled:  # the compiler failed on this shape: the decoder ran eagerly
                        row[f"{name} tok/s"] = None
                        failures.append(f"{mixer}, context {context}, batch {batch}: {dec.path}")
                        continue
                    row[f"{name} % roofline"] = 100 * row[f"{name} tok/s"] / row["roofline tok/s"]
                    row[f"{name} % GEMV roofline"] = 100 * row[f"{name} tok/s"] / row["GEMV roofline tok/s"]
                if len(modes) == 2 and row.get("compiled tok/s"):
                    row["compiled / eager"] = row["compiled tok/s"] / row["eager tok/s"]
                rows.append(row)
    peers = []
    if not args.no_peer and not args.no_compile:
        for context in args.contexts:
            try:
                ours, theirs = peer_rate(args, context, args.steps)
            except Exception as e:  # either compiler failing on a shape: reported, the rest still runs
                failures.append(f"peer at context {context}: {type(e).__name__}: "
                                f"{str(e).strip().splitlines()[-1][:160]}")
                continue
            peers.append({"context": context, "attnzoo compiled tok/s": ours, "transformers static+compile tok/s": theirs,
                          "attnzoo / transformers": ours / theirs})
    cols = ["mixer", "context", "batch", "weights MB", "cache MB/row", "bytes/token MB", "roofline tok/s", "GEMV GB/s",
            "GEMV roofline tok/s", "eager tok/s", "eager % roofline", "eager % GEMV roofline"]
    if len(modes) == 2:
        cols += ["compiled tok/s", "compiled % roofline", "compiled % GEMV roofline", "compiled / eager"]
    notes = [f"Memory bandwidth {bw / 1e9:.2f} GB/s (torch.sum over {args.bandwidth_mib} MiB, {torch.get_num_threads()} "
             f"threads). Model: d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads ({args.n_kv_heads} "
             f"KV), SwiGLU {args.d_ff}, vocab {args.vocab}, fp32; sliding_window W={args.window}. Best of 3 x {args.steps} steps. "
             f"GEMV GB/s: plain F.linear over every matrix of the row's model, `batch` vectors each (the attainable "
             f"roofline: module docstring of attnzoo/bench/decode.py)."]
    if peers:
        from attnzoo.bench.cli import markdown_table

        notes.append("Peer (gqa, batch 1, same weights): transformers LlamaForCausalLM, StaticCache + torch.compile "
                     "(fullgraph) of its forward, vs attnzoo's compiled decoder:\n\n"
                     + markdown_table(list(peers[0]), peers))
    if failures:
        notes.append("Not compiled (the row's other figures stand): " + "; ".join(failures))
    plot = plot_decode(rows, Path(args.out) / "decode.png") if getattr(args, "out", None) else None
    if plot:
        notes.append(f"![decode tokens/s vs context]({plot.name})")
    return {"title": "Decode tokens/s: static cache, eager vs compiled, against the memory roofline",
            "columns": cols, "rows": rows, "peers": peers, "bandwidth_bytes_per_sec": bw, "failures": failures,
            "notes": notes}


def plot_decode(rows: list, path: Path) -> Path:
    """tokens/s (batch 1, the fastest mode) and bytes per token against the context, one line per mixer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    batch = min(r["batch"] for r in rows)
    for mixer in dict.fromkeys(r["mixer"] for r in rows):
        mine = [r for r in rows if r["mixer"] == mixer and r["batch"] == batch]
        key = "compiled tok/s" if all(r.get("compiled tok/s") for r in mine) else "eager tok/s"
        ctx = [r["context"] for r in mine]
        a.plot(ctx, [r[key] for r in mine], marker="o", label=f"{mixer} ({key.split()[0]})")
        b.plot(ctx, [r["bytes/token MB"] for r in mine], marker="o", label=mixer)
    for ax, label in ((a, f"decode tokens/s (batch {batch})"), (b, "MB read per token (weights + cache)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    b.set_yscale("log")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
