"""KV-cache quantization at inference (attnzoo.mixers.kv_quant, KIVI): the codes' error bound and layout (keys per
channel, values per token), measured == analytic bytes, decode within a derived bound of the full forward
(int8 much tighter than int4, fp32 bit-identical, bf16 stored as bf16), teacher forcing through the cache ==
token-by-token decoding, the end-of-run metrics, attnzoo-eval / attnzoo-generate, and bad options refused."""
import json
import math
import re

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.mixers.kv_quant import (KVFormat, QuantizedKVCache, decode_calls, dequantize, logits_through_cache, pack,
                              quantize, unpack)
from attnzoo.mixers.attention import KVCache
from attnzoo.models.decoder import DecoderLM
from attnzoo.training.config_checks import validate
from tests.conftest import SMALL_TEXT, compose_cfg, tiny_model_cfg

V = 64


def build(mixer="gqa", seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(mixer, **kw), vocab_size=V).eval()


def tokens(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def decode(model, x, prompt_len, kv_format):
    """Prefill `prompt_len` tokens, then one token per call; the logits of every position and the cache."""
    cache = model.new_cache(x.shape[0], x.shape[1], kv_format=kv_format)
    with torch.no_grad():
        outs = [model(x[:, :prompt_len], cache=cache)]
        outs += [model(x[:, t:t + 1], cache=cache) for t in range(prompt_len, x.shape[1])]
    return torch.cat(outs, 1), cache


# ----------------------------------------------------------------------------- the codes


def per_element(scale, axis, group, n):
    return scale.movedim(axis, -1).repeat_interleave(group, -1)[..., :n].movedim(-1, axis).double()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis,group", [(2, 4), (3, 4), (3, 3)], ids=["keys-G4", "values-G4", "values-G3-ragged"])
def test_dequantization_error_is_at_most_half_a_scale(bits, axis, group):
    """|x - x_hat| <= s/2 for every element (z rounded down, s rounded up to fp16: no clamping), on data with
    offset channels and outliers; codes in [0, 2^b - 1], int4 packed two per byte and unpacked exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 10, generator=g, dtype=torch.float64) * torch.linspace(0.01, 30, 10, dtype=torch.float64)
    x = x + 5.0 * torch.randn(10, generator=g, dtype=torch.float64)  # per-channel offsets (zero far from 0)
    x[0, 1, 3, 2] = 400.0  # an outlier
    x[1, 2, :4, 7] = -1.25  # a constant group (scale 0 before the floor)
    codes, scale, zero = quantize(x, axis=axis, group=group, bits=bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape[axis] == math.ceil(x.shape[axis] / group)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 10 * bits // 8 and torch.equal(unpack(packed, bits, 10), codes)
    x_hat = dequantize(codes, scale, zero, axis=axis, group=group, dtype=torch.float64)
    s = per_element(scale, axis, group, x.shape[axis])
    err = (x - x_hat).abs()
    assert (err <= s / 2 * (1 + 1e-9) + 1e-12).all(), float((err - s / 2).max())
    assert err.max() > 0
    # s = (max - min) / (2^b - 1), widened only by the fp16 rounding of z (one fp16 ulp of min) and of s
    lo = x.movedim(axis, -1)[..., :group].amin(-1)
    hi = x.movedim(axis, -1)[..., :group].amax(-1)
    first = scale.movedim(axis, -1)[..., 0].double()
    assert (first >= (hi - lo) / (2**bits - 1)).all()
    assert (first <= ((hi - lo + lo.abs() * 2.0**-10) / (2**bits - 1) * (1 + 2.0**-10)).clamp_min(2.0**-24)).all()


def test_keys_are_quantized_per_channel_and_values_per_token():
    """An outlier channel changes no other channel's key codes; an outlier token changes no other token's
    value codes (the layouts KIVI chose: key outliers sit in channels, values mix per token)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 8, 8, generator=g)
    spiky = x.clone()
    spiky[..., 5] *= 50.0  # a key outlier channel
    a, b = quantize(x, axis=2, group=4, bits=4)[0], quantize(spiky, axis=2, group=4, bits=4)[0]
    others = [c for c in range(8) if c != 5]
    assert torch.equal(a[..., others], b[..., others])
    spiky = x.clone()
    spiky[:, :, 3] *= 50.0  # a value outlier token
    a, b = quantize(x, axis=3, group=4, bits=4)[0], quantize(spiky, axis=3, group=4, bits=4)[0]
    others = [t for t in range(8) if t != 3]
    assert torch.equal(a[:, :, others], b[:, :, others])
    # and the other way round they would leak: a key outlier token moves its group's codes in every channel
    spiky = x.clone()
    spiky[:, :, 3] *= 50.0
    a, b = quantize(x, axis=2, group=4, bits=4)[0], quantize(spiky, axis=2, group=4, bits=4)[0]
    assert not torch.equal(a[:, :, :3], b[:, :, :3])


# ----------------------------------------------------------------------------- bytes


FORMATS = [KVFormat("int4", 4, 3), KVFormat("int8", 4, 0), KVFormat("int8", 3, 8), KVFormat("bf16"), KVFormat("fp32")]
FMT_IDS = [f"{f.dtype}-G{f.group_size}-R{f.residual}" for f in FORMATS]


def owns_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def holds_no_hidden_memory(layer) -> bool:
    """Every tensor owns its storage, except a plain KVCache's k / v: views of its doubling buffers, which
    `allocated_bytes()` reports and which hold at most the filled part again."""
    if type(layer) is KVCache:
        return layer.allocated_bytes() <= 2 * layer.nbytes() and all(
            t.untyped_storage().nbytes() <= 2 * t.numel() * t.element_size() for t in layer.tensors())
    return all(owns_storage(t) for t in layer.tensors())


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("mixer,kw", [("gqa", {}), ("mha", {"head_dim": 10}), ("mqa", {}),
                                      ("gqa", {"pattern": ["gqa", "sliding_window", "mla", "deltanet"], "n_layers": 4})],
                         ids=["gqa", "mha-hd10", "mqa", "hybrid"])
def test_measured_bytes_equal_analytic(fmt, mixer, kw):
    """After prefills of lengths below R, at R + G, not multiples of G, and after every decode step: the
    bytes held == model.cache_bytes(n, B, kv_format=fmt); every held tensor owns its storage (no view pins a
    larger one) but the plain cache's doubling buffers (at most 2x, reported by allocated_bytes); the other mixers' caches are the plain ones, byte for byte."""
    m = build(mixer, **kw)
    for prompt in (1, 2, 7, 11):
        x = tokens(2, prompt + 6)
        with torch.no_grad():
            cache, plain = m.new_cache(2, x.shape[1], kv_format=fmt), m.new_cache(2, x.shape[1])
            for s, e in [(0, prompt)] + [(t, t + 1) for t in range(prompt, x.shape[1])]:
                m(x[:, s:e], cache=cache)
                m(x[:, s:e], cache=plain)
                assert cache.nbytes() == m.cache_bytes(e, 2, torch.float32, kv_format=fmt), (prompt, e)
                assert all(holds_no_hidden_memory(layer) for layer, mx in zip(cache.layers, m.mixers)
                           if mx.cfg.name in ("mha", "gqa", "mqa"))
        for layer, mixer_ in zip(range(len(m.mixers)), m.mixers):
            if mixer_.cfg.name not in ("mha", "gqa", "mqa"):
                assert type(cache[layer]) is type(plain[layer]) and cache[layer].nbytes() == plain[layer].nbytes()
    if fmt.bits is not None:  # int codes really are held: uint8, head_dim * b / 8 bytes per token and head
        q = next(c for c in cache.layers if isinstance(c, QuantizedKVCache))
        assert q.k_codes.dtype == torch.uint8 and q.k_codes.shape[-1] == m.cfg.head_dim * fmt.bits // 8
        assert q.n_quantized == fmt.n_quantized(x.shape[1]) > 0 and q.seq_len == x.shape[1]


def test_bytes_per_token_order_and_formula():
    """Long context: int4 < int8 < bf16 < fp32, and the formula's terms for a Llama-like head (D=128, G=32)."""
    m = build("gqa", d_model=512, n_heads=4, n_kv_heads=2, n_layers=1)  # head_dim 128
    L = 4096
    per = {f: m.cache_bytes(L, kv_format=KVFormat(f)) / L for f in ("fp32", "bf16", "int8", "int4")}
    assert per["int4"] < per["int8"] < per["bf16"] < per["fp32"] == 2 * 2 * 128 * 4
    n_q, D = 32 * ((L - 32) // 32), 128
    expect = 2 * (2 * n_q * D // 2 + 4 * (n_q // 32) * D + 4 * n_q * (D // 32) + 2 * (L - n_q) * D * 4)
    assert m.cache_bytes(L, kv_format=KVFormat("int4")) == expect


# ----------------------------------------------------------------------------- decode vs the full forward


def test_fp32_format_is_bit_identical_and_nothing_quantized_is_too():
    """fp32 == no format at all, bit for bit; an int format whose window still holds everything (n < R + G)
    also decodes bit-identically (it is the same concatenation)."""
    m = build("gqa")
    x = tokens(2, 20)
    plain, _ = decode(m, x, 5, None)
    same, cache = decode(m, x, 5, KVFormat("fp32"))
    assert torch.equal(plain, same) and type(cache[0]).__name__ == "KVCache"
    unquantized, cache = decode(m, x, 5, KVFormat("int4", 8, 16))
    assert cache[0].n_quantized == 0 and torch.equal(plain, unquantized)
    # a call's own keys/values are used as computed: one prefill equals the full forward, quantized or not (fp64)
    m = m.double()
    with torch.no_grad():
        cache = m.new_cache(2, 20, kv_format=KVFormat("int4", 4, 3))
        torch.testing.assert_close(m(x, cache=cache), m(x), atol=1e-10, rtol=0)
    assert cache[0].n_quantized == 16


def test_bf16_format_stores_bf16():
    m = build("gqa")
    x = tokens(2, 20)
    with torch.no_grad():
        full = m(x)
    got, cache = decode(m, x, 5, KVFormat("bf16"))
    assert cache[0].k.dtype == cache[0].v.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert cache.nbytes() == m.cache_bytes(20, 2, kv_format=KVFormat("bf16")) == m.cache_bytes(20, 2) // 2
    err = (got - full).abs().max()
    assert 0 < err < 1e-2 * full.abs().max()


def attention_bound(mixer, x, positions, cache, fmt, prompt_len):
    """The derived bound on |cached - full| for one attention layer, per (batch, token, output channel).

    Query t attends to t past tokens, the first n_q(t) of them dequantized: |dk| <= s_k/2, |dv| <= s_v/2
    per element. Scores move by at most eps = c * sum_d |q_d| s_k,d / 2, so each softmax weight by a factor in
    [e^-2eps, e^2eps] and sum |p' - p| <= e^(2 eps) - 1; per channel then
      |o' - o| <= max_j s_v,j / 2 + (e^(2 eps) - 1) * (max_j v_j - min_j v_j) / 2,
    and the output projection gives |y' - y| <= |W_o| |o' - o|."""
    q, k, v = mixer.project(x, positions)  # (B, H, T, D), (B, Hkv, T, D): post-RoPE, as cached
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    G, c = fmt.group_size, mixer.scale or D**-0.5
    s_k = cache.k_scale.double().repeat_interleave(G, dim=2)  # (B, Hkv, n_q, D)
    s_v = cache.v_scale.double().repeat_interleave(G, dim=-1)[..., :D]  # (B, Hkv, n_q, D)
    bound_o = torch.zeros(B, H, T, D, dtype=torch.float64)
    for t in range(prompt_len, T):
        n_q = fmt.n_quantized(t)
        if n_q == 0:
            continue
        for h in range(H):
            g = h // rep
            eps = c * (q[:, h, t, None, :].abs() * s_k[:, g, :n_q] / 2).sum(-1).amax(-1)  # (B,)
            seen = v[:, g, : t + 1]
            spread = (seen.amax(1) - seen.amin(1)) / 2  # (B, D)
            bound_o[:, h, t] = s_v[:, g, :n_q].amax(1) / 2 + torch.expm1(2 * eps)[:, None] * spread
    flat = bound_o.transpose(1, 2).reshape(B, T, H * D)
    return flat @ mixer.o_proj.weight.abs().T.double()


@pytest.mark.parametrize("mixer", ["gqa", "mqa", "mha"])
def test_decode_within_the_derived_bound_and_int8_much_tighter(mixer):
    m = build(mixer, n_layers=1).double()
    layer = m.mixers[0]
    B, T, P = 2, 30, 6
    x = torch.randn(B, T, m.cfg.d_model, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    pos = torch.arange(T)
    with torch.no_grad():
        full = layer(x, positions=pos)
        errs, bounds = {}, {}
        for dtype in ("int8", "int4"):
            fmt = KVFormat(dtype, 4, 3)
            cache = layer.new_cache(B, T, torch.float64, "cpu", kv_format=fmt)
            outs = [layer(x[:, :P], positions=pos[:P], cache=cache)]
            outs += [layer(x[:, t:t + 1], positions=pos[t:t + 1], cache=cache) for t in range(P, T)]
            err = (torch.cat(outs, 1) - full).abs()
            bound = attention_bound(layer, x, pos, cache, fmt, P)
            assert (err <= bound + 1e-12).all(), float((err - bound).max())
            errs[dtype], bounds[dtype] = float(err.max()), float(bound.max())
    assert errs["int4"] > 1e-4  # the quantization really acted
    assert errs["int8"] < errs["int4"] / 8 and bounds["int8"] < bounds["int4"] / 8


def test_model_logits_int8_much_tighter_than_int4():
    m = build("gqa")
    x = tokens(2, 40)
    with torch.no_grad():
        full = m(x)
    e8 = float((decode(m, x, 5, KVFormat("int8", 4, 3))[0] - full).abs().max())
    e4 = float((decode(m, x, 5, KVFormat("int4", 4, 3))[0] - full).abs().max())
    assert 0 < e8 < e4 / 8 and e4 < 0.1 * float(full.abs().max())


# ----------------------------------------------------------------------------- teacher forcing through the cache


@pytest.mark.parametrize("fmt", [KVFormat("int4", 4, 3), KVFormat("int8", 3, 0), KVFormat("int4", 2, 5)], ids=FMT_IDS[:1] + ["int8-G3-R0", "int4-G2-R5"])
def test_teacher_forcing_through_the_cache_equals_token_by_token_decode(fmt):
    """The calls of decode_calls (R + G tokens, then G at a time) make every token see the cache exactly as
    one-token decoding does; G-sized calls from position 0 would not when G does not divide R."""
    m = build("gqa").double()
    x = tokens(2, 27)
    with torch.no_grad():
        stepwise, _ = decode(m, x, 1, fmt)
        forced = logits_through_cache(m, x, fmt)
        full = m(x)
    assert decode_calls(27, fmt)[0] == (0, fmt.residual + fmt.group_size)
    torch.testing.assert_close(forced, stepwise, atol=1e-10, rtol=0)
    assert (forced - full).abs().max() > 1e-6
    if fmt.residual % fmt.group_size:
        G = fmt.group_size
        cache = m.new_cache(2, 27, kv_format=fmt)
        with torch.no_grad():
            naive = torch.cat([m(x[:, s:s + G], cache=cache) for s in range(0, 27, G)], 1)
        assert (naive - stepwise).abs().max() > 1e-8


# ----------------------------------------------------------------------------- training, eval, generate


TEXT = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=64", "data.batch_size=8", "optim.lr=3e-3",
        "trainer.max_steps=10", "trainer.val_check_interval=10", "inference.kv_cache_dtype=int4",
        "inference.kv_group_size=8", "inference.kv_residual=8"]


@pytest.fixture(scope="module")
def int4_run(tmp_path_factory):
    from attnzoo.training.run import train

    out = tmp_path_factory.mktemp("kvq") / "run"
    return out, train(compose_cfg(TEXT, out))


def test_end_of_run_metrics_through_the_quantized_cache(int4_run):
    import attnzoo

    out, metrics = int4_run
    model = attnzoo.load(out).model
    fmt = KVFormat("int4", 8, 8)
    assert metrics["cache/bytes_per_token"] == model.cache_bytes(64, 1, kv_format=fmt) / 64 < model.cache_bytes(64) / 64
    assert metrics["cache/bytes_at_ctx"] == model.cache_bytes(64, 1, kv_format=fmt)
    # on the final validation's batches: loss_kvq - loss == delta, and the cache really changed the loss
    assert metrics["val/loss_kvq_delta"] == pytest.approx(metrics["val/loss_kvq"] - metrics["val/loss"], abs=1e-5)
    assert metrics["val/loss_kvq_delta"] != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["val/loss_kvq"] == pytest.approx(metrics["val/loss_kvq"])
    header = (out / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/loss_kvq", "val/loss_kvq_delta", "cache/bytes_per_token"} <= set(header)


def test_eval_and_generate_take_the_format(int4_run, tmp_path, capsys):
    import attnzoo
    from attnzoo.inference.generate import eval_main, generate_main

    out, metrics = int4_run
    res = {}
    for dtype in ("fp32", "int8", "int4"):
        eval_main([str(out), "--kv-cache-dtype", dtype, "--max-batches", "2", "--out", str(tmp_path / f"{dtype}.json")])
        res[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["metrics"]
    assert "val/loss_kvq" not in res["fp32"]
    # the run's own G, R and the final validation's 2 batches (debug=smoke): the run's numbers again
    assert res["int4"]["val/loss_kvq"] == pytest.approx(metrics["val/loss_kvq"], rel=1e-6)
    assert res["fp32"]["cache/bytes_per_token"] > res["int8"]["cache/bytes_per_token"] > res["int4"]["cache/bytes_per_token"]
    run = attnzoo.load(out)
    fmt = KVFormat("int4", 2, 1)
    ids = torch.tensor([run.encode("def ")])
    greedy = run.decode(run.model.generate(ids, 12, temperature=0, kv_format=fmt)[0].tolist())
    capsys.readouterr()
    generate_main([str(out), "def ", "--max-new-tokens", "12", "--temperature", "0", "--kv-cache-dtype", "int4",
                   "--kv-group-size", "2", "--kv-residual", "1"])
    assert capsys.readouterr().out.rstrip("\n") == greedy
    with pytest.raises(SystemExit) as e:
        eval_main([str(out), "--kv-cache-dtype", "int3"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "--kv-cache-dtype: got 'int3'; allowed: fp32, bf16, int8, int4" in err


# ----------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("overrides,field,phrase", [
    (["inference.kv_cache_dtype=int3"], "inference.kv_cache_dtype", "allowed: fp32, bf16, int8, int4"),
    (["inference.kv_group_size=0"], "inference.kv_group_size", "must be >= 1"),
    (["inference.kv_residual=-1"], "inference.kv_residual", "must be >= 0"),
    (["inference.kv_cache_dtype=int4", "model.head_dim=7"], "inference.kv_cache_dtype", "head_dim=7 is odd"),
    (["inference.kv_cache_dtype=int8", "model=encdec", "data=reversal"], "inference.kv_cache_dtype", "decoder LMs"),
], ids=["dtype", "group", "residual", "int4-odd-head-dim", "encdec"])
def test_bad_options_are_refused_in_one_line(overrides, field, phrase, tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(["debug=smoke", *overrides], tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and phrase in msg, msg


def test_odd_head_dim_is_fine_with_int8_and_a_model_without_kv_layers_is_refused(tmp_path):
    validate(compose_cfg(["debug=smoke", "model.head_dim=7", "inference.kv_cache_dtype=int8", "inference.kv_residual=8",
                          "inference.kv_group_size=8"], tmp_path))
    # no layer takes the format: refused as such (before: accepted, and the run reported a "+0.0000" cost)
    with pytest.raises(ConfigError, match=r"^inference.kv_cache_dtype: int4 stores the KV caches of gqa / mha / mqa "
                                          r"layers, and none of this model's \d+ layers is one \(sliding_window: own"):
        validate(compose_cfg(["debug=smoke", "model/mixer=sliding_window", "model.head_dim=7",
                              "inference.kv_cache_dtype=int4"], tmp_path))


def test_coverage_says_what_is_and_is_not_quantized():
    from attnzoo.mixers.kv_quant import coverage

    hybrid = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "gqa"]
    assert coverage(KVFormat("fp32"), hybrid, 64) == ""
    assert coverage(KVFormat("int8", 8, 8), hybrid, 64) == (
        "int8 keys/values in layers 3 of 4 (gqa); not quantized: 0,1,2 (gated_deltanet: own caches); at 64 tokens "
        "the first 56 held quantized, the last 8 in full precision")
    assert coverage(KVFormat("bf16"), ["gqa", "mqa"], 64) == "bf16 keys/values in all 2 layers (gqa/mqa)"
    assert coverage(KVFormat("int4", 8, 8), ["gqa"], None) == "int4 keys/values in all 1 layers (gqa)"  # generation
    # R + G = 16 tokens in full precision: a 17th token is the first to read a quantized key
    assert "the first 8 held quantized" in coverage(KVFormat("int4", 8, 8), ["gqa"], 17)
    with pytest.raises(ConfigError, match=r"^--kv-residual: 8 full-precision tokens \(\+ a group of 8\) cover the "
                                          r"whole 16-token sequence \(x\): .*allowed: kv-residual \+ kv-group-size < 16$"):
        coverage(KVFormat("int4", 8, 8), ["gqa"], 16, fields=("--kv-cache-dtype", "--kv-group-size", "--kv-residual"),
                 seq_field="x")


def test_hybrid_run_summary_names_the_quantized_layers(tmp_path, capsys):
    """gated_deltanet + gqa with an int8 cache: summary.json and the printed summary say which layer was
    quantized and how many tokens, and the cost is that of a cache that really changed."""
    from attnzoo.training.run import train

    out = tmp_path / "run"
    metrics = train(compose_cfg(["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "model.n_layers=2",
                                 "model.pattern=[gated_deltanet,gqa]", "inference.kv_cache_dtype=int8",
                                 "inference.kv_group_size=4", "inference.kv_residual=4"], out))
    said = json.loads((out / "summary.json").read_text())["kv_quant"]
    assert said == ("int8 keys/values in layers 1 of 2 (gqa); not quantized: 0 (gated_deltanet: own caches); at 32 "
                    "tokens the first 28 held quantized, the last 4 in full precision")
    assert said in capsys.readouterr().out
    assert metrics["val/loss_kvq_delta"] != 0


def test_eval_says_how_many_batches_it_scored_against_the_runs_limit(int4_run, tmp_path, capsys):
    """attnzoo-eval scores the whole split by default; the run's validation scored limit_val_batches=2
    (debug=smoke): the output says both, and --max-batches 2 matches the run."""
    from attnzoo.inference.generate import eval_main

    out, metrics = int4_run
    capsys.readouterr()
    eval_main([str(out), "--out", str(tmp_path / "all.json")])
    printed = capsys.readouterr().out
    res = json.loads((tmp_path / "all.json").read_text())
    total = res["scored"]["of"]
    assert total > 2 and res["scored"]["batches"] == total and res["scored"]["run_batches"] == 2
    assert (f"scored {total} of {total} batches of the validation split; the run's own validation scored 2 "
            f"(trainer.limit_val_batches=2), so val/loss can differ from its summary's; --max-batches 2 matches it "
            f"(tokens {int(res['metrics']['tokens']):,})") in printed
    assert re.search(r"kv-quant: int4 keys/values in all \d+ layers \(gqa\); at 64 tokens the first 56 held quantized, "
                     r"the last 8 in full precision", printed), printed
    eval_main([str(out), "--max-batches", "2", "--out", str(tmp_path / "two.json")])
    printed = capsys.readouterr().out
    assert f"scored 2 of {total} batches of the validation split; the run's own validation scored 2 " in printed
    assert "differ" not in printed
    assert json.loads((tmp_path / "two.json").read_text())["metrics"]["val/loss"] == pytest.approx(metrics["val/loss"],
                                                                                                  rel=1e-5)
    with pytest.raises(SystemExit) as e:  # the run's 64 tokens inside R + G: refused before the evaluation
        eval_main([str(out), "--kv-residual", "56", "--out", str(tmp_path / "none.json")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("attnzoo-eval: error: --kv-residual: 56 full-precision tokens (+ a group of 8) "
                                         "cover the whole 64-token sequence (the run's data.seq_len): no token would "
                                         "read a quantized key or value; allowed: kv-residual + kv-group-size < 64")
    assert not (tmp_path / "none.json").exists()
