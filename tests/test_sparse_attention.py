"""Block-sparse attention (nsa, moba): parity with fla-core's NSA reference (output and gradients) and with an
independent mask-based MoBA written from the paper, the sparsity really applied (small blocks, long sequences),
cached decode == full forward where selection is sparse, cache bytes, FLOPs, and bad options refused.
The shared contract (tests/test_mixers_contract.py) runs on both with their default (larger) blocks."""
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.sparse_attention import block_means, moba_attention, moba_keys, nsa_attention, nsa_keys
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads, tiny_model_cfg

V = 64


def _mean_pooling(x, chunk_size, cu_seqlens=None):
    """fla's mean_pooling (a triton kernel there) in torch: (B, T, H, D) -> (B, ceil(T/BS), H, D), a trailing
    partial block averaged over its own length."""
    B, T, H, D = x.shape
    n = math.ceil(T / chunk_size)
    pad = n * chunk_size - T
    xs = torch.cat([x, x.new_zeros(B, pad, H, D)], 1).view(B, n, chunk_size, H, D).sum(2)
    counts = torch.full((n,), float(chunk_size), dtype=x.dtype)
    counts[-1] = chunk_size - pad
    return xs / counts[None, :, None, None]


def fla_nsa_naive():
    """fla-core's pure-torch NSA reference (`fla/ops/nsa/naive.py`), loaded by file path. Its two imports
    from `fla.ops.utils` are triton modules; they are stood in for (only `mean_pooling` is used without
    cu_seqlens), so that `import fla` (which imports triton, never installed on CPU) does not run."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed (pip install fla-core --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "nsa" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} not in this fla-core version")
    utils = types.ModuleType("fla.ops.utils")
    utils.prepare_chunk_offsets = None
    pooling = types.ModuleType("fla.ops.utils.pooling")
    pooling.mean_pooling = _mean_pooling
    saved = {k: sys.modules.get(k) for k in ("fla.ops.utils", "fla.ops.utils.pooling")}
    sys.modules.update({"fla.ops.utils": utils, "fla.ops.utils.pooling": pooling})
    try:
        mod_spec = importlib.util.spec_from_file_location("fla_naive_nsa", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def qkv(B=2, T=64, H=4, Hkv=2, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype)
    gates = torch.rand(3, B, H, T, generator=g, dtype=dtype)
    return q, k, v, gates


def window_reference(q, k, v, W):
    """Sliding-window causal attention written out (fla's naive NSA calls flash-attn for this branch)."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return torch.softmax(s.masked_fill(~((j <= i) & (j > i - W)), float("-inf")), -1) @ v


@pytest.mark.parametrize("T,bs,S,W", [(64, 8, 3, 0), (64, 8, 4, 16), (50, 4, 5, 8), (96, 16, 3, 7)])
def test_nsa_matches_fla_naive(T, bs, S, W):
    """Compressed + selected branches from fla's naive_nsa_compression / naive_nsa_topk / naive_nsa_selection
    (the pieces `naive_nsa` composes; it asserts a GQA group >= 16 and uses flash-attn for the window): the output
    and the gradients w.r.t. q, k, v (through the block means too) and the gates (g_swa where there is a window).
    The block selection is an index (top-k), no gradient on either side."""
    naive = fla_nsa_naive()
    q, k, v, (g_cmp, g_slc, g_swa) = qkv(T=T, seed=T + bs)
    x = dict(q=q, k=k, v=v, g_cmp=g_cmp, g_slc=g_slc, **(dict(g_swa=g_swa) if W else {}))
    scale = q.shape[-1] ** -0.5
    bthd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  fla's layout (B, T, H, D)
    picked = {}

    def theirs(q, k, v, g_cmp, g_slc, g_swa=None):
        k_cmp, v_cmp = _mean_pooling(bthd(k), bs), _mean_pooling(bthd(v), bs)
        o_cmp, _ = naive.naive_nsa_compression(bthd(q), k_cmp, v_cmp, block_size=bs, scale=scale)
        picked["idx"] = idx = naive.naive_nsa_topk(bthd(q), k_cmp, block_counts=S, block_size=bs, scale=scale)
        o_slc = naive.naive_nsa_selection(bthd(q), bthd(k), bthd(v), idx, block_size=bs, scale=scale)
        ref = (o_cmp * bthd(g_cmp)[..., None] + o_slc * bthd(g_slc)[..., None]).transpose(1, 2)
        return ref + g_swa[..., None] * window_reference(q, k, v, W) if W else ref

    def ours(q, k, v, g_cmp, g_slc, g_swa=None):
        return nsa_attention(q, k, v, block_means(k, bs), block_means(v, bs), g_cmp, g_slc, g_swa, q_start=0,
                             block_size=bs, block_counts=S, window=W)

    (ref,), g_ref = outputs_and_grads(theirs, x)
    (out,), grads = outputs_and_grads(ours, x)
    (out64,), g64 = outputs_and_grads(ours, x, torch.float64)
    # fla's naive NSA computes in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(out, ref, atol=gap_atol(out, out64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "nsa")
    # the selection is really sparse: some query reads fewer blocks than it could
    n_sel = (picked["idx"] >= 0).sum(-1)
    assert n_sel.max() == S and (torch.arange(T) // bs + 1).max() > S


def moba_from_paper(q, k, v, block_size, topk):
    """MoBA as the paper's Algorithm 1 / the official `moba_naive` state it, over a full score matrix: the
    gate q . mean(K_block) for every block, +inf for the query's own block, -inf for later blocks, top-k of
    all of them, then causal softmax attention restricted to the chosen blocks."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    n = math.ceil(T / block_size)
    means = torch.stack([k[:, :, c * block_size:(c + 1) * block_size].mean(2) for c in range(n)], 2)
    gate = q @ means.transpose(-1, -2)  # (B, H, T, n)
    blk = torch.arange(T)[:, None] // block_size
    c = torch.arange(n)[None, :]
    gate = gate.masked_fill(c == blk, float("inf")).masked_fill(c > blk, float("-inf"))
    top = gate.topk(min(topk, n), dim=-1)
    chosen = torch.zeros_like(gate, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
    allow = chosen.repeat_interleave(block_size, -1)[..., :T] & (torch.arange(T)[None, :] <= torch.arange(T)[:, None])
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    return torch.softmax(s.masked_fill(~allow, float("-inf")), -1) @ v


@pytest.mark.parametrize("T,bs,topk", [(64, 8, 3), (50, 4, 4), (33, 16, 2), (64, 8, 1)])
def test_moba_matches_the_paper_form(T, bs, topk):
    """fla-core's MoBA (`fla/ops/moba/parallel.py`) needs flash-attn on CUDA and has no torch reference: the
    comparison is with the paper's algorithm written independently above."""
    q, k, v = (x.double() for x in qkv(T=T, seed=T + topk)[:3])  # all in fp64
    ours = moba_attention(q, k, v, block_means(k, bs), q_start=0, block_size=bs, topk=topk)
    torch.testing.assert_close(ours, moba_from_paper(q, k, v, bs, topk), atol=1e-10, rtol=0)
    ref = moba_attention(q, k, v, block_means(k, bs), q_start=0, block_size=bs, topk=topk, reference=True)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)


def test_sparse_limits_are_dense_or_local_attention():
    """MoBA with top-k covering every block and NSA selecting every block (only that branch) are causal
    attention; MoBA with top-k = 1 is block-local attention."""
    from attnzoo.ops.attention import attention_mask, attention_reference

    T, bs = 48, 8
    q, k, v, (g_cmp, g_slc, g_swa) = qkv(T=T, dtype=torch.float64)
    causal = attention_reference(q, k, v, mask=attention_mask(T, T, causal=True))
    torch.testing.assert_close(moba_attention(q, k, v, block_means(k, bs), q_start=0, block_size=bs, topk=6), causal)
    zero, one = torch.zeros_like(g_cmp), torch.ones_like(g_slc)
    nsa = nsa_attention(q, k, v, block_means(k, bs), block_means(v, bs), zero, one, zero, q_start=0, block_size=bs,
                        block_counts=6, window=0)
    torch.testing.assert_close(nsa, causal)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    local = attention_reference(q, k, v, mask=(j <= i) & (j // bs == i // bs))
    torch.testing.assert_close(moba_attention(q, k, v, block_means(k, bs), q_start=0, block_size=bs, topk=1), local)
    sparse = moba_attention(q, k, v, block_means(k, bs), q_start=0, block_size=bs, topk=2)
    assert (sparse - causal).abs().max() > 1e-3  # and a sparse setting is neither


SMALL = {"nsa": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 5},
         "moba": {"name": "moba", "block_size": 4, "topk": 2},
         "nsa+conv": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 0, "conv_size": 3}}


def build(key, seed=0):
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(SMALL[key]), vocab_size=V).eval()


@pytest.mark.parametrize("key", list(SMALL))
@pytest.mark.parametrize("chunks", [(1,) * 30, (7,) + (1,) * 23, (9, 3, 14, 1, 3)], ids=["decode", "prefill7", "chunks"])
def test_cached_decode_equals_full_forward_when_sparse(key, chunks):
    """Sequences of 30 tokens in blocks of 4 (8 blocks, 3 or 2 selected): decode and chunked prefill see the
    same blocks, block means and selections as the full forward."""
    m = build(key).double()
    x = torch.randint(0, V, (2, sum(chunks)), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(x)
        cache, outs, s = m.new_cache(2, x.shape[1], torch.float64), [], 0
        for c in chunks:
            outs.append(m(x[:, s:s + c], cache=cache))
            s += c
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)
    for n in (1, 4, 30):
        c = m.new_cache(1, n)
        with torch.no_grad():
            m.float()(x[:1, :n], cache=c)
        assert c.nbytes() == m.cache_bytes(n, batch=1)
        m.double()


@pytest.mark.parametrize("key", list(SMALL))
def test_reference_form_matches_fast_form_when_sparse(key):
    m = build(key).double()
    x = torch.randint(0, V, (2, 26), generator=torch.Generator().manual_seed(5))
    g = torch.randn(2, 26, V, dtype=torch.float64)
    outs = {}
    for impl in ("fast", "reference"):
        for mixer in m.mixers:
            mixer.impl = impl
        y = m(x)
        outs[impl] = (y, torch.autograd.grad(y, list(m.parameters()), g, allow_unused=True))
    torch.testing.assert_close(outs["fast"][0], outs["reference"][0], atol=1e-9, rtol=0)
    for a, b in zip(outs["fast"][1], outs["reference"][1]):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=1e-8, rtol=0)


def test_cache_bytes_formulas():
    m = build("nsa")
    layer = m.mixers[0]
    hkv, d = layer.n_kv_heads, layer.head_dim
    assert layer.cache_bytes(30) == 2 * hkv * d * (30 + 7) * 4  # full K/V + 7 complete block means of K and V
    moba = build("moba").mixers[0]
    assert moba.cache_bytes(30) == hkv * d * (2 * 30 + 7) * 4  # full K/V + 7 block mean keys


def test_flops_count_the_sparse_keys():
    """Per-position key counts by enumeration, and the long-context FLOPs grow like the selected keys, not
    like L: NSA at 4096 tokens reads 3 blocks + window + L/BS compressed keys per query."""
    cmp, slc = nsa_keys(12, 4, 3)
    # positions 0..11: compressed blocks visible (t+1)//4; selected: all tokens while <= 3 blocks exist
    assert cmp == sum((p + 1) // 4 for p in range(12)) / 12 and slc == sum(p + 1 for p in range(12)) / 12
    _, slc_long = nsa_keys(4096, 16, 4)
    assert 3 * 16 < slc_long <= 4 * 16
    gate, keys = moba_keys(4096, 16, 3)
    assert 2 * 16 < keys <= 3 * 16 and gate == pytest.approx(sum(p // 16 for p in range(4096)) / 4096)
    torch.manual_seed(0)
    gqa = DecoderLM(tiny_model_cfg("gqa"), vocab_size=V).mixers[0]
    for key in ("moba", "nsa"):  # blocks of 4: the router / compressed keys cost L/4, the selection a constant
        layer = build(key).mixers[0]
        proj = layer.flops_per_token(1)
        assert layer.flops_per_token(8192) - proj < 0.5 * (gqa.flops_per_token(8192) - gqa.flops_per_token(1))


@pytest.mark.parametrize("override,field", [
    (["model/mixer=nsa", "model.mixer.block_counts=2"], "model.mixer.block_counts"),
    (["model/mixer=nsa", "model.mixer.block_size=0"], "model.mixer.block_size"),
    (["model/mixer=nsa", "model.mixer.block_size=24"], "model.mixer.block_size"),  # does not divide seq_len 32
    (["model/mixer=nsa", "model.mixer.block_counts=200"], "model.mixer.block_counts"),  # > max_seq_len blocks
    (["model/mixer=nsa", "model.mixer.window=-1"], "model.mixer.window"),
    (["model/mixer=moba", "model.mixer.topk=0"], "model.mixer.topk"),
    (["model/mixer=moba", "model.mixer.topk=129"], "model.mixer.topk"),
    (["model/mixer=moba", "model.mixer.block_size=5"], "model.mixer.block_size"),
    (["model/mixer=moba", "model/position=alibi"], "model.position.name"),
])
def test_bad_options_refused_in_one_line(make_cfg, override, field):
    from attnzoo.training.config_checks import validate

    cfg = make_cfg("debug=smoke", "data.seq_len=32", *override)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    where = str(e.value).split(":")[0]  # a mixer's field is named by its layer: model.layers[0].mixer.topk
    assert where.replace("layers[0].", "") == field and "\n" not in str(e.value), str(e.value)


def test_trains_and_generates(make_cfg):
    """The smoke run of each through the whole app on the small char corpus: the validation loss falls and ends
    below the uniform ln(V); the cache is reported."""
    from attnzoo.training.run import train
    from tests.conftest import SMALL_TEXT, assert_learns

    for mixer in ("nsa", "moba"):
        out = Path(make_cfg().paths.output_dir).parent / mixer
        cfg = make_cfg("debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "optim.lr=3e-3", f"model/mixer={mixer}",
                       "model.mixer.block_size=8", output_dir=out)
        metrics = train(cfg)
        assert_learns(out)
        assert metrics["cache/bytes_per_token"] > 0
