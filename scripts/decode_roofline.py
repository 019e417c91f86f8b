"""Decode memory roofline of the `attnzoo-bench hf` model (docs/benchmarks.md): bytes a one-token step must read
(weights except the embedding table, plus the KV cache at context L) over the stream read bandwidth measured
here (best of 5 sums of a 256 MiB buffer), against decode tokens/s measured by `attnzoo-bench hf`.

    .venv/bin/python scripts/decode_roofline.py
"""
import time, torch
from attnzoo.models.decoder import DecoderLM
torch.set_num_threads(2)
m = DecoderLM({"d_model": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "tie_embeddings": False, "mixer": {"name": "gqa"},
               "ffn": {"name": "swiglu", "d_ff": 1376}, "max_seq_len": 9000}, vocab_size=2048)
params = sum(p.numel() for p in m.parameters()) - m.embed.weight.numel()  # a decode step reads one embedding row
# stream bandwidth: a read of a large buffer (sum) and a copy, best of 5
x = torch.randn(64 * 2**20 // 4 * 4)  # 256 MiB fp32
y = torch.empty_like(x)
best_read = best_copy = 0
for _ in range(5):
    t0 = time.perf_counter(); x.sum(); dt = time.perf_counter() - t0; best_read = max(best_read, x.numel() * 4 / dt)
    t0 = time.perf_counter(); y.copy_(x); dt = time.perf_counter() - t0; best_copy = max(best_copy, 2 * x.numel() * 4 / dt)
print(f"params read per token {params:,} ({params*4/2**20:.1f} MiB fp32); read bw {best_read/1e9:.1f} GB/s, copy bw {best_copy/1e9:.1f} GB/s")
for L, tps in [(512, 151.7), (2048, 207.9), (8192, 138.9)]:
    cache = m.cache_bytes(L)
    bytes_tok = params * 4 + cache
    print(L, f"cache {cache/2**20:.1f} MiB, bytes/token {bytes_tok/2**20:.1f} MiB, roofline {best_read/bytes_tok:.0f} tok/s, measured {tps} = {tps*bytes_tok/best_read*100:.0f}% of read bw")
