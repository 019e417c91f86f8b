"""Every registered mixer, with its default config on a tiny model and again with a short conv
(`conv_size=3`: on the input for attention mixers, on q/k/v for the recurrent ones), and every mixer with a
`qk_norm` option again with it on (per-head q/k RMSNorm, `+qknorm`) and with Qwen3-Next's gated form
(`qk_norm` and `output_gate`, `+gated`), honours the mixer contract: cached decode == full forward, chunked prefill == full forward, measured cache bytes ==
analytic, causality, reference == fast form. New mixers are picked up from the registry automatically.
Equivalence is checked in float64 (the forms differ only in summation order, so fp32 rounding would
need a tolerance that hides real bugs)."""
import dataclasses

import pytest
import torch

from attnzoo.models.decoder import DecoderLM
from attnzoo.config.registry import MIXERS
from tests.conftest import gap_atol, tiny_model_cfg

# every mixer as configured by default, every mixer with a short conv of kernel 3, and q/k norm where offered
QK_NORM = [n for n in MIXERS.names() if "qk_norm" in {f.name for f in dataclasses.fields(MIXERS.get(n).config_cls)}]
MIXER_NAMES = (MIXERS.names() + [f"{n}+conv3" for n in MIXERS.names()] + [f"{n}+qknorm" for n in QK_NORM]
               + [f"{n}+gated" for n in QK_NORM])
V = 64


def mixer_cfg(name: str) -> dict:
    base, _, variant = name.partition("+")
    if variant in ("qknorm", "gated"):
        return {"name": base, "qk_norm": True, "output_gate": variant == "gated"}
    return {"name": base, "conv_size": int(variant.removeprefix("conv"))} if variant else {"name": base}


def build(name: str, seed: int = 0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(mixer_cfg(name), **kw), vocab_size=V).eval()


@pytest.mark.parametrize("name", MIXER_NAMES)
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
def test_cached_decode_equals_full_forward(name, prompt_len):
    m = build(name).double()
    T = prompt_len + 9
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, T, torch.float64)
        steps = [m(x[:, :prompt_len], cache=cache)]
        for t in range(prompt_len, T):
            steps.append(m(x[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
    assert cache.seq_len == T


@pytest.mark.parametrize("name", MIXER_NAMES)
@pytest.mark.parametrize("chunks", [(3, 7, 6), (4, 4, 1, 7), (9, 2, 5)], ids=lambda c: "-".join(map(str, c)))
def test_chunked_prefill_equals_full_forward(name, chunks):
    """Several multi-token calls in a row on a non-empty cache: state, ring, latents and conv tails
    carried across call boundaries exactly as the one-call forward carries them across positions."""
    m = build(name).double()
    x = torch.randint(0, V, (2, sum(chunks)), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(x)
        cache, outs, s = m.new_cache(2, x.shape[1], torch.float64), [], 0
        for c in chunks:
            outs.append(m(x[:, s : s + c], cache=cache))
            s += c
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", MIXER_NAMES)
@pytest.mark.parametrize("context", [1, 5, 33])
def test_measured_cache_bytes_equal_analytic(name, context):
    m = build(name)
    cache = m.new_cache(3, context)
    with torch.no_grad():
        m(torch.randint(0, V, (3, context)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(context, batch=3, dtype=torch.float32)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_causal(name):
    m = build(name).double()  # the prefix compared in fp64
    x = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % V
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[0, :10], b[0, :10], atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_reference_form_matches_fast_form(name):
    m = build(name).double()
    x = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(3))
    fast = m(x)
    for mixer in m.mixers:
        mixer.impl = "reference"
    ref = m(x)
    torch.testing.assert_close(fast, ref, atol=1e-9, rtol=0)
    g = torch.randn_like(fast)
    params = [p for p in m.parameters()]
    grads_ref = torch.autograd.grad(ref, params, g, allow_unused=True)
    for mixer in m.mixers:
        mixer.impl = "fast"
    grads_fast = torch.autograd.grad(m(x), params, g, allow_unused=True)
    for a, b in zip(grads_ref, grads_fast):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=1e-8, rtol=0)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_flops_and_generate(name):
    m = build(name)
    assert m.flops_per_token(128) > 2 * m.cfg.d_model * V
    out = m.generate(torch.randint(0, V, (2, 3)), 5, temperature=0)
    assert out.shape == (2, 8)
    again = m.generate(out[:, :3], 5, temperature=0, use_cache=False)
    assert torch.equal(out, again)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_flops_formula_within_2x_of_counted_matmuls(name):
    """The analytic forward FLOPs of one mixer layer against torch's FlopCounterMode over its training
    forward (matmuls and SDPA; it counts full T x T attention where the formula counts the causal half,
    and misses elementwise work): an off-by-10x formula cannot pass, a convention difference can."""
    from torch.utils.flop_counter import FlopCounterMode

    m = build(name)
    mixer, (B, T) = m.mixers[0], (2, 64)
    x = torch.randn(B, T, m.cfg.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        mixer(x, positions=torch.arange(T))
    counted, analytic = fc.get_total_flops(), mixer.flops_per_token(T) * B * T
    assert counted > 0 and 0.5 < analytic / counted < 2.0, (analytic, counted)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_reference_switch_runs_another_computation(name):
    """impl="reference" must select a different code path: in fp32 two different summation orders are
    not bit-identical, so equal outputs would mean the switch was ignored (the equivalence test above
    would then compare a path with itself)."""
    m = build(name)
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        fast = m(x)
        for mixer in m.mixers:
            mixer.impl = "reference"
        ref = m(x)
        ref64 = m.double()(x)
    # equal up to fp32 rounding: FP32_FACTOR x the reference path's own fp32-vs-fp64 gap
    torch.testing.assert_close(fast, ref, atol=gap_atol(ref, ref64), rtol=0)
    assert not torch.equal(fast, ref)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_forms_make_their_tensors_on_the_inputs_device(impl):
    """Every mixer's fast and reference forms, run on CPU inputs with torch's default device set to `meta`: a
    tensor made without `device=` (issue 51 item 10: NSA's reference form, a device mismatch on CUDA) lands on
    meta and the forward fails. Caught here on a CPU, for every mixer at once."""
    failures = {}
    x = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(8))
    for name in MIXERS.names():
        m = build(name)
        for mixer in m.mixers:
            mixer.impl = impl
        try:
            with torch.no_grad(), torch.device("meta"):
                out = m(x)
            assert out.device.type == "cpu"
        except Exception as e:  # noqa: BLE001 - collected, reported together
            failures[name] = f"{type(e).__name__}: {str(e)[:160]}"
    assert not failures, failures
