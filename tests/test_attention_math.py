"""Softmax attention: the seed's hand-worked example, masking, stability, head slicing, GQA/MQA/MHA identities."""
import math

import pytest
import torch

from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.attention import attention_mask, attention_reference, attention_sdpa
from tests.conftest import gap_atol, tiny_model_cfg


def test_seed_3x3_example_true_values():
    # ../shared/seeds/004 section 5.1: X = [[1,0],[0,1],[1,1]], Q = K = V = X, d_k = 2, no mask.
    X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    q = k = v = X[None, None]  # (B=1, H=1, T=3, D=2)
    out, w = attention_reference(q, k, v, mask=None, return_weights=True)
    # By hand: row 3 scores [1, 1, 2] / sqrt(2) -> e^0.7071 = 2.028, e^1.4142 = 4.113 -> [0.248, 0.248, 0.503].
    # (The seed prints [0.244, 0.244, 0.512] for row 3: an arithmetic slip.)
    expected_w = torch.tensor([[0.401, 0.198, 0.401], [0.198, 0.401, 0.401], [0.248, 0.248, 0.503]], dtype=torch.float64)
    assert torch.allclose(w[0, 0], expected_w, atol=6e-4)
    assert torch.allclose(out[0, 0, 0], torch.tensor([0.802, 0.599], dtype=torch.float64), atol=1e-3)
    e = math.exp(1 / math.sqrt(2))
    assert w[0, 0, 2, 0].item() == pytest.approx(e / (2 * e + math.exp(2 / math.sqrt(2))), abs=1e-12)
    # the fast SDPA path gives the same numbers (non-causal)
    fast = attention_sdpa(q, k, v, causal=False)
    assert torch.allclose(fast, out, atol=1e-12)


def test_reference_matches_sdpa_values_and_grads():
    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 11, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    ref = attention_reference(q, k, v, mask=attention_mask(T, T, causal=True))
    fast = attention_sdpa(q, k, v, causal=True)
    assert torch.allclose(ref, fast, atol=1e-12)
    g = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g)
    for a, b in zip(grads_ref, grads_fast):
        assert torch.allclose(a, b, atol=1e-10)


def test_stable_with_huge_logits():
    q = torch.full((1, 1, 4, 2), 1e4)
    k = torch.full((1, 1, 4, 2), 1e4)
    v = torch.randn(1, 1, 4, 2)
    for out in (attention_reference(q, k, v, mask=attention_mask(4, 4, causal=True)), attention_sdpa(q, k, v, causal=True)):
        assert torch.isfinite(out).all()
    # equal huge scores -> uniform weights over the visible keys (in fp32, within FP32_FACTOR x its fp64 gap)
    out = attention_reference(q, k, v, mask=attention_mask(4, 4, causal=True))
    out64 = attention_reference(q.double(), k.double(), v.double(), mask=attention_mask(4, 4, causal=True))
    torch.testing.assert_close(out[0, 0, 3], v[0, 0].mean(0), atol=gap_atol(out, out64), rtol=0)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_causality(impl):
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg("gqa"), vocab_size=50).eval().double()  # the prefix compared in fp64
    for mod in m.mixers:
        mod.impl = impl
    x = torch.randint(0, 50, (1, 12))
    y = x.clone()
    y[0, 7:] = (y[0, 7:] + 1) % 50
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.allclose(a[0, :7], b[0, :7], atol=1e-10, rtol=0)
    assert not torch.allclose(a[0, 7:], b[0, 7:], atol=1e-3)


def test_each_head_reads_only_its_slice():
    """Perturbing the q-projection rows of head 1 changes only head 1's output channels (before o_proj)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg("mha", n_layers=1), vocab_size=20).eval()
    att = m.mixers[0]
    x = torch.randn(1, 6, 32)
    pos = torch.arange(6)
    captured = {}
    att.o_proj.register_forward_hook(lambda mod, inp, out: captured.__setitem__("y", inp[0].clone()))
    att(x, positions=pos)
    before = captured["y"].view(1, 6, att.n_heads, att.head_dim)
    with torch.no_grad():
        att.qkv.weight[att.head_dim : 2 * att.head_dim] += 1.0  # head 1's query rows
    att(x, positions=pos)
    after = captured["y"].view(1, 6, att.n_heads, att.head_dim)
    changed = [(after[:, :, h] - before[:, :, h]).abs().max().item() > 1e-6 for h in range(att.n_heads)]
    assert changed == [False, True, False, False]


def test_gqa_with_all_kv_heads_equals_mha_and_mqa_is_one_kv_head():
    torch.manual_seed(0)
    mha = DecoderLM(tiny_model_cfg("mha"), vocab_size=40).eval()
    gqa = DecoderLM(tiny_model_cfg("gqa", n_kv_heads=4), vocab_size=40).eval()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(mha(x), gqa(x))
    mqa = DecoderLM(tiny_model_cfg("mqa"), vocab_size=40)
    assert all(m.n_kv_heads == 1 for m in mqa.mixers)
    assert all(m.n_kv_heads == 4 for m in mha.mixers)
    # mqa equals gqa with one kv head, same weights
    gqa1 = DecoderLM(tiny_model_cfg("gqa", n_kv_heads=1), vocab_size=40).eval()
    gqa1.load_state_dict(mqa.state_dict())
    with torch.no_grad():
        assert torch.equal(mqa.eval()(x), gqa1(x))


def test_seed_kv_cache_accounting():
    """Seed 004 section 4.2: one MHA layer, d_model 512, 1000 tokens, batch 32, fp32:
    2 x 512 x 1000 x 32 = 32,768,000 values = 131,072,000 bytes (the seed's 524 MB is off by 4x)."""
    cfg = {"d_model": 512, "n_layers": 1, "n_heads": 8, "n_kv_heads": 8, "mixer": {"name": "mha"}, "ffn": {"name": "none"}}
    m = DecoderLM(cfg, vocab_size=16).eval()
    assert m.cache_bytes(1000, batch=32, dtype=torch.float32) == 131_072_000
    cache = m.new_cache(32, 1000)
    with torch.no_grad():
        m(torch.randint(0, 16, (32, 1000)), cache=cache)
    assert cache.nbytes() == 131_072_000
    assert sum(t.numel() for t in cache[0].tensors()) == 32_768_000
