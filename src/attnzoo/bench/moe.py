"""`attnzoo-bench moe`: forward+backward tokens/s of the MoE layer against a dense FFN of the same active
size and against the dense mask reference (every expert on every token), for several E and top-k."""
from __future__ import annotations

import torch

from attnzoo.layers.ffn import SwiGLU, SwiGLUConfig
from attnzoo.layers.moe import MoE, MoEConfig, grouped_mm_works
from attnzoo.bench.common import time_fn

HELP = "MoE layer fwd+bwd tokens/s vs same-active-size dense SwiGLU vs the dense mask reference"


QUICK = {"experts": [4, 8], "top_k": [1, 2], "d_model": 32, "hidden": 32, "tokens": 128, "min_time": 0.02,
         "repeats": 1}


def add_arguments(p) -> None:
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128, help="expert hidden size (SwiGLU)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per call (batch x seq)")
    p.add_argument("--device", default=None, help="default: cuda where a GPU is present, else cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the best round counts (noisy hosts)")
    p.add_argument("--no-reference", action="store_true", help="skip the (slow) dense mask reference")


def _fwd_bwd_tokens_per_sec(module, x, grad, *, min_time, device) -> float:
    def step():
        module.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        y = module(xx)
        y.backward(grad)

    return x.shape[0] * x.shape[1] / time_fn(step, warmup=1, min_time=min_time, device=device)


def run(args) -> dict:
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    d, h = args.d_model, args.hidden
    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, d, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    t = dict(min_time=args.min_time, device=device)
    rows = []
    for E in args.experts:
        for K in args.top_k:
            if K > E:
                continue
            moe = MoE(MoEConfig(n_experts=E, top_k=K, d_ff=h), d).to(device, dtype).train()
            loop = MoE(MoEConfig(n_experts=E, top_k=K, d_ff=h, dispatch="loop"), d).to(device, dtype).train()
            loop.load_state_dict(moe.state_dict())
            dense = SwiGLU(SwiGLUConfig(d_ff=K * h), d).to(device, dtype)  # same active FFN FLOPs (router aside)
            ref = MoE(MoEConfig(n_experts=E, top_k=K, d_ff=h), d).to(device, dtype).train()
            ref.load_state_dict(moe.state_dict())
            ref.impl = "reference"
            forms = {"moe": moe, "loop": loop, "dense": dense, **({} if args.no_reference else {"reference": ref})}
            row = {"E": E, "top_k": K, "active_hidden": K * h}
            for _ in range(args.repeats):  # interleave the forms so a slow spell of the host hits them all
                for name, module in forms.items():
                    tps = _fwd_bwd_tokens_per_sec(module, x, grad, **t)
                    row[f"{name}_tok_s"] = max(row.get(f"{name}_tok_s", 0.0), tps)
            if not args.no_reference:
                row["moe_over_reference"] = row["moe_tok_s"] / row["reference_tok_s"]
            row["moe_over_dense"] = row["moe_tok_s"] / row["dense_tok_s"]
            rows.append(row)
            print(row, flush=True)
    gmm = grouped_mm_works(device, dtype) and (d * x.element_size()) % 16 == 0 and (h * x.element_size()) % 16 == 0
    columns = ["E", "top_k", "active_hidden", "moe_tok_s", "loop_tok_s", "dense_tok_s", "reference_tok_s",
               "moe_over_dense", "moe_over_reference"]
    return {
        "title": f"MoE layer fwd+bwd tokens/s (d_model={d}, expert hidden={h}, {args.tokens} tokens, "
                 f"{args.device}, {args.dtype})",
        "columns": columns,
        "rows": rows,
        "notes": [
            f"moe: the fast dropless form (dispatch=auto -> {'torch._grouped_mm' if gmm else 'a loop over experts'}); "
            "loop: the same with dispatch=loop; dense: a SwiGLU of hidden top_k * expert hidden (the MoE's "
            "active FFN size); reference: impl=reference (every expert on every token, masked). Each includes "
            "the router, the aux/z losses and the routing statistics; tokens/s counts forward + backward; "
            f"each figure is the best of {args.repeats} interleaved rounds of the median call time.",
        ],
    }
