"""The softmax-attention zoo: MHA/GQA/MQA, sliding window, MLA — caches, decode, memory and FLOPs accounting."""
from __future__ import annotations

import pytest
import torch

from attnzoo.mixers.attention import SlidingWindowCache
from attnzoo.mixers.mla import LatentCache
from attnzoo.config.schema import ConfigError, resolve_model
from attnzoo.mixers.attention import Attention, SlidingWindowAttention, decode_sdpa
from attnzoo.mixers.base import causal_attended
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.attention import attention_mask, attention_reference
from attnzoo.ops.sliding_window import sliding_window_sdpa
from attnzoo.config.registry import MIXERS

W = 4  # small window so every test crosses it
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
MIXER_CASES = {
    "mha": {"name": "mha"},
    "gqa": {"name": "gqa"},
    "mqa": {"name": "mqa"},
    "swa-W4": {"name": "sliding_window", "window": W},
    "swa-W1": {"name": "sliding_window", "window": 1},
    "mla": {"name": "mla"},
    "mla-qlora-interleave": {"name": "mla", "q_lora_rank": 16, "rope_interleave": True},
    "mla-absorb-always": {"name": "mla", "absorb": "always"},
}
HYBRID = {  # 3 local : 1 global, plus MLA, in one stack
    "n_layers": 4,
    "pattern": ["local", "local", "global", "latent"],
    "mixers": {"local": {"name": "sliding_window", "window": W}, "global": {"name": "gqa"}, "latent": {"name": "mla"}},
}
MODEL_CASES = {**{k: {**TINY, "mixer": v} for k, v in MIXER_CASES.items()}, "hybrid": {**TINY, **HYBRID}}


def tiny_model(case: str, dtype=torch.float32, **extra) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM({**MODEL_CASES[case], **extra}, vocab_size=61).to(dtype).eval()
    with torch.no_grad():  # widen the 0.02 init so attention patterns are far from uniform
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def mixer_layer(mixer: dict, dtype=torch.float64, **model_extra):
    model_cfg = resolve_model({**TINY, "mixer": mixer, **model_extra})
    torch.manual_seed(0)
    layer = MIXERS.get(mixer["name"]).cls(model_cfg.mixer, model_cfg, 0).to(dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return layer


# ----------------------------------------------------------------------------- decode == full forward


@pytest.mark.parametrize("prompt", [1, 5, 11], ids=lambda p: f"prompt{p}")
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_prefill_then_decode_equals_full_forward(case, prompt):
    # float64: the forms differ only in summation order (fp32 rounding of logits ~2 reaches 1e-5)
    model = tiny_model(case, torch.float64)
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(2, 16, torch.float64)
        steps = [model(idx[:, :prompt], cache=cache)]
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(prompt, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
    assert full.std() > 0.1


@pytest.mark.parametrize("chunks", [(3, 7, 6), (4, 4, 1, 7), (9, 2, 5)], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("case", ["swa-W4", "mla", "hybrid"])
def test_chunked_prefill_equals_full_forward(case, chunks):
    """Several multi-token calls in a row: the ring must reorder held tokens and apply the band mask."""
    model = tiny_model(case, torch.float64)
    idx = torch.randint(0, 61, (1, sum(chunks)), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(idx)
        cache, outs, s = model.new_cache(1, idx.shape[1], torch.float64), [], 0
        for c in chunks:
            outs.append(model(idx[:, s : s + c], cache=cache))
            s += c
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mixer", [MIXER_CASES["swa-W4"], MIXER_CASES["mla"], MIXER_CASES["gqa"]], ids=["swa", "mla", "gqa"])
def test_rope_at_large_absolute_positions(mixer):
    """Decoding from absolute position 5000 (ring slot 5000 % W) equals the full forward at those positions."""
    layer = mixer_layer(mixer)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    pos = torch.arange(5000, 5012)
    with torch.no_grad():
        full = layer(x, positions=pos)
        cache = layer.new_cache(1, 12, torch.float64, "cpu")
        outs = [layer(x[:, :6], positions=pos[:6], cache=cache)]
        outs += [layer(x[:, t : t + 1], positions=pos[t : t + 1], cache=cache) for t in range(6, 12)]
        shifted = layer(x, positions=pos - 4000)  # relative positions only: same output
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)
    torch.testing.assert_close(shifted, full, atol=1e-8, rtol=0)


@pytest.mark.parametrize("case", ["gqa", "swa-W4", "mla", "hybrid"])
def test_generate_greedy_matches_uncached(case):
    model = tiny_model(case)
    idx = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(9))
    cached = model.generate(idx, 10, temperature=0.0)
    uncached = model.generate(idx, 10, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 13)
    assert torch.equal(cached, uncached)


# ----------------------------------------------------------------------------- sliding window semantics


def test_window_at_least_T_equals_full_causal():
    T = 9
    swa = mixer_layer({"name": "sliding_window", "window": T})
    gqa = mixer_layer({"name": "gqa"})
    gqa.load_state_dict(swa.state_dict())
    x = torch.randn(2, T, 32, dtype=torch.float64)
    pos = torch.arange(T)
    torch.testing.assert_close(swa(x, positions=pos), gqa(x, positions=pos), atol=1e-12, rtol=0)
    small = mixer_layer({"name": "sliding_window", "window": T - 2})
    small.load_state_dict(swa.state_dict())
    assert (small(x, positions=pos) - gqa(x, positions=pos)).abs().max() > 1e-3  # a smaller window differs


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_tokens_outside_window_do_not_matter(impl):
    T, t = 14, 10
    layer = mixer_layer({"name": "sliding_window", "window": W})
    layer.impl = impl
    x = torch.randn(1, T, 32, dtype=torch.float64)
    pos = torch.arange(T)
    y = layer(x, positions=pos)
    far, near = x.clone(), x.clone()
    far[:, : t - W + 1] += torch.randn(1, t - W + 1, 32, dtype=torch.float64)  # keys before t-W+1
    near[:, t - W + 1] += 1.0  # the oldest key inside the window
    assert torch.equal(layer(far, positions=pos)[:, t], y[:, t])
    assert (layer(near, positions=pos)[:, t] - y[:, t]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "T,Tk,window,block,heads",
    [(300, 300, 7, 64, (4, 2)), (130, 200, 50, 16, (4, 1)), (257, 257, 1, 32, (2, 2)), (20, 20, 30, 4, (4, 2))],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_blocked_band_sdpa_matches_reference_values_and_grads(T, Tk, window, block, heads):
    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, T, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, Hkv, Tk, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, Hkv, Tk, 5, dtype=torch.float64, generator=g, requires_grad=True)
    fast = sliding_window_sdpa(q, k, v, window=window, block=block)
    mask = attention_mask(T, Tk, causal=True, window=window)
    ref = attention_reference(q, k, v, mask=mask)
    torch.testing.assert_close(fast, ref, atol=1e-10, rtol=0)
    w = torch.randn_like(ref)
    gf = torch.autograd.grad((fast * w).sum(), (q, k, v))
    gr = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_decode_sdpa_groups_heads_like_reference(H, Hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 1, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, Hkv, 13, 8, dtype=torch.float64, generator=g) for _ in range(2))
    torch.testing.assert_close(decode_sdpa(q, k, v), attention_reference(q, k, v), atol=1e-12, rtol=0)


def test_ring_buffer_never_holds_more_than_window():
    layer = mixer_layer({"name": "sliding_window", "window": W}, dtype=torch.float32)
    cache = layer.new_cache(1, 64, torch.float32, "cpu")
    per_token = 2 * layer.n_kv_heads * layer.head_dim * 4
    sizes = []
    with torch.no_grad():
        layer(torch.randn(1, 3, 32), positions=torch.arange(3), cache=cache)
        for t in range(3, 40):
            layer(torch.randn(1, 1, 32), positions=torch.tensor([t]), cache=cache)
            sizes.append(cache.nbytes())
            assert cache.k.shape[2] <= W
    assert isinstance(cache, SlidingWindowCache) and cache.seq_len == 40
    assert sizes[0] == W * per_token and set(sizes) == {W * per_token}
    ptr = cache.k.data_ptr()
    with torch.no_grad():
        layer(torch.randn(1, 1, 32), positions=torch.tensor([40]), cache=cache)
    assert cache.k.data_ptr() == ptr  # decode writes into the ring in place, no new allocation


# ----------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("T,S", [(1, 1), (1, 9), (5, 5), (3, 12)], ids=lambda v: str(v))
@pytest.mark.parametrize("q_lora", [None, 8], ids=["q-full", "q-lora8"])
def test_mla_absorbed_equals_expanded(T, S, q_lora):
    layer = mixer_layer({"name": "mla", "q_lora_rank": q_lora, "v_head_dim": 6})
    x = torch.randn(2, S, 32, dtype=torch.float64)
    q_nope, q_rope, latent = layer.project(x, torch.arange(S))
    q_nope, q_rope = q_nope[:, :, S - T :], q_rope[:, :, S - T :]  # the last T tokens query all S
    absorbed = layer.attend_absorbed(q_nope, q_rope, latent)
    expanded = layer.attend_expanded(q_nope, q_rope, latent)
    layer.impl = "reference"
    reference = layer.attend_expanded(q_nope, q_rope, latent)
    assert absorbed.shape == (2, 4, T, 6)
    torch.testing.assert_close(absorbed, expanded, atol=1e-10, rtol=0)
    torch.testing.assert_close(absorbed, reference, atol=1e-10, rtol=0)


def test_mla_decode_uses_absorbed_path(monkeypatch):
    layer = mixer_layer({"name": "mla"})
    calls = []
    orig = layer.attend_absorbed
    monkeypatch.setattr(layer, "attend_absorbed", lambda *a: calls.append(a[0].shape[2]) or orig(*a))
    cache = layer.new_cache(1, 8, torch.float64, "cpu")
    layer(torch.randn(1, 5, 32, dtype=torch.float64), positions=torch.arange(5), cache=cache)
    layer(torch.randn(1, 1, 32, dtype=torch.float64), positions=torch.tensor([5]), cache=cache)
    assert calls == [1]  # prefill expanded, the one-token step absorbed


@pytest.mark.parametrize("q_lora", [None, 8], ids=["q-full", "q-lora8"])
def test_mla_cache_holds_only_latent_and_rope_key(q_lora):
    model = tiny_model("mla", mixer={"name": "mla", "q_lora_rank": q_lora, "kv_lora_rank": 12, "qk_rope_head_dim": 6})
    cache = model.new_cache(3, 10)
    with torch.no_grad():
        model(torch.randint(0, 61, (3, 7)), cache=cache)
    for layer_cache in cache.layers:
        assert isinstance(layer_cache, LatentCache)
        tensors = list(layer_cache.tensors())
        assert len(tensors) == 1 and tensors[0].shape == (3, 7, 12 + 6)
        assert layer_cache.nbytes() == 3 * 7 * (12 + 6) * 4


def test_mla_defaults_derive_from_head_dim():
    m = mixer_layer({"name": "mla"})  # d_model 32, 4 heads: head_dim 8
    assert (m.kv_lora_rank, m.dn, m.dr, m.dv, m.q_lora_rank) == (32, 8, 4, 8, None)
    assert m.scale == pytest.approx(12 ** -0.5)
    big = resolve_model({"d_model": 5120, "n_heads": 40, "n_kv_heads": 40, "mixer": {"name": "mla"}})
    sizes = big.mixer.sizes(big)  # DeepSeek-V2's sizes at head_dim 128
    assert sizes == {"q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


# ----------------------------------------------------------------------------- memory and FLOPs accounting


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_measured_cache_bytes_equal_analytic(case, dtype):
    model = tiny_model(case, dtype=dtype)
    for L in (1, 3, W, W + 1, 3 * W + 2):
        for batch in (1, 2):
            cache = model.new_cache(batch, L, dtype)
            with torch.no_grad():
                model(torch.randint(0, 61, (batch, L)), cache=cache)
            assert cache.nbytes() == model.cache_bytes(L, batch, dtype) > 0, (L, batch)


def test_cache_bytes_per_token_ordering():
    """DeepSeek-V2 Table 1: MHA 2*n_h*d_h > GQA 2*n_g*d_h ; MLA (d_c + d_r) ; MQA 2*d_h; window flat above W."""
    per_tok = {k: tiny_model(k).cache_bytes(1000) / 1000 for k in ("mha", "gqa", "mqa", "mla")}
    d_h, layers = 8, 2
    assert per_tok["mha"] == 2 * 4 * d_h * layers * 4
    assert per_tok["gqa"] == 2 * 2 * d_h * layers * 4
    assert per_tok["mqa"] == 2 * 1 * d_h * layers * 4
    assert per_tok["mla"] == (32 + 4) * layers * 4
    swa = tiny_model("swa-W4")
    assert swa.cache_bytes(10_000) == swa.cache_bytes(W) == tiny_model("gqa").cache_bytes(W)


def test_sliding_window_flops_use_min_window_keys():
    full, swa = mixer_layer({"name": "gqa"}), mixer_layer({"name": "sliding_window", "window": W})
    proj = 2.0 * (32 * (32 + 2 * 16) + 32 * 32)
    per_key = 2.0 * 2 * 4 * 8  # QK^T and PV, 4 heads of 8
    for L in (1, W, 50, 1000):
        assert full.flops_per_token(L) == pytest.approx(proj + per_key * (L + 1) / 2)
        assert swa.flops_per_token(L) == pytest.approx(proj + per_key * causal_attended(L, W))
    # sum_t min(W, t) over t = 1..L, counted directly
    assert causal_attended(50, W) == pytest.approx(sum(min(W, t) for t in range(1, 51)) / 50)
    assert swa.flops_per_token(10**6) == pytest.approx(proj + per_key * W, rel=1e-5)


def test_mla_flops_formula():
    m = mixer_layer({"name": "mla", "q_lora_rank": 8})
    r, dn, dr, dv, H, d = 32, 8, 4, 8, 4, 32
    params = d * 8 + 8 * H * (dn + dr) + d * (r + dr) + r * H * (dn + dv) + H * dv * d
    L = 33
    assert m.flops_per_token(L) == pytest.approx(2 * params + 2 * H * (dn + dr + dv) * (L + 1) / 2)


# ----------------------------------------------------------------------------- configs


def test_fast_and_reference_forms_agree():
    for mixer in (MIXER_CASES["swa-W4"], MIXER_CASES["mla"], MIXER_CASES["mla-absorb-always"]):
        layer = mixer_layer(mixer)
        x, pos = torch.randn(2, 150, 32, dtype=torch.float64), torch.arange(150)
        fast = layer(x, positions=pos)
        layer.impl = "reference"
        torch.testing.assert_close(fast, layer(x, positions=pos), atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "mixer,field",
    [
        ({"name": "sliding_window", "window": 0}, "window"),
        ({"name": "sliding_window", "causal": False}, "causal"),
        ({"name": "mla", "absorb": "sometimes"}, "absorb"),
        ({"name": "mla", "qk_rope_head_dim": 3}, "qk_rope_head_dim"),
        ({"name": "mla", "kv_lora_rank": -1}, "kv_lora_rank"),
    ],
    ids=lambda v: v if isinstance(v, str) else v["name"],
)
def test_bad_configs_name_the_field(mixer, field):
    with pytest.raises(ConfigError) as err:
        resolve_model({**TINY, "mixer": mixer})
    assert err.value.field.endswith(field) and "\n" not in str(err.value)


def test_local_global_preset_composes():
    from tests.conftest import compose_cfg

    sizes = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=8"]
    cfg = compose_cfg(["model=local_global", *sizes])
    model = DecoderLM(cfg.model, vocab_size=61)
    kinds = [type(m).__name__ for m in model.mixers]
    assert kinds == ["SlidingWindowAttention"] * 3 + ["Attention"] + ["SlidingWindowAttention"] * 3 + ["Attention"]
    assert [m.window for m in model.mixers[:4]] == [128, 128, 128, None]
    assert isinstance(model.mixers[3], Attention) and not isinstance(model.mixers[3], SlidingWindowAttention)
    # memory: 6 window layers flat at W = 128 tokens, 2 global layers growing
    per_layer_tok = 2 * 2 * 8 * 4
    assert model.cache_bytes(1000) == 6 * 128 * per_layer_tok + 2 * 1000 * per_layer_tok


def test_cache_benchmark_smoke(tmp_path):
    """`attnzoo-bench cache` on a tiny model: writes a row per mixer with measured == analytic bytes."""
    import argparse

    from attnzoo.bench import cache as bench_cache

    parser = argparse.ArgumentParser()
    bench_cache.add_arguments(parser)
    args = parser.parse_args(
        "--d-model 32 --n-heads 4 --n-layers 4 --vocab 31 --window 8 --contexts 6 20 --prefill-len 16 "
        "--decode-steps 2 --mixers gqa sliding_window mla local_global".split()
    )
    result = bench_cache.run(args)
    rows = {r["mixer"]: r for r in result["rows"]}
    assert set(rows) == {"gqa", "sliding_window", "mla", "local_global"}
    mib = 2.0**-20
    assert rows["gqa"]["meas MiB@20"] == pytest.approx(4 * 20 * 2 * 2 * 8 * 4 * mib)
    assert rows["sliding_window"]["meas MiB@20"] == pytest.approx(4 * 8 * 2 * 2 * 8 * 4 * mib)  # flat at W
    assert rows["mla"]["KiB/token"] == pytest.approx(4 * (32 + 4) * 4 / 1024)
    assert all(r["decode tok/s@20"] > 0 and r["prefill tok/s"] > 0 for r in rows.values())
