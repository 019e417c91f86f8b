"""KV formats (bf16, KIVI int8 / int4) in the static cache (mixers/kv_quant.StaticQuantizedKVCache, StaticKVCache in
bf16): decoding through them equals decoding through the dynamic format caches in fp64 (the same codes, scales and
full-precision window, so 1e-10), rows of other lengths decode as if alone, filled bytes == analytic, the compiled
step is one graph across every quantization boundary, and a chunk after the prefill is refused in one line."""
import pytest
import torch

from attnzoo.mixers.kv_quant import KVFormat
from attnzoo.models.decoding import Decoder
from tests.conftest import tiny_model_cfg
from tests.test_static_decode import V, build, counting_backend

FORMATS = [KVFormat("bf16"), KVFormat("int8", 4, 6), KVFormat("int4", 4, 6), KVFormat("int8", 3, 0),
           KVFormat("int4", 8, 0), KVFormat("int8", 4, 1)]
IDS = [f"{f.dtype}-G{f.group_size}-R{f.residual}" for f in FORMATS]


def decode(m, x, prompt_len: int, cache) -> torch.Tensor:
    """Logits of x through `cache`: the prompt in one call, then one token per call."""
    with torch.no_grad():
        out = [m(x[:, :prompt_len], cache=cache)]
        out += [m(x[:, t:t + 1], cache=cache) for t in range(prompt_len, x.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
@pytest.mark.parametrize("mixer", [{"name": "gqa"}, {"name": "mha", "conv_size": 3}], ids=["gqa", "mha+conv3"])
def test_static_format_decode_equals_the_dynamic_format(fmt, prompt_len, mixer):
    m = build(mixer).double()
    x = torch.randint(0, V, (2, prompt_len + 17), generator=torch.Generator().manual_seed(1))
    T = x.shape[1]
    dynamic = m.new_cache(2, T, torch.float64, kv_format=fmt)
    static = m.new_static_cache(2, 48, torch.float64, kv_format=fmt)
    want = decode(m, x, prompt_len, dynamic)
    torch.testing.assert_close(decode(m, x, prompt_len, static), want, atol=1e-10, rtol=0)
    assert static.nbytes() == dynamic.nbytes() == m.cache_bytes(T, 2, torch.float64, kv_format=fmt)
    assert static.allocated_bytes() >= static.nbytes()
    if fmt.bits is not None:  # the quantization really entered: the same tokens read at full precision differ
        assert (decode(m, x, prompt_len, m.new_static_cache(2, 48, torch.float64)) - want).abs().max() > 1e-6


def test_a_hybrid_quantizes_its_attention_layers_only():
    torch.manual_seed(0)
    cfg = tiny_model_cfg({"name": "gqa"}, n_layers=3, pattern=["a", "w", "g"], max_seq_len=64,
                         mixers={"a": {"name": "gqa"}, "w": {"name": "sliding_window", "window": 6, "sink_tokens": 1},
                                 "g": {"name": "gated_deltanet"}})
    from attnzoo.models.decoder import DecoderLM

    m = DecoderLM(cfg, vocab_size=V).eval().double()
    fmt = KVFormat("int4", 4, 2)
    x = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    static = m.new_static_cache(2, 40, torch.float64, kv_format=fmt)
    want = decode(m, x, 5, m.new_cache(2, 30, torch.float64, kv_format=fmt))
    torch.testing.assert_close(decode(m, x, 5, static), want, atol=1e-10, rtol=0)
    assert [type(c).__name__ for c in static.layers] == ["StaticQuantizedKVCache", "StaticKVCache",
                                                         "RecurrentStateCache"]


@pytest.mark.parametrize("fmt", [KVFormat("int8", 4, 3), KVFormat("bf16")], ids=["int8", "bf16"])
def test_rows_of_other_lengths_decode_as_if_alone(fmt):
    """Rows cross their quantization boundaries at other steps: each row equals its own dynamic-format decode."""
    m = build({"name": "gqa"}).double()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, V, (1, n), generator=g) for n in (12, 21, 16)]
    cache = m.new_static_cache(3, 40, torch.float64, kv_format=fmt)
    with torch.no_grad():
        for b, r in enumerate(rows):
            m(r[:, :-10], cache=cache.row(b))
        steps = [m(torch.cat([r[:, -10 + t:r.shape[1] - 9 + t] for r in rows]), cache=cache) for t in range(10)]
    for b, r in enumerate(rows):
        want = decode(m, r, r.shape[1] - 10, m.new_cache(1, r.shape[1], torch.float64, kv_format=fmt))[:, -10:]
        torch.testing.assert_close(torch.cat([s[b:b + 1] for s in steps], 1), want, atol=1e-10, rtol=0)
    assert cache.nbytes() == sum(m.cache_bytes(r.shape[1], 1, torch.float64, kv_format=fmt) for r in rows)


@pytest.mark.parametrize("fmt", [KVFormat("int4", 4, 2), KVFormat("bf16")], ids=["int4", "bf16"])
def test_the_compiled_format_step_is_one_graph_and_equals_eager(fmt):
    """Greedy decoding over prompts of three lengths, 20 steps each (several groups quantized inside the step), then
    another batch: one graph (a counting backend); the tokens equal the eager static decode's and the dynamic
    format's (batch-1 decoder through `new_cache` is what DecoderLM.generate's KV-format path runs)."""
    m = build({"name": "gqa"})
    backend, graphs = counting_backend()
    dec = Decoder(m, 3, 48, backend=backend, kv_format=fmt)
    assert dec.path.startswith("compiled static cache")
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(1, 12))]
    got = dec.generate(prompts, 20)
    dec.generate([[3], [9, 9, 9, 9]], 20)
    assert len(graphs) == 1
    assert got.tokens == Decoder(m, 3, 48, compile=False, kv_format=fmt).generate(prompts, 20).tokens
    for p, toks in zip(prompts, got.tokens):
        cache = m.new_cache(1, 48, torch.float32, kv_format=fmt)
        ids = list(p)
        with torch.no_grad():
            logits = m(torch.tensor([ids]), cache=cache)
            for _ in range(20):
                ids.append(int(logits[0, -1].argmax()))
                logits = m(torch.tensor([ids[-1:]]), cache=cache)
        assert ids[len(p):] == toks


def test_aot_autograd_captures_the_quantizing_step():
    """dynamo + AOTAutograd's functionalization of the in-place, masked group writes (fp64, 1e-10)."""
    m = build({"name": "gqa"}).double()
    fmt = KVFormat("int8", 3, 2)
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(4))
    cache = m.new_static_cache(2, 32, torch.float64, kv_format=fmt)
    step = torch.compile(lambda t: m(t, cache=cache), backend="aot_eager", fullgraph=True)
    try:
        with torch.no_grad():
            out = [m(x[:, :4], cache=cache)] + [step(x[:, t:t + 1]) for t in range(4, 24)]
    finally:
        torch._dynamo.reset()
    want = decode(m, x, 4, m.new_cache(2, 24, torch.float64, kv_format=fmt))
    torch.testing.assert_close(torch.cat(out, 1), want, atol=1e-10, rtol=0)


def test_a_chunk_after_the_prefill_is_refused():
    m = build({"name": "gqa"})
    cache = m.new_static_cache(1, 32, torch.float32, kv_format=KVFormat("int8", 4, 4))
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="StaticQuantizedKVCache continues one token at a time after its prefill"):
            m(torch.tensor([[4, 5]]), cache=cache)
