"""DeepSeek Sparse Attention (`dsa`, mixers/dsa.py, ops/dsa.py; DeepSeek-V3.2): the op against fla-core's pure-torch
`naive_dsa` (outputs and the gradients of q, k, v) and its selection against `naive_dsa_indexer`; the fast op against
its written-out reference (fp64, a cache's chunk and a document mask); the tie rule; the indexer's KL loss; the
mixer's fast form == its reference, cached / static decode == full forward, packing, cache bytes, FLOPs exactly, with
a top-k small enough that selection really chooses (the default 32 holds every position the generic contract tests
reach); top-k >= the sequence == dense MLA; transformers' DeepseekV32Attention and DeepseekV32ForCausalLM on copied
weights, and through interop/hf (import, export, refusals); bad values refused in one line."""
import copy

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.interop import hf as interop
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.dsa import (dsa_attention, dsa_attention_reference, index_scores, indexer_kl, select_topk,
                             topk_slots)
from attnzoo.ops.packing import Documents
from tests.conftest import assert_grads_close, fp32_atol, gap_atol, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive

V = 64
SPARSE = {"name": "dsa", "index_topk": 4}  # selection chooses from the 5th token on


def _inputs(B=2, H=4, Hkv=2, T=40, D=8, HI=16, DI=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv))
    q_idx = torch.randn(B, HI, T, DI, generator=g, dtype=dtype)
    k_idx = torch.randn(B, T, DI, generator=g, dtype=dtype)
    w = torch.randn(B, HI, T, generator=g, dtype=dtype)
    return q, k, v, q_idx, k_idx, w


def _no_ties(q_idx, k_idx, w):
    """With 16 index heads an exact-zero index score (every head's relu zero) is rare; the comparisons with fla
    (whose torch.topk breaks ties its own way) are only defined without ties among a row's visible keys."""
    s = index_scores(q_idx, k_idx, w)
    T = s.shape[1]
    for b in range(s.shape[0]):
        for t in range(T):
            row = s[b, t, : T - s.shape[1] + t + 1]
            assert row.unique().numel() == row.numel()


def test_op_equals_fla_naive_dsa():
    """Outputs and the gradients of q, k, v (GQA, 2 query heads a KV head), fla's naive form (fp32 whatever its
    input; (B, T, H, D) layout) against both our forms in fp32, within 10x our fp32-vs-fp64 gap."""
    naive = _fla_naive("dsa")
    q, k, v, q_idx, k_idx, w = _inputs()
    _no_ties(q_idx, k_idx, w)
    t = lambda a: a.transpose(1, 2)  # noqa: E731
    f32 = lambda a: a.float()  # noqa: E731

    def theirs(q, k, v):
        return t(naive.naive_dsa(t(q), t(k), t(v), t(f32(q_idx)), f32(k_idx), t(f32(w)), topk=6, scale=0.3))

    for form in (dsa_attention, dsa_attention_reference):
        def ours(q, k, v):
            return form(q, k, v, q_idx.to(q.dtype), k_idx.to(q.dtype), w.to(q.dtype), topk=6, scale=0.3)

        (o_ref,), g_ref = outputs_and_grads(theirs, dict(q=q, k=k, v=v), torch.float32)
        (o,), grads = outputs_and_grads(ours, dict(q=q, k=k, v=v), torch.float32)
        (o64,), g64 = outputs_and_grads(ours, dict(q=q, k=k, v=v))
        torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
        assert_grads_close(grads, g_ref, g64, f"naive_dsa vs {form.__name__}")


@pytest.mark.parametrize("topk", [1, 6, 40])
def test_selection_equals_fla_naive_dsa_indexer(topk):
    """The same keys per query as fla's indexer (its order and its -1 padding aside); topk 40 = every causal key."""
    naive = _fla_naive("dsa")
    _, _, _, q_idx, k_idx, w = _inputs()
    _no_ties(q_idx, k_idx, w)
    T = k_idx.shape[1]
    theirs = naive.naive_dsa_indexer(q_idx.transpose(1, 2), k_idx, w.transpose(1, 2), topk=topk, activation="relu")
    slots, valid = topk_slots(index_scores(q_idx, k_idx, w), torch.ones(T, T, dtype=torch.bool).tril(), topk)
    for b in range(2):
        for i in range(T):
            expected = sorted(x for x in theirs[b, i].tolist() if x >= 0)
            assert sorted(slots[b, i][valid[b, i]].tolist()) == expected
            assert len(expected) == min(topk, i + 1)


def test_ties_go_to_the_later_key():
    """Equal scores (relu makes exact zeros common) rank the later key first, so the full forward, a decode step and
    the reference choose alike: all-zero scores choose the last k visible keys."""
    scores = torch.zeros(1, 3, 6)
    visible = torch.ones(3, 6, dtype=torch.bool).tril(3)  # the queries are the last 3 of 6 keys
    chosen = select_topk(scores, visible, 2)[0]
    assert chosen.nonzero().tolist() == [[0, 2], [0, 3], [1, 3], [1, 4], [2, 4], [2, 5]]
    scores[0, 2, 0] = 1.0  # a better key wins over the later ones
    assert select_topk(scores, visible, 2)[0, 2].nonzero().flatten().tolist() == [0, 5]


@pytest.mark.parametrize("case", ["causal", "cache-chunk", "documents"])
def test_fast_op_equals_reference(case):
    """The mask over SDPA (fast) == each query's keys ranked and gathered (reference), fp64: outputs and the
    gradients of q, k, v; whole sequences, the last 7 queries of a cache, and a packed row's documents."""
    q, k, v, q_idx, k_idx, w = _inputs(HI=4)  # 4 index heads: exact-zero ties, ranked by the rule
    visible = None
    if case == "cache-chunk":
        q, q_idx, w = q[:, :, -7:], q_idx[:, :, -7:], w[:, :, -7:]
    if case == "documents":
        ids = torch.tensor([0] * 12 + [1] * 17 + [2] * 11)
        visible = (ids[:, None] == ids[None, :]).tril()
    kw = dict(q_idx=q_idx, k_idx=k_idx, w=w, topk=5, visible=visible, scale=0.3)
    (o,), grads = outputs_and_grads(lambda **a: dsa_attention(**a, **kw), dict(q=q, k=k, v=v))
    (o_ref,), g_ref = outputs_and_grads(lambda **a: dsa_attention_reference(**a, **kw), dict(q=q, k=k, v=v))
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    assert_grads_close(grads, g_ref, what=case)


def test_indexer_kl_is_the_kl_to_the_head_summed_attention():
    """Zero when softmax(I) over the chosen keys equals the heads' mean attention there; else the KL written out."""
    q, k, _, q_idx, k_idx, w = _inputs(B=1, T=9)
    chosen = select_topk(index_scores(q_idx, k_idx, w), torch.ones(9, 9, dtype=torch.bool).tril(), 3)
    a = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    p = torch.softmax(a.masked_fill(~chosen[:, None], float("-inf")), -1).mean(1)  # (1, 9, 9)
    perfect = torch.log(p).masked_fill(~chosen, 0.0) + 5.0  # any shift: softmax is invariant
    assert indexer_kl(perfect, chosen, q, k, scale=0.3).abs() < 1e-14
    scores = index_scores(q_idx, k_idx, w)
    log_q = torch.log_softmax(scores.masked_fill(~chosen, float("-inf")), -1)
    expected = torch.stack([sum(p[0, t, s] * (p[0, t, s].log() - log_q[0, t, s]) for s in range(9) if chosen[0, t, s])
                            for t in range(9)]).mean()
    torch.testing.assert_close(indexer_kl(scores, chosen, q, k, scale=0.3), expected, atol=1e-14, rtol=0)


# ----------------------------------------------------------------------------- the mixer


def _model(mixer=SPARSE, seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(mixer, max_seq_len=64, **kw), vocab_size=V).double().eval()


VARIANTS = {"default": SPARSE, "qlora-absorb-always": {**SPARSE, "q_lora_rank": 12, "absorb": "always"},
            "never-absorb+conv3": {**SPARSE, "absorb": "never", "conv_size": 3},
            "nopos": {**SPARSE, "index_topk": 2}}


def _variant(key):
    return _model(VARIANTS[key], **({"position": {"name": "none"}} if key == "nopos" else {}))


@pytest.mark.parametrize("key", list(VARIANTS))
def test_mixer_reference_equals_fast(key):
    """Outputs and every parameter's gradient (fp64) of the fast form (mask over SDPA) and the reference (ranked and
    gathered per query); the indexer's weights get none from the output (selection is not differentiable)."""
    m = _variant(key)
    x = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 23, V, dtype=torch.float64)
    outs, grads = [], []
    for impl in ("fast", "reference"):
        for mixer in m.mixers:
            mixer.impl = impl
        out = m(x)
        outs.append(out)
        grads.append(torch.autograd.grad(out, list(m.parameters()), g, allow_unused=True))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-10, rtol=0)
    for (name, _), a, b in zip(m.named_parameters(), *grads):
        assert (a is None) == (b is None) == (".indexer." in name), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=name)


@pytest.mark.parametrize("key", list(VARIANTS))
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
def test_cached_decode_equals_full_forward(key, prompt_len):
    """A prompt, then one token a step (each step gathers its top-k latents), and chunks on a non-empty cache, both
    through the dynamic cache: equal to the full forward (fp64); measured cache bytes == analytic."""
    m = _variant(key)
    x = torch.randint(0, V, (2, prompt_len + 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, x.shape[1], torch.float64)
        steps = [m(x[:, :prompt_len], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(prompt_len, x.shape[1])]
        chunked, outs = m.new_cache(2, x.shape[1], torch.float64), []
        for a, b in ((0, prompt_len), (prompt_len, prompt_len + 5), (prompt_len + 5, x.shape[1])):
            outs.append(m(x[:, a:b], cache=chunked))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)
    assert cache.nbytes() == m.cache_bytes(x.shape[1], 2, torch.float64)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
def test_static_decode_equals_full_forward(prompt_len, impl):
    from tests.test_static_decode import check_static_decode

    check_static_decode(_variant("qlora-absorb-always" if impl == "fast" else "default"), impl, prompt_len, 12)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_packed_documents_equal_each_alone(impl):
    """Outputs and gradients of a packed batch (document masks bound the selection) == each document alone."""
    from tests.test_packing import packed_ids

    m = _model(mixer={**SPARSE, "index_topk": 3}).train()
    for mixer in m.mixers:
        mixer.impl = impl
    ids = packed_ids()
    x = torch.randint(0, V, ids.shape, generator=torch.Generator().manual_seed(1))
    w = torch.randn(*ids.shape, V, dtype=torch.float64)
    out = m(x, documents=Documents(ids))
    (out * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    for b in range(ids.shape[0]):
        for d in ids[b].unique():
            sel = (ids[b] == d).nonzero().squeeze(1)
            alone = m(x[b:b + 1, sel])
            torch.testing.assert_close(out[b, sel], alone[0], rtol=0, atol=1e-12)
            (alone[0] * w[b, sel]).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_topk_at_least_the_sequence_is_dense_mla():
    """index_topk >= every position: the same weights as an `mla` model give the same logits, full and decoded;
    a small top-k does not (the selection really restricts)."""
    dense = _model({"name": "dsa", "index_topk": 64})
    mla = DecoderLM(tiny_model_cfg({"name": "mla"}, max_seq_len=64), vocab_size=V).double().eval()
    mla.load_state_dict({k: t for k, t in dense.state_dict().items() if ".indexer." not in k})
    x = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(dense(x), mla(x), atol=1e-12, rtol=0)
        cache = dense.new_cache(2, 30, torch.float64)
        steps = [dense(x[:, :5], cache=cache)] + [dense(x[:, t:t + 1], cache=cache) for t in range(5, 30)]
        torch.testing.assert_close(torch.cat(steps, 1), mla(x), atol=1e-12, rtol=0)
        sparse = copy.deepcopy(dense)
        for mixer in sparse.mixers:
            mixer.index_topk = 4
        assert (sparse(x)[:, 4:] - mla(x)[:, 4:]).abs().amax(-1).min() > 1e-6  # every position past the 4th moves
        torch.testing.assert_close(sparse(x)[:, :4], mla(x)[:, :4], atol=1e-12, rtol=0)


def test_the_indexer_learns_from_its_loss_only():
    """In training the KL loss (aux_loss, logged as dsa/indexer_kl) gives the indexer its gradient and nothing else
    one: every other parameter's gradient of LM loss + aux == of the LM loss alone. index_loss_coef=0: frozen."""
    m = _model().train()
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(4))
    lm = m(x).square().mean()
    aux = m.aux_loss()
    assert aux is not None and aux > 0 and set(m.stats()) == {"dsa/indexer_kl"}
    params = dict(m.named_parameters())
    g_lm = torch.autograd.grad(lm, list(params.values()), retain_graph=True, allow_unused=True)
    g_all = torch.autograd.grad(lm + aux, list(params.values()), allow_unused=True)
    for (name, _), a, b in zip(params.items(), g_lm, g_all):
        if ".indexer." in name:
            assert a is None, name
            if name.endswith(("wq_b.weight", "wk.weight", "weights_proj.weight")):
                assert b.abs().max() > 0, name
        else:
            assert b is None or torch.equal(a, b), name
    with torch.no_grad():
        m(x)
    assert m.aux_loss() is None  # no gradient, no loss
    frozen = _model({**SPARSE, "index_loss_coef": 0.0}).train()
    frozen(x)
    assert frozen.aux_loss() is None and not any(p.requires_grad for mx in frozen.mixers for p in mx.indexer.parameters())


def test_flops_exact_over_the_reference_form():
    """The reference form's counted matmuls (the indexer over every causal key, attention over the chosen ones, every
    projection once) == L x flops_per_token(L), at lengths below and above the top-k."""
    from tests.test_flops_exact import counter

    for L in (3, 17, 40):
        m = _model({**SPARSE, "q_lora_rank": 12})
        mixer = m.mixers[0]
        mixer.impl = "reference"
        x = torch.randn(1, L, m.cfg.d_model, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        with torch.no_grad(), counter() as fc:
            mixer(x, positions=torch.arange(L))
        assert fc.get_total_flops() == pytest.approx(mixer.flops_per_token(L) * L, rel=1e-12)


def test_decode_reads_the_topk_latents_and_every_index_key():
    """decode_read_bytes: the index keys grow with the context, the latents read stop at the top-k."""
    mixer = _model().mixers[0]
    per_key = mixer.index_head_dim * 8
    assert mixer.decode_read_bytes(100, 1, torch.float64) - mixer.decode_read_bytes(50, 1, torch.float64) == 50 * per_key
    assert mixer.cache_bytes(100, 1, torch.float64) - mixer.cache_bytes(50, 1, torch.float64) == 50 * (
        per_key + (mixer.kv_lora_rank + mixer.dr) * 8)


@pytest.mark.parametrize("override, field, phrase", [
    ("model.mixer.index_n_heads=0", "model.layers[0].mixer.index_n_heads", "must be >= 1"),
    ("model.mixer.index_head_dim=2", "model.layers[0].mixer.index_head_dim", "less than qk_rope_head_dim=4"),
    ("model.mixer.index_head_dim=0", "model.layers[0].mixer.index_head_dim", "must be positive"),
    ("model.mixer.index_loss_coef=-1", "model.layers[0].mixer.index_loss_coef", "must be >= 0"),
])
def test_bad_values_are_refused_in_one_line(override, field, phrase, tmp_path):
    from attnzoo.training.run import train
    from tests.conftest import compose_cfg

    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(["debug=smoke", "model/mixer=dsa", "model.d_model=32", "model.n_heads=4", override], out))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and phrase in msg, msg
    assert not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- transformers' DeepSeek-V3.2

HF_SIZES = dict(q_lora_rank=12, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
                index_n_heads=8, index_head_dim=8, index_topk=5)
HF_MIXER = {"name": "dsa", "rope_interleave": True, **HF_SIZES}  # V3.2's main RoPE is interleaved


def _hf_config(layers: int, **over):
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_parity_attention import hf_common

    cfg = transformers.DeepseekV32Config(**{**hf_common(), "num_hidden_layers": layers, "num_key_value_heads": 4},
                                         **{"first_k_dense_replace": layers, "n_routed_experts": 4,
                                            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, **HF_SIZES, **over})
    cfg._attn_implementation = "eager"
    return cfg


def _widen(module) -> None:
    """Random-init is tiny (std 0.02): widen it so that differences would show (norm weights and biases 0.5 .. 1.5)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)


@torch.no_grad()
def copy_dsa(mixer, attn) -> None:
    """transformers' DeepseekV32Attention -> ours: MLA's weights under our names, the indexer's under the same."""
    for ours, theirs in (("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj"),
                         ("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
                         ("o_proj", "o_proj"), ("indexer", "indexer")):
        getattr(mixer, ours).load_state_dict(getattr(attn, theirs).state_dict())


def test_attention_module_equals_transformers_deepseek_v32():
    """Our layer on DeepseekV32Attention's weights (eager, an explicit causal mask): the same top-k keys per query as
    its indexer, and outputs within 10x our own fp32-vs-fp64 gap; with 5 of up to 24 keys the selection matters."""
    mv = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    cfg = _hf_config(1)
    torch.manual_seed(0)
    attn = mv.DeepseekV32Attention(cfg, 0).eval()
    _widen(attn)
    model = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "mixer": HF_MIXER, "max_seq_len": 256,
                       "position": {"name": "rope", "theta": 10000.0}}, vocab_size=V).eval()
    mixer = model.mixers[0]
    copy_dsa(mixer, attn)
    B, T = 2, 24
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)
    cos_sin = mv.DeepseekV32RotaryEmbedding(cfg)(x, pos[None].expand(B, -1))
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        theirs, _ = attn(x, cos_sin, mask, position_ids=pos[None].expand(B, -1))
        got = mixer(x, positions=pos)
        got64 = copy.deepcopy(mixer).double()(x.double(), positions=pos)
        hf_idx = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), cos_sin, mask[:, 0], None).long()
        slots, valid = topk_slots(index_scores(*mixer.indexer(x, mixer.query_input(x), pos, mixer.rope)),
                                  torch.ones(T, T, dtype=torch.bool).tril(), 5)
    for b in range(B):
        for t in range(T):
            assert sorted(slots[b, t][valid[b, t]].tolist()) == sorted(s for s in hf_idx[b, t].tolist() if s <= t)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(got, theirs, atol=gap_atol(got, got64), rtol=0)
    with torch.no_grad():
        mixer.index_topk = T
        assert (mixer(x, positions=pos) - theirs).abs().max() > 1e-2  # dense differs: the top-k is doing work


@pytest.fixture(scope="module")
def v32_pair():
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_parity_attention import build_hf, copy_common, our_model

    hf = build_hf(transformers.DeepseekV32ForCausalLM, _hf_config(2), "eager")
    ours = our_model(HF_MIXER)
    copy_common(ours, hf)
    for block, layer in zip(ours.blocks, hf.model.layers):
        copy_dsa(block.mixer, layer.self_attn)
    return ours, hf


def test_whole_model_logits_equal_deepseek_v32_for_causal_lm(v32_pair):
    """DeepseekV32ForCausalLM (2 layers, dense MLPs) and ours on its weights: logits of a 20-token prompt (past the
    top-k of 5) within 10x our fp32-vs-fp64 gap."""
    ours, hf = v32_pair
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=idx).logits
    got, atol = fp32_atol(ours, lambda m: m(idx))
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=atol, rtol=1e-5)


def test_greedy_tokens_equal_deepseek_v32(v32_pair):
    """Greedy generation, each side through its own cache (transformers' indexed-attention cache, our latents plus
    index keys): the same tokens. An explicit all-ones attention mask: without one, generate takes the prompt's
    token 0 (= pad_token_id) for left padding and masks it."""
    ours, hf = v32_pair
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(idx, 12, temperature=0.0), ref)



# ----------------------------------------------------------------------------- interop/hf: DeepseekV32ForCausalLM

def test_v32_checkpoint_imports_with_transformers_logits(tmp_path):
    """A saved DeepseekV32ForCausalLM (layer 1 MoE: 2 routing groups, a shared expert, a non-zero selection bias)
    imported as model.init_from does (config_from_hf + load_hf_weights): dsa layers whose logits of a 20-token prompt
    (past the top-k of 5) equal transformers' within 10x our fp32-vs-fp64 gap."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_io import import_dir

    torch.manual_seed(0)
    ref = transformers.DeepseekV32ForCausalLM(_hf_config(2, first_k_dense_replace=1, n_group=2, n_shared_experts=1,
                                                         moe_intermediate_size=16, routed_scaling_factor=2.5,
                                                         experts_implementation="eager")).eval()
    _widen(ref)
    ref.model.layers[1].mlp.gate.e_score_correction_bias.data.normal_(0.0, 0.1)  # a selection bias to carry over
    ref.save_pretrained(tmp_path)
    ours = import_dir(tmp_path)
    assert [type(m).__name__ for m in ours.mixers] == ["DeepSeekSparseAttention"] * 2 and ours.mixers[0].index_topk == 5
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=idx, use_cache=False).logits
    got, atol = fp32_atol(ours, lambda m: m(idx))
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


def test_export_to_deepseek_v32_and_back(tmp_path):
    """A dsa + MoE model exported (attnzoo-export's export_model): DeepseekV32ForCausalLM, whose logits (transformers'
    own loader, its default SDPA) equal ours within the fp32 gap; imported back, every tensor exactly ours."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_io import import_dir, our_model

    ffn = {"name": "moe", "n_experts": 4, "top_k": 2, "d_ff": 16, "scoring": "sigmoid", "n_group": 2, "topk_group": 1,
           "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense": 1, "dense_d_ff": 48}
    ours = our_model({"d_model": 32, "n_layers": 2, "n_heads": 4, "tie_embeddings": False, "mixer": HF_MIXER,
                      "ffn": ffn})  # widened, with a non-zero selection bias
    config = interop.export_model(ours, tmp_path)
    assert config["architectures"] == ["DeepseekV32ForCausalLM"] and config["mlp_layer_types"] == ["dense", "sparse"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    want, atol = fp32_atol(ours, lambda m: m(idx))
    got = theirs(input_ids=idx, use_cache=False).logits.detach()
    assert type(theirs).__name__ == "DeepseekV32ForCausalLM" and want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    again = import_dir(tmp_path).state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(again[k], v), k


@pytest.mark.parametrize("mixer, field", [({"q_lora_rank": None}, "model.mixer.q_lora_rank"),
                                          ({"rope_interleave": False}, "model.mixer.rope_interleave")])
def test_export_refuses_what_v32_cannot_hold(mixer, field, tmp_path):
    """V3.2's attention always has q_a_proj and an interleaved main RoPE: anything else is refused in one line; so is
    a config.json whose dense layers are not the first k."""
    model = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "mixer": {**HF_MIXER, **mixer}}, vocab_size=V)
    with pytest.raises(ConfigError) as e:
        interop.export_model(model, tmp_path / "out")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and "DeepSeek-V3.2" in msg, msg
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError) as e:
        interop.config_from_hf({**_hf_config(2).to_dict(), "mlp_layer_types": ["sparse", "dense"]})
    assert str(e.value).startswith("config.json:mlp_layer_types") and "\n" not in str(e.value), str(e.value)
