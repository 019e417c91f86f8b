"""Forgetting Attention (`fox`, mixers/forgetting.py; Lin et al. 2025): the op against fla-core's pure-torch
`naive_forgetting_attn` (outputs and the gradients w.r.t. q, k, v and the log gates, GQA included), the fast op
against its written-out reference with a cache's chunk and a document mask (fp64), and what the layer means: with
every gate 1 it is the softmax attention of the same weights; a gate of ~0 after a key hides that key from every
later query. The mixer contract (decode == forward, chunked prefill, cache bytes, reference == fast, FLOPs) is
tests/test_mixers_contract.py's, packing tests/test_packing.py's, as for every registered mixer."""
import pytest
import torch

from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.forgetting_attention import forget_bias, forgetting_attention, forgetting_attention_reference
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive


def _inputs(B=2, H=4, Hkv=2, T=40, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv))
    # log gates over a wide range: near 0 (keep) to ~-4 (forget almost at once)
    log_f = torch.nn.functional.logsigmoid(3 * torch.randn(B, H, T, generator=g, dtype=dtype) + 1)
    return q, k, v, log_f


def test_parity_fla_naive_forgetting_attn():
    """fla's naive form (fp32 whatever its input; (B, T, H, D) layout, GQA by repeating KV heads)."""
    naive = _fla_naive("forgetting_attn")
    q, k, v, log_f = _inputs()
    x = dict(q=q, k=k, v=v, log_f=log_f)
    t = lambda a: a.transpose(1, 2)  # noqa: E731

    def theirs(q, k, v, log_f):
        return t(naive.naive_forgetting_attn(t(q), t(k), t(v), t(log_f), scale=0.3))

    ours = lambda q, k, v, log_f: forgetting_attention(q, k, v, log_f, scale=0.3)  # noqa: E731
    (o_ref,), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o,), grads = outputs_and_grads(ours, x, torch.float32)
    (o64,), g64 = outputs_and_grads(ours, x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "naive_forgetting_attn")


@pytest.mark.parametrize("q_len", [40, 7, 1])
def test_fast_op_equals_reference(q_len):
    """The cumulative-sum bias (fast) == the gates summed between each key and query (reference), for a whole
    sequence and for the last q_len queries of a cache, in fp64: outputs and every input's gradient."""
    q, k, v, log_f = _inputs()
    x = dict(q=q[:, :, -q_len:], k=k, v=v, log_f=log_f)
    (o,), grads = outputs_and_grads(lambda **a: forgetting_attention(**a, scale=0.3), x)
    (o_ref,), g_ref = outputs_and_grads(lambda **a: forgetting_attention_reference(**a, scale=0.3), x)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    assert_grads_close(grads, g_ref, what=f"q_len={q_len}")


def test_document_mask_keeps_documents_apart():
    """Under a packed row's document mask each document equals its own call (the gates of the document before
    never reach it, though the cumulative sum runs over the whole row)."""
    q, k, v, log_f = _inputs(B=1, T=30)
    ids = torch.tensor([0] * 12 + [1] * 18)
    mask = (ids[:, None] == ids[None, :])[None, None]
    for fn in (forgetting_attention, forgetting_attention_reference):
        packed = fn(q, k, v, log_f, scale=0.3, mask=mask)
        alone = [fn(q[:, :, s], k[:, :, s], v[:, :, s], log_f[:, :, s], scale=0.3) for s in (slice(0, 12), slice(12, 30))]
        torch.testing.assert_close(packed, torch.cat(alone, 2), atol=1e-12, rtol=0)


def test_bias_is_the_sum_of_the_gates_after_the_key():
    """The hand-checked meaning on 3 tokens: query 2 scores key 0 with log f_1 + log f_2, key 1 with log f_2, key 2
    with 0; query 0 sees key 0 only."""
    log_f = torch.tensor([[[-0.5, -1.0, -2.0]]], dtype=torch.float64)
    b = forget_bias(log_f, 3)[0, 0]
    expected = torch.tensor([[0.0, -torch.inf, -torch.inf], [-1.0, 0.0, -torch.inf], [-3.0, -2.0, 0.0]],
                            dtype=torch.float64)
    torch.testing.assert_close(b, expected)


def _model(**mixer):
    torch.manual_seed(0)
    return DecoderLM(tiny_model_cfg({"name": "fox", **mixer}), vocab_size=64).double().eval()


def test_gates_at_one_give_softmax_attention():
    """Forget gates saturated at 1 (log f = 0) leave the scores alone: the layer is causal softmax attention of the
    same q / k / v / o weights (the gqa mixer's path)."""
    m = _model()
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for mixer in m.mixers:
            mixer.f_proj.weight.zero_()
            mixer.f_bias.fill_(1e4)  # sigmoid(1e4) == 1 in fp64: log f == 0
        fox = m(x)
        for mixer in m.mixers:
            mixer.f_bias.fill_(-1e4)
        forgetting = m(x)
        for mixer in m.mixers:  # the same layer through plain causal SDPA
            mixer.forget_attend = lambda q, k, v, log_f, mask=None, mixer=mixer: mixer.attend(q, k, v, 0)
        plain = m(x)
    torch.testing.assert_close(fox, plain, atol=1e-10, rtol=0)
    assert (forgetting - plain).abs().max() > 1e-3  # gates at 0: each query sees (almost) only itself


def test_no_rope_unless_asked():
    """The paper's FoX has no RoPE (the gate is the position signal): with model.position=rope the layer is
    unrotated unless use_rope=true."""
    assert all(mx.rope is None for mx in _model().mixers)
    assert all(mx.rope is not None for mx in _model(use_rope=True).mixers)


def test_decay_time_range_sets_each_heads_initial_memory():
    """decay_time_range [2, 200]: for a zero input head h forgets at exp(-1 / t_h), t_h log-spaced 2 .. 200."""
    m = _model(decay_time_range=[2.0, 200.0])
    mixer = m.mixers[0]
    f = torch.sigmoid(mixer.f_bias)
    t = torch.exp(torch.linspace(torch.log(torch.tensor(2.0)), torch.log(torch.tensor(200.0)), mixer.n_heads))
    torch.testing.assert_close(-1 / torch.log(f), t.double(), rtol=1e-5, atol=0)  # the bias is built in fp32
    assert (_model().mixers[0].f_bias == 0).all()  # the paper's default
