"""`attnzoo-bench hf`: attnzoo vs transformers' LlamaForCausalLM on the same architecture and weights.

GQA + RoPE + SwiGLU + RMSNorm, pre-norm, untied head, identical sizes; HF's weights are copied into ours
(fused [q|k|v] and [gate|up]) and the fp32 logits are checked to agree before anything is timed.
Measured side by side, interleaved round by round so background load hits both alike:
- train: forward + backward + AdamW step on (batch, seq) random tokens, fp32 and bf16 autocast;
- prefill: a no-grad forward that fills a fresh KV cache, fp32 and bf16 autocast;
- decode: greedy `generate()` with the cache after a prompt of each context length, both libraries;
  tokens/s = (N - 1) / (t(N new tokens) - t(1 new token)), so the prompt's prefill cancels.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

HELP = "attnzoo vs transformers LlamaForCausalLM (same weights): train / prefill tokens/s fp32+bf16, generate() decode"


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per measurement (after one warm-up)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="decode prompt lengths")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per decode measurement")
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")
    p.add_argument("--compile", action="store_true",
                   help="add train / prefill rows with both models under torch.compile (inductor; fp32 and bf16)")


def quick(args) -> None:
    args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.d_ff, args.vocab = 32, 2, 4, 2, 64, 97
    args.seq_len, args.batch, args.rounds, args.contexts, args.new_tokens = 32, 2, 1, [16, 32], 4


def build_pair(args):
    """(ours, hf) in eval mode with identical weights (HF's random init copied into ours)."""
    import transformers

    from attnzoo.models.decoder import DecoderLM

    ours = DecoderLM({
        "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
        "tie_embeddings": False, "mixer": {"name": "gqa"}, "ffn": {"name": "swiglu", "d_ff": args.d_ff},
        "norm": {"name": "rmsnorm", "eps": 1e-6}, "position": {"name": "rope", "theta": 10000.0},
        "max_seq_len": max(args.contexts) + args.new_tokens + 8,
    }, vocab_size=args.vocab)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=max(args.contexts) + args.new_tokens + 8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "sdpa"  # HF's default and fastest CPU path
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    hf.generation_config.eos_token_id = None  # both run the full length
    copy_weights(ours, hf)
    return ours.eval(), hf.eval()


@torch.no_grad()
def copy_weights(ours, hf) -> None:
    base = hf.model
    ours.embed.weight.copy_(base.embed_tokens.weight)
    ours.norm.weight.copy_(base.norm.weight)
    ours.lm_head.weight.copy_(hf.lm_head.weight)
    for block, layer in zip(ours.blocks, base.layers):
        a, mlp = layer.self_attn, layer.mlp
        block.norm1.weight.copy_(layer.input_layernorm.weight)
        block.norm2.weight.copy_(layer.post_attention_layernorm.weight)
        block.mixer.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dim=0))
        block.mixer.o_proj.weight.copy_(a.o_proj.weight)
        block.ffn.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0))
        block.ffn.down.weight.copy_(mlp.down_proj.weight)


def autocast(dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()


def logits_of(model, idx):
    out = model(idx)
    return out if torch.is_tensor(out) else out.logits


def train_step_fn(model, idx, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)

    def step():
        with autocast(dtype):
            logits = logits_of(model, idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def prefill_fn(model, idx, dtype, is_hf: bool):
    @torch.inference_mode()
    def prefill():
        with autocast(dtype):
            if is_hf:
                model(input_ids=idx, use_cache=True)
            else:
                model(idx, cache=model.new_cache(idx.shape[0], idx.shape[1]))

    return prefill


def generate_fn(model, prompt, n: int, is_hf: bool):
    @torch.inference_mode()
    def gen():
        if is_hf:
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return model.generate(prompt, n, temperature=0.0)

    return gen


def interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds per call of each fn; one untimed warm-up each, then `rounds` rounds visiting all."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def run(args) -> dict:
    if args.quick:
        quick(args)
    ours, hf = build_pair(args)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    with torch.no_grad():
        parity = (logits_of(ours, idx[:1, :64]) - logits_of(hf, idx[:1, :64])).abs().max().item()
    rows = []
    tokens = args.batch * args.seq_len
    models = {"attnzoo": (ours, False), "transformers": (hf, True)}
    variants = [False, True] if getattr(args, "compile", False) else [False]
    for compiled in variants:
        # compiled: each library's model under torch.compile (what compile=true does for attnzoo's training
        # forward); the eager row is the same model without it. Compile time is not in the timings (warm-up).
        runs = {name: (torch.compile(m) if compiled else m, m, is_hf) for name, (m, is_hf) in models.items()}
        for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            for phase in ("prefill", "train"):
                fns = {}
                for name, (fn_model, m, is_hf) in runs.items():
                    m.train(phase == "train")
                    fns[name] = train_step_fn(fn_model, idx, dtype) if phase == "train" else \
                        prefill_fn(fn_model, idx[:, :-1], dtype, is_hf)
                t = interleaved(fns, args.rounds)
                rows.append(_row(f"{phase} {label}" + (" compiled" if compiled else ""),
                                 f"batch {args.batch} x seq {args.seq_len}", tokens / t["attnzoo"],
                                 tokens / t["transformers"]))
        if compiled:
            torch._dynamo.reset()
    ours.eval(), hf.eval()
    for ctx in args.contexts:
        prompt = torch.randint(0, args.vocab, (1, ctx), generator=g)
        fns = {}
        for name, (m, is_hf) in models.items():
            fns[name + "/1"] = generate_fn(m, prompt, 1, is_hf)
            fns[name + "/N"] = generate_fn(m, prompt, args.new_tokens, is_hf)
        t = interleaved(fns, args.rounds)
        rate = {name: (args.new_tokens - 1) / max(t[name + "/N"] - t[name + "/1"], 1e-9) for name in models}
        same = bool(torch.equal(fns["attnzoo/N"](), fns["transformers/N"]()))
        rows.append(_row("decode fp32", f"context {ctx}, {args.new_tokens} new, greedy", rate["attnzoo"],
                         rate["transformers"], same_tokens="yes" if same else "NO", context=ctx))
    plot = plot_decode(rows, Path(args.out) / "hf.png") if getattr(args, "out", None) else None
    notes = [
        f"model: d_model={args.d_model} n_layers={args.n_layers} heads={args.n_heads}/{args.n_kv_heads}kv d_ff={args.d_ff} "
        f"vocab={args.vocab}; transformers LlamaForCausalLM (sdpa attention) with identical weights; "
        f"max |logits difference| fp32 = {parity:.2e}; threads={torch.get_num_threads()}.",
        "train = forward + backward + grad clip + AdamW step; prefill = no-grad forward filling a KV cache; "
        "bf16 = torch.autocast(bfloat16) around fp32 weights for both libraries.",
    ]
    if plot:
        notes.append(f"![decode tokens/s vs context]({plot.name})")
    return {"title": "attnzoo vs transformers LlamaForCausalLM (same architecture, same weights)",
            "columns": ["measure", "context", "shape", "attnzoo tokens/s", "transformers tokens/s", "attnzoo / transformers",
                        "same tokens"],
            "rows": rows, "notes": notes}


def _row(measure, shape, ours, theirs, same_tokens=None, context=None) -> dict:
    return {"measure": measure, "context": context, "shape": shape, "attnzoo tokens/s": ours, "transformers tokens/s": theirs,
            "attnzoo / transformers": ours / theirs, "same tokens": same_tokens}


def plot_decode(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    dec = [r for r in rows if r["context"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("attnzoo tokens/s", "attnzoo generate()"), ("transformers tokens/s", "transformers generate()")):
        ax.plot([r["context"] for r in dec], [r[key] for r in dec], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode tokens/s (batch 1, greedy)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
