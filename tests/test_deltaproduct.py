"""Gated DeltaProduct (`gated_deltaproduct`, mixers/deltaproduct.py; Siems et al. 2025): the chunkwise form over the
sub-steps and the decode form against the written-out reference (fp64) and against fla-core's pure-torch
`naive_recurrent_gated_delta_product` (outputs, final state and the gradients w.r.t. q, every step's k, v and beta, the
decay and the initial state); one Householder step is Gated DeltaNet; a missing step is caught. The mixer contract is
that of every registered mixer (tests/test_mixers_contract.py and the others)."""
import pytest
import torch
import torch.nn.functional as F

from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.delta_product import chunk_delta_product, delta_product_reference, delta_product_substeps
from attnzoo.ops.delta_rule import chunk_delta_rule
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive


def _inputs(B=2, H=3, T=21, n=3, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=F.normalize(r(B, H, T, Dk), dim=-1), k=F.normalize(r(B, H, T, n, Dk), dim=-1), v=r(B, H, T, n, Dv),
                beta=torch.sigmoid(r(B, H, T, n)), g=-F.softplus(r(B, H, T)) / 0.7, s0=r(B, H, Dk, Dv))


FORMS = {"chunk": lambda q, k, v, beta, g, s0: chunk_delta_product(q, k, v, beta, g, s0, chunk_size=4),
         "substeps": lambda q, k, v, beta, g, s0: delta_product_substeps(q, k, v, beta, g, s0),
         "reference": lambda q, k, v, beta, g, s0: delta_product_reference(q, k, v, beta, g, s0)}


@pytest.mark.parametrize("form", ["chunk", "substeps"])
def test_fast_forms_equal_the_reference(form):
    x = _inputs()
    (o, s), grads = outputs_and_grads(FORMS[form], x)
    (o_ref, s_ref), g_ref = outputs_and_grads(FORMS["reference"], x)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)
    assert_grads_close(grads, g_ref, what=form)


@pytest.mark.parametrize("form", ["chunk", "reference"])
def test_parity_fla_naive_gated_delta_product(form):
    """fla's recurrence ((B, T, H, D) layout; the n steps of token t at positions t n .. t n + n - 1), fp32 inside."""
    naive = _fla_naive("gated_delta_product")
    x = _inputs()
    n = x["k"].shape[3]

    def fla(q, k, v, beta, g, s0):
        B, H, T = q.shape[:3]
        flat = lambda a: a.flatten(2, 3).transpose(1, 2)  # noqa: E731  (B, H, T, n, ...) -> (B, T n, H, ...)
        o, s = naive.naive_recurrent_gated_delta_product(
            q.transpose(1, 2), flat(k), flat(v), g.transpose(1, 2), beta.flatten(2, 3).transpose(1, 2),
            scale=q.shape[-1] ** -0.5, initial_state=s0.clone(), output_final_state=True, num_householder=n)
        return o.transpose(1, 2), s

    (o_ref, s_ref), g_ref = outputs_and_grads(fla, x, torch.float32)
    (o, s), grads = outputs_and_grads(FORMS[form], x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(FORMS[form], x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "naive_recurrent_gated_delta_product")


def test_one_householder_step_is_gated_deltanet():
    x = _inputs(n=1)
    o, s = FORMS["chunk"](**x)
    o_gdn, s_gdn = chunk_delta_rule(x["q"], x["k"][:, :, :, 0], x["v"][:, :, :, 0], x["beta"][..., 0], x["g"], x["s0"],
                                    chunk_size=4)
    torch.testing.assert_close(o, o_gdn, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_gdn, atol=1e-10, rtol=0)


def test_every_step_counts():
    """Dropping the last Householder step of each token changes the output (a missing step is not invisible)."""
    x = _inputs()
    o, _ = FORMS["reference"](**x)
    short = {**x, "k": x["k"][:, :, :, :-1], "v": x["v"][:, :, :, :-1], "beta": x["beta"][..., :-1]}
    o_short, _ = FORMS["reference"](**short)
    assert (o - o_short).abs().max() > 1e-2


def test_layer_widths_follow_the_steps():
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "gated_deltaproduct", "num_householder": 3}), vocab_size=64)
    mixer = m.mixers[0]
    h, dk, hv, dv = mixer.n_qk_heads, mixer.qk_dim, mixer.n_v_heads, mixer.v_dim
    assert mixer.qkv.out_features == h * dk + 3 * h * dk + 3 * hv * dv and mixer.b_proj.out_features == 3 * hv
    assert mixer.layer_shape()["householder_steps"] == 3
