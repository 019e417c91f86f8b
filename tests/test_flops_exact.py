"""The analytic FLOPs formulas, exactly (not "within 2x") against torch's FlopCounterMode.

The counter sees matmuls and convolutions; it does not see CPU SDPA (a fused kernel), matrix-vector
products, triangular solves or elementwise work. So each computation is run in a form whose matmuls are
exactly the work the formula counts:

- softmax attention (mha / gqa / mqa / sliding window / sinks / MLA): the reference form, token by token
  through the cache, so query t multiplies exactly the keys it attends (a full forward would multiply the
  masked T x T square); MoBA and NSA: the reference form's per-query gather of the selected keys;
- recurrent mixers: the chunkwise training form; the delta rule's triangular solve is added as its
  C^2/3 per token and head (the counter does not see `solve_triangular`);
- the VLM resampler and gated cross-attention layers and encoder-decoder cross-attention run unmasked SDPA,
  whose formula is registered for the CPU kernel (torch's own `sdpa_flop`, refused for masks / causal).

A formula one key per position off (L FLOP-pairs per head in a layer) fails every one of these.
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from attnzoo.models.decoder import DecoderLM
from tests.conftest import tiny_model_cfg

aten = torch.ops.aten
V = 64


def _mv(a, b, *args, out_shape=None, **kwargs):
    return 2 * a[0] * a[1]


def _cpu_sdpa(q, k, v, dropout_p=0.0, is_causal=False, *args, attn_mask=None, out_shape=None, **kwargs):
    assert not is_causal and attn_mask is None, "only unmasked SDPA has a dense count"
    return sdpa_flop_count(q, k, v)


def counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping={aten.mv: _mv,
                                                          aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa})


def mixer_of(mixer: dict, **kw):
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg(mixer, **kw), vocab_size=V).eval()
    return m, m.mixers[0]


def _inputs(m, L: int, requires_grad: bool = False):
    return torch.randn(1, L, m.cfg.d_model, generator=torch.Generator().manual_seed(5), requires_grad=requires_grad)


def _module_flops(fc: FlopCounterMode, suffix: str) -> int:
    return sum(sum(ops.values()) for name, ops in fc.get_flop_counts().items() if name.endswith(suffix))


DECODED = {
    "mha": {"name": "mha"}, "gqa": {"name": "gqa"}, "mqa": {"name": "mqa"},
    "gqa+gated": {"name": "gqa", "qk_norm": True, "output_gate": True},
    "sliding_window-W8": {"name": "sliding_window", "window": 8},
    "sliding_window-W8-sinks3": {"name": "sliding_window", "window": 8, "sink_tokens": 3},
    "sliding_window-W8-sinks8": {"name": "sliding_window", "window": 8, "sink_tokens": 8},  # the most allowed
    "mla": {"name": "mla"},
}


@pytest.mark.parametrize("name", DECODED)
@pytest.mark.parametrize("L", [1, 9, 40])
def test_attention_flops_exact_over_decoded_positions(name, L):
    """Sum over positions 1..L of the counted work of position t (the reference form decoding one token over
    its cache) == L x flops_per_token(L). MLA's expanded reference re-expands every cached latent per step;
    its kv_b_proj is counted once per token from a full forward instead (what the training form does)."""
    m, mixer = mixer_of(DECODED[name])
    mixer.impl = "reference"
    x = _inputs(m, L)
    cache = mixer.new_cache(1, L, torch.float32, "cpu")
    with torch.no_grad(), counter() as fc:
        for t in range(L):
            mixer(x[:, t:t + 1], positions=torch.arange(t, t + 1), cache=cache)
    counted = fc.get_total_flops()
    if name == "mla":
        with torch.no_grad(), counter() as once:
            mixer(x, positions=torch.arange(L))
        counted += _module_flops(once, ".kv_b_proj") - _module_flops(fc, ".kv_b_proj")
    assert counted == pytest.approx(mixer.flops_per_token(L) * L, rel=1e-12)


SPARSE = {
    "moba": {"name": "moba", "block_size": 4, "topk": 3},
    "moba-topk1": {"name": "moba", "block_size": 4, "topk": 1},
    "moba-topk2+conv3": {"name": "moba", "block_size": 8, "topk": 2, "conv_size": 3},
    "nsa": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 6},
    "nsa-nowindow+conv3": {"name": "nsa", "block_size": 4, "block_counts": 4, "window": 0, "conv_size": 3},
    "nsa-default": {"name": "nsa"},
}


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("L", [3, 17, 40])
def test_block_sparse_flops_exact_over_gathered_keys(name, L):
    """MoBA / NSA: the reference form gathers, per query, exactly the keys (and scored blocks) it reads."""
    m, mixer = mixer_of(SPARSE[name])
    mixer.impl = "reference"
    with torch.no_grad(), counter() as fc:
        mixer(_inputs(m, L), positions=torch.arange(L))
    assert fc.get_total_flops() == pytest.approx(mixer.flops_per_token(L) * L, rel=1e-12)


RECURRENT = {
    "linear_attention": {"name": "linear_attention"},
    "linear_attention-C8": {"name": "linear_attention", "chunk_size": 8},
    "deltanet": {"name": "deltanet"}, "gated_deltanet": {"name": "gated_deltanet"},
    "gated_deltanet-C8+conv3": {"name": "gated_deltanet", "chunk_size": 8, "conv_size": 3},
    "gla-C8": {"name": "gla", "chunk_size": 8}, "gla-C4+conv3": {"name": "gla", "chunk_size": 4, "conv_size": 3},
    "retnet": {"name": "retnet"}, "retnet-C8": {"name": "retnet", "chunk_size": 8},
    "hgrn2-C8": {"name": "hgrn2", "chunk_size": 8}, "hgrn2-C4+conv3": {"name": "hgrn2", "chunk_size": 4, "conv_size": 3},
    "mamba2-C8": {"name": "mamba2", "chunk_size": 8, "n_groups": 2}, "mamba2": {"name": "mamba2", "d_state": 16},
    "rwkv7-C8": {"name": "rwkv7", "chunk_size": 8}, "kda-C8": {"name": "kda", "chunk_size": 8},
    "gated_deltaproduct-C4": {"name": "gated_deltaproduct", "chunk_size": 4}, "gdn2-C8": {"name": "gdn2", "chunk_size": 8},
    "rwkv7-C4+conv3-dv6": {"name": "rwkv7", "chunk_size": 4, "conv_size": 3, "head_dim": 4, "v_head_dim": 6},
}


@pytest.mark.parametrize("name", RECURRENT)
@pytest.mark.parametrize("L", [16, 40, 64])
def test_recurrent_flops_exact_for_the_chunkwise_form(name, L):
    """The chunkwise training forward (gradients on: the delta rule forms its explicit C x C inverse by one
    triangular solve, C^3/3 per chunk = C^2/3 per token and value head, which the counter cannot see)."""
    m, mixer = mixer_of(RECURRENT[name])
    assert L % min(mixer.chunk_size, L) == 0  # whole chunks: a padded last chunk is work the formula spreads per token
    with counter() as fc:
        mixer(_inputs(m, L, requires_grad=True), positions=torch.arange(L))
    counted = fc.get_total_flops()
    if "delta" in name or name.startswith(("rwkv7", "kda", "gdn2")):  # rwkv7, kda: the generalized delta rule's UT transform
        C = min(mixer.chunk_size, L)
        n = getattr(mixer, "n_householder", 1)  # gated_deltaproduct: n sub-steps per token, chunks of n C
        counted += mixer.n_v_heads * (n * C) ** 2 / 3 * n * L
    assert counted == pytest.approx(mixer.flops_per_token(L) * L, rel=1e-12)


def test_encdec_cross_attention_flops_exact():
    """Cross-attention: T target tokens over S source keys (q, o projections and QK^T, PV per target token;
    the K/V projection once per source token)."""
    from attnzoo.models.encoder_decoder import CrossAttention

    m, _ = mixer_of({"name": "gqa"})
    from attnzoo.models.encoder_decoder import EncDecOptions

    cross = CrossAttention(m.cfg, EncDecOptions())
    T, S = 7, 13
    x, memory = torch.randn(2, T, m.cfg.d_model), torch.randn(2, S, m.cfg.d_model)
    with torch.no_grad(), counter() as fc:
        cross(x, cross.memory_kv(memory), key_mask=None)
    expected = 2 * (T * cross.flops_per_token(S) + S * cross.kv_flops_per_source_token())
    assert fc.get_total_flops() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("depth,n_queries,context", [(1, 4, 9), (2, 3, 16)])
def test_resampler_flops_exact(depth, n_queries, context):
    from attnzoo.models.vision.connectors import PerceiverResampler

    r = PerceiverResampler(32, n_queries, depth, n_heads=4, head_dim=8)
    with counter() as fc:  # with gradients: the counter's module tracker needs a grad_fn on the expanded latents
        r(torch.randn(2, context, 32))
    assert fc.get_total_flops() == pytest.approx(2 * r.flops_per_image(context), rel=1e-12)


def test_gated_cross_attention_flops_exact():
    """A VLM gated cross-attention layer per text token over M image tokens, plus its image K/V once per image token."""
    from attnzoo.models.vision.connectors import GatedCrossAttention

    m, _ = mixer_of({"name": "gqa"})
    layer = GatedCrossAttention(m.cfg, d_image=24)
    T, M = 5, 11
    with torch.no_grad(), counter() as fc:
        layer(torch.randn(2, T, m.cfg.d_model), layer.image_kv(torch.randn(2, M, 24)))
    expected = 2 * (T * layer.flops_per_token(M) + M * layer.kv_flops_per_image_token())
    assert fc.get_total_flops() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mixer", ["gqa", "mla", "linear_attention"])
def test_training_flops_are_three_forwards(mixer):
    """What `perf/flops_per_token` reports (flops.train_flops_per_token, used by perf/mfu) is 3x the forward
    count, and 3x is what a training step does: the counter over forward + backward of the whole model equals
    3x its count over the forward (every matmul's backward is two matmuls of its size: the input and the
    weight gradient). Mixers whose every product is a matmul (no matrix-vector products, no triangular solve)."""
    from attnzoo.models.flops import train_flops_per_token

    m, _ = mixer_of({"name": mixer})
    for layer in m.mixers:
        layer.impl = "reference" if mixer != "linear_attention" else "fast"
    m.train()
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with counter() as fwd:
        m(x)
    with counter() as step:
        m(x).float().square().mean().backward()
    assert step.get_total_flops() == 3 * fwd.get_total_flops()
    assert train_flops_per_token(m, 16) == 3 * m.flops_per_token(16)


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_flops_convention_partial_chunk_and_inference(name):
    """The convention the training and the inference counts share (docs/benchmarks.md, "FLOPs convention"): one
    figure, the chunkwise training forward per token at whole chunks. A padded last chunk (T not a multiple of the
    chunk) is implementation work, not model FLOPs: it adds at most the padded tokens' own cost, and nothing at whole
    chunks. Under no_grad the same matmuls run, except the delta-rule family's (deltanet, gated_deltanet, rwkv7, kda)
    chunk solve, which solves directly instead of forming the inverse: fewer FLOPs than the shared figure."""
    m, mixer = mixer_of(RECURRENT[name])
    L = 20
    C = min(mixer.chunk_size, L)
    pad = -L % C
    counted = {}
    for grad in (True, False):
        with torch.set_grad_enabled(grad), counter() as fc:
            mixer(_inputs(m, L, requires_grad=grad), positions=torch.arange(L))
        counted[grad] = fc.get_total_flops()
    delta = "delta" in name or name.startswith(("rwkv7", "kda", "gdn2"))
    shared = mixer.flops_per_token(L) * L
    n = getattr(mixer, "n_householder", 1)  # gated_deltaproduct: n sub-steps per token, chunks of n C
    training = counted[True] + (mixer.n_v_heads * (n * C) ** 2 / 3 * n * (L + pad) if delta else 0)  # the unseen inverse
    if pad == 0:
        assert training == pytest.approx(shared, rel=1e-12)
    else:
        assert shared < training <= shared + pad * mixer.flops_per_token(L)
    if delta:
        assert counted[False] < counted[True]  # no inverse, no multiply by it: the shared figure is an upper bound
    else:
        assert counted[False] == counted[True]
