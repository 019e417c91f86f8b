"""Attention sinks for the sliding window (StreamingLLM, Xiao et al. 2023): `model.mixer.sink_tokens=k` keeps
the first k tokens visible to every query. Decode (one token and multi-token chunks, across many ring
wrap-arounds) == full forward, reference == fast, cache bytes measured == analytic and flat at W + k."""
import pytest
import torch

from attnzoo.models.decoder import DecoderLM
from tests.conftest import tiny_model_cfg

V, W, S = 64, 6, 2


def build(sinks: int = S, layers: int = 2, conv: int = 0) -> DecoderLM:
    torch.manual_seed(0)
    mixer = {"name": "sliding_window", "window": W, "sink_tokens": sinks, "conv_size": conv}
    return DecoderLM(tiny_model_cfg(mixer, n_layers=layers), vocab_size=V).double().eval()


@pytest.mark.parametrize("chunks", [[1] * 40, [5, 1, 1, 9, 3, 1, 20], [7, 13, 20], [40]], ids=["tokens", "mixed", "chunks", "one"])
@pytest.mark.parametrize("conv", [0, 3])
def test_cached_calls_equal_full_forward_across_wraparound(chunks, conv):
    m = build(conv=conv)
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
        cache, outs, s = m.new_cache(2, 40, torch.float64), [], 0
        for c in chunks:
            outs.append(m(x[:, s:s + c], cache=cache))
            s += c
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)


def test_reference_equals_fast_and_sinks_matter():
    m = build()
    x = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = m(x)
        for mx in m.mixers:
            mx.impl = "reference"
        torch.testing.assert_close(m(x), fast, atol=1e-10, rtol=0)
        for mx in m.mixers:
            mx.impl, mx.sinks = "fast", 0
        assert (m(x) - fast).abs().max() > 1e-3


@pytest.mark.parametrize("sinks", [0, S])
def test_the_first_token_reaches_far_queries_only_through_a_sink(sinks):
    """One layer, window 6: position 30 cannot see token 0 through the window; with a sink it does."""
    m = build(sinks=sinks, layers=1)
    x = torch.randint(1, V, (1, 31), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[0, 0] = 0
    with torch.no_grad():
        changed = (m(x)[0, -1] - m(y)[0, -1]).abs().max()
    assert (changed > 1e-6) == bool(sinks)


def test_cache_bytes_flat_at_window_plus_sinks():
    m = build()
    for L in (1, 2, 5, 6, 7, 8, 9, 25, 60):
        cache = m.new_cache(1, L, torch.float64)
        with torch.no_grad():
            m(torch.randint(0, V, (1, L)), cache=cache)
        assert cache.nbytes() == m.cache_bytes(L, 1, torch.float64), L
    assert m.cache_bytes(1000) == m.cache_bytes(W + S) == m.cache_bytes(10**6)
    assert m.cache_bytes(1000) - build(sinks=0).cache_bytes(1000) == 2 * 2 * S * m.mixers[0].n_kv_heads * m.mixers[0].head_dim * 4
