"""Static caches and the compiled decode step (attnzoo.models.decoding): every mixer with a static cache decodes
through it exactly as the full forward (fp64), rows of other lengths as if each ran alone, measured filled bytes ==
analytic; one compiled graph serves every position and every prompt (counted by a counting backend, and by the
real inductor once); sampling inside the step draws from the same filtered distribution as sample_next; eos and stop
strings end rows; bad input is refused before any work."""
import pytest
import torch

from attnzoo.config.errors import ConfigError
from attnzoo.config.registry import MIXERS
from attnzoo.models.decoding import Decoder, draw
from attnzoo.models.decoder import DecoderLM, filtered_logits, sample_next
from tests.conftest import gap_atol, tiny_model_cfg
from tests.test_mixers_contract import MIXER_NAMES, mixer_cfg

V = 64
STATIC = [n for n in MIXER_NAMES if not DecoderLM(tiny_model_cfg(mixer_cfg(n)), vocab_size=V).static_cache_missing()]
MISSING = [n for n in MIXERS.names() if n not in STATIC]
POSITIONS = [{"name": "rope"}, {"name": "alibi"}, {"name": "learned"}, {"name": "sinusoidal"}, {"name": "none"},
             {"name": "rope", "scaling": "yarn", "factor": 2.0, "original_max_len": 16}]


def build(mixer, seed: int = 0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(mixer, max_seq_len=64, **kw), vocab_size=V).eval()


def static_decode(m, x: torch.Tensor, prompt_len: int, max_len: int) -> tuple[torch.Tensor, object]:
    """Logits of x (B, T) through a static cache: the prompt in one call, then one token per call."""
    cache = m.new_static_cache(x.shape[0], max_len, m.embed.weight.dtype)
    with torch.no_grad():
        out = [m(x[:, :prompt_len], cache=cache)]
        out += [m(x[:, t:t + 1], cache=cache) for t in range(prompt_len, x.shape[1])]
    return torch.cat(out, 1), cache


def test_every_mixer_has_a_static_cache():
    assert MISSING == []
    assert {"gqa", "sliding_window", "mla", "gated_deltanet", "rwkv7", "mamba2", "gla", "retnet", "hgrn2", "nsa",
            "moba"} <= set(STATIC)


# blocks of 4 so that selection really chooses (the defaults' blocks of 16 hold every position these tests reach)
SPARSE = {"nsa": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 5},
          "moba": {"name": "moba", "block_size": 4, "topk": 2},
          "nsa-nowindow-conv": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 0, "conv_size": 3}}


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
@pytest.mark.parametrize("key", list(SPARSE))
def test_block_sparse_static_decode_equals_full_forward(key, prompt_len, impl):
    """NSA / MoBA through their static block means, with selection over many blocks, in the fast (masked over every
    slot) and the reference (each query over its own keys) forms."""
    check_static_decode(build(SPARSE[key]).double(), impl, prompt_len, 15)


def check_static_decode(m, impl: str, prompt_len: int, steps: int) -> None:
    """fp64 model m in form `impl`: a prompt then `steps` one-token steps through a static cache (2 rows) == the
    full forward (1e-10), and the cache holds the analytic bytes."""
    for mixer in m.mixers:
        mixer.impl = impl
    x = torch.randint(0, V, (2, prompt_len + steps), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = m(x)
    out, cache = static_decode(m, x, prompt_len, 40)
    torch.testing.assert_close(out, full, atol=1e-10, rtol=0)
    assert cache.nbytes() == m.cache_bytes(x.shape[1], 2, torch.float64)


@pytest.mark.parametrize("key", ["nsa", "moba"])
def test_block_sparse_decode_step_reads_its_blocks_only(key, monkeypatch):
    """A static decode step gathers the slots of its selected blocks (and NSA's window), not the whole cache: the
    bytes gathered are decode_read_bytes less the block means and conv tail, flat in the context while the cache
    grows."""
    from attnzoo.ops import sparse_attention as sa

    m = build(SPARSE[key]).double()
    gathered = []
    real = sa.gather_slots
    monkeypatch.setattr(sa, "gather_slots", lambda x, slots: gathered.append(real(x, slots)) or gathered[-1])
    mixer, L = m.mixers[0], 41  # 10 complete blocks of 4 and one partial: selection has a choice
    x = torch.randint(0, V, (2, L + 1), generator=torch.Generator().manual_seed(9))
    cache = m.new_static_cache(2, L + 1, torch.float64)
    with torch.no_grad():
        m(x[:, :L], cache=cache)
        gathered.clear()
        m(x[:, L:], cache=cache)
    per_layer = sum(g.numel() * g.element_size() for g in gathered) // len(m.mixers)
    blocks = -(-L // mixer.block_size)
    means = (2 if key == "nsa" else 1) * mixer.n_kv_heads * mixer.head_dim * blocks * 8 * 2
    assert per_layer == mixer.decode_read_bytes(L, 2, torch.float64) - means - mixer.input_conv_bytes(2, torch.float64)
    assert mixer.decode_read_bytes(4 * L) - mixer.decode_read_bytes(L) < (mixer.cache_bytes(4 * L) - mixer.cache_bytes(L)) / 4


@pytest.mark.parametrize("key", ["nsa", "moba", "dsa"])
def test_sparse_rows_of_other_lengths_and_continued_chunks(key):
    """Rows prefilled alone then decoded together at their own positions (each completing blocks, or reaching
    DSA's top-k, at other steps), and a full-batch chunk of 5 tokens after the prefill: each row equals its own full
    forward."""
    m = build(SPARSE.get(key) or {"name": "dsa", "index_topk": 4}).double()
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(0, V, (1, n), generator=g) for n in (13, 22, 17)]
    cache = m.new_static_cache(3, 40, torch.float64)
    with torch.no_grad():
        for b, r in enumerate(rows):
            m(r[:, :-9], cache=cache.row(b))
        chunk = m(torch.cat([r[:, -9:-4] for r in rows]), cache=cache)
        steps = [m(torch.cat([r[:, -4 + t:r.shape[1] - 3 + t] for r in rows]), cache=cache) for t in range(4)]
        for b, r in enumerate(rows):
            got = torch.cat([chunk[b:b + 1]] + [s[b:b + 1] for s in steps], 1)
            torch.testing.assert_close(got, m(r)[:, -9:], atol=1e-10, rtol=0)
    assert cache.nbytes() == sum(m.cache_bytes(r.shape[1], 1, torch.float64) for r in rows)


@pytest.mark.parametrize("name", STATIC)
@pytest.mark.parametrize("prompt_len", [1, 7, 20])
def test_static_decode_equals_full_forward(name, prompt_len):
    m = build(mixer_cfg(name)).double()
    x = torch.randint(0, V, (2, prompt_len + 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
    out, cache = static_decode(m, x, prompt_len, 40)
    torch.testing.assert_close(out, full, atol=1e-10, rtol=0)
    T = x.shape[1]
    assert cache.pos.tolist() == [T, T]
    assert cache.nbytes() == m.cache_bytes(T, 2, torch.float64)  # filled == analytic
    assert cache.allocated_bytes() >= cache.nbytes()


WINDOW = {"name": "sliding_window", "window": 5, "sink_tokens": 2}


@pytest.mark.parametrize("mixer,position", [({"name": "gqa"}, p) for p in POSITIONS] + [
    (WINDOW, p) for p in POSITIONS if p["name"] != "alibi"],  # alibi with a window: refused by its config
    ids=lambda v: "-".join(map(str, v.values())))
def test_static_decode_every_position_method(mixer, position):
    m = build(mixer, position=position).double()
    x = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(x)
    torch.testing.assert_close(static_decode(m, x, 6, 32)[0], full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["gqa", "sliding_window", "gated_deltanet", "rwkv7", "gqa+conv3"])
def test_rows_of_other_lengths_decode_as_if_alone(name):
    """Per-row prefill into a shared static cache, then decode together at per-row positions: each row's logits
    equal the full forward of that row alone."""
    m = build(mixer_cfg(name)).double()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, V, (1, n), generator=g) for n in (8, 15, 11)]  # prompts of 2, 9 and 5 tokens
    cache = m.new_static_cache(3, 40, torch.float64)
    with torch.no_grad():
        for b, r in enumerate(rows):
            m(r[:, :-6], cache=cache.row(b))
        steps = [m(torch.cat([r[:, -6 + t:r.shape[1] - 5 + t] for r in rows]), cache=cache) for t in range(6)]
        for b, r in enumerate(rows):
            torch.testing.assert_close(torch.cat([s[b:b + 1] for s in steps], 1), m(r)[:, -6:], atol=1e-10, rtol=0)
    assert cache.nbytes() == sum(m.cache_bytes(r.shape[1], 1, torch.float64) for r in rows)


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


@pytest.mark.parametrize("mixer", [{"name": "gqa"}, {"name": "gated_deltanet"}, {"name": "rwkv7"},
                                   {"name": "sliding_window", "window": 4, "sink_tokens": 1}], ids=lambda m: m["name"])
def test_one_graph_for_every_position_and_prompt(mixer):
    """fullgraph: a break would raise. Greedy decoding over prompts of three lengths, then another batch of other
    lengths (fewer rows than the decoder's batch), compiles the step once; sampling is a second graph, once."""
    m = build(mixer)
    backend, graphs = counting_backend()
    dec = Decoder(m, batch=3, max_len=48, backend=backend)
    assert dec.path.startswith("compiled static cache")
    dec.generate([[1, 2, 3, 4, 5], [7, 8], list(range(1, 12))], 12)
    dec.generate([[3], [9, 9, 9, 9]], 20)
    assert len(graphs) == 1
    gen = torch.Generator().manual_seed(0)
    dec.generate([[3, 4]], 10, temperature=0.8, top_k=5, top_p=0.9, generator=gen)
    dec.generate([[5, 6, 7], [1]], 10, temperature=1.3, top_k=9, top_p=0.5, generator=gen)  # other settings: tensors
    assert len(graphs) == 2


def test_compiled_decode_equals_eager_and_full_forward():
    """The real compiler (inductor) on a hybrid of full attention, a window with a sink and Gated DeltaNet: greedy
    tokens identical to the eager static decode and to DecoderLM.generate with and without its cache; the compiled
    step's logits (Decoder.greedy_step: the graph greedy generation ran, compiled once) within the fp32-vs-fp64 gap
    of the same decode (rounding, not a different computation)."""
    torch.manual_seed(0)
    cfg = tiny_model_cfg({"name": "gqa"}, n_layers=3, pattern=["a", "w", "g"], max_seq_len=64,
                         mixers={"a": {"name": "gqa"}, "w": {"name": "sliding_window", "window": 6, "sink_tokens": 1},
                                 "g": {"name": "gated_deltanet"}})
    m = DecoderLM(cfg, vocab_size=V).eval()
    prompts = [[5, 9, 2, 11, 30, 7, 1, 44, 3], [17, 2], [8, 8, 1, 60, 12]]
    compiled = Decoder(m, 3, 40)
    eager = Decoder(m, 3, 40, compile=False)
    got, want = compiled.generate(prompts, 20), eager.generate(prompts, 20)
    assert got.tokens == want.tokens and got.steps == 19
    for p, toks in zip(prompts, got.tokens):
        x = torch.tensor([p])
        assert m.generate(x, 20, temperature=0)[0, len(p):].tolist() == toks
        assert m.generate(x, 20, temperature=0, use_cache=False)[0, len(p):].tolist() == toks
    # logits of one compiled step (the decoder's own graph: no second compile) vs the same step eager in fp32 and fp64
    t = torch.tensor([[4], [5], [6]])
    compiled.prefill(prompts)
    nxt, outs = compiled.greedy_step(t)
    outs = {"compiled": outs}
    assert torch.equal(nxt[:, 0], outs["compiled"].argmax(-1))
    m64 = DecoderLM(cfg, vocab_size=V).eval()
    m64.load_state_dict(m.state_dict())
    m64.double()
    for key, model in (("fp32", m), ("fp64", m64)):
        cache = model.new_static_cache(3, 40, model.embed.weight.dtype)
        with torch.no_grad():
            for b, p in enumerate(prompts):
                model(torch.tensor([p]), cache=cache.row(b))
            outs[key] = model(t, cache=cache)[:, -1]
    assert compiled.compiled and len(outs["compiled"]) == 3
    torch.testing.assert_close(outs["compiled"].double(), outs["fp64"], atol=gap_atol(outs["fp32"], outs["fp64"]),
                               rtol=0)


@pytest.mark.parametrize("name", [n for n in STATIC if "+" not in n])
def test_every_static_mixer_compiles_to_the_full_forward(name):
    """Every mixer with a static cache through dynamo + AOTAutograd (aot_eager: the graph capture and the
    functionalization of the in-place cache writes, which is where a compiled decode goes wrong, without inductor's
    C++ compile): prompts of two lengths prefilled per row, then 6 compiled steps, fp64, equal to each row's full
    forward (1e-10). One layer (dynamo traces each layer again), two where a layer hands the next one a carry."""
    m = build(mixer_cfg(name), n_layers=2 if MIXERS.get(mixer_cfg(name)["name"]).cls.carries else 1).double()
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, V, (1, n), generator=g) for n in (9, 14)]
    cache = m.new_static_cache(2, 32, torch.float64)
    step = torch.compile(lambda t: m(t, cache=cache)[:, -1], backend="aot_eager", fullgraph=True)
    try:
        with torch.no_grad():
            for b, r in enumerate(rows):
                m(r[:, :-6], cache=cache.row(b))
            steps = [step(torch.cat([r[:, r.shape[1] - 6 + t:r.shape[1] - 5 + t] for r in rows])) for t in range(6)]
            for b, r in enumerate(rows):
                torch.testing.assert_close(torch.stack([s[b] for s in steps]), m(r)[0, -6:], atol=1e-10, rtol=0)
    finally:
        torch._dynamo.reset()


def test_a_step_that_fails_to_compile_decodes_eagerly_and_says_so():
    """A compiler failure (the backend raises, as torch 2.13's CPU inductor does on RWKV-7 at batch 8) happens before
    the step writes anything: the decoder falls back to the eager step, with the same tokens, and reports it."""
    def failing(gm, example_inputs):
        raise RuntimeError("no kernel for this shape")

    m = build({"name": "gqa"})
    dec = Decoder(m, 2, 40, backend=failing)
    got = dec.generate([[1, 2, 3], [4, 5]], 8)
    assert dec.path == "eager static cache (the compile failed: BackendCompilerFailed)" and not dec.compiled
    assert got.tokens == Decoder(m, 2, 40, compile=False).generate([[1, 2, 3], [4, 5]], 8).tokens


def test_filtered_logits_tensor_settings_equal_numbers():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for t, k, p in ((0.7, 5, 0.9), (1.0, None, 0.5), (1.3, 12, None), (0.5, 50, 1.0)):
        a = filtered_logits(logits, t, k, p)
        b = filtered_logits(logits, torch.tensor(t), torch.tensor(k or 50), torch.tensor(p if p is not None else 1.0))
        torch.testing.assert_close(a, b)
    kept = filtered_logits(logits, 1.0, 5, None).isfinite().sum(-1)
    assert kept.tolist() == [5, 5, 5, 5]


def test_exponential_race_draws_from_the_filtered_distribution():
    """argmax(p / E), E ~ Exp(1), is a draw from p: 40,000 draws match the filtered probabilities (each within
    5 standard errors), as multinomial's (sample_next) do."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = torch.softmax(filtered_logits(logits, 0.8, 4, 0.95), -1)[0]
    n, g = 40_000, torch.Generator().manual_seed(0)
    race = draw(logits.expand(n, -1), torch.empty(n, 6).exponential_(generator=g), torch.tensor(0.8),
                torch.tensor(4), torch.tensor(0.95))[:, 0]
    multi = sample_next(logits.expand(n, -1), 0.8, 4, 0.95, g)[:, 0]
    se = (p * (1 - p) / n).sqrt()
    for drawn in (race, multi):
        freq = torch.bincount(drawn, minlength=6).double() / n
        assert ((freq - p.double()).abs() <= 5 * se.double() + 1e-12).all(), (freq, p)
    assert p[4:].sum() == 0  # outside the top 4: never drawn


def test_eos_and_stop_strings_end_rows():
    m = build({"name": "gqa"})
    dec = Decoder(m, 2, 40, compile=False)
    free = dec.generate([[1, 2, 3], [4, 5]], 12)
    eos = free.tokens[0][4]
    first = free.tokens[0].index(eos)
    got = dec.generate([[1, 2, 3], [4, 5]], 12, eos_id=eos)
    assert got.tokens[0] == free.tokens[0][:first + 1] and got.finished[0] == "eos"
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    stop = decode(free.tokens[1][3:5])
    got = dec.generate([[1, 2, 3], [4, 5]], 12, stop=[stop], decode=decode)
    text = decode(free.tokens[1])
    assert got.finished[1] == "stop" and got.text[1] == text[:text.index(stop)]
    assert got.tokens[1] == free.tokens[1][:len(got.tokens[1])]


def test_dynamic_rope_decodes_eagerly_through_the_static_cache():
    m = build({"name": "gqa"}, position={"name": "rope", "scaling": "dynamic", "factor": 2.0, "original_max_len": 8})
    dec = Decoder(m, 1, 40)
    assert dec.path.startswith("eager static cache (position.scaling=dynamic") and not dec.compiled
    assert dec.generate([[1, 2, 3]], 20).tokens[0] == m.generate(torch.tensor([[1, 2, 3]]), 20, temperature=0)[0, 3:].tolist()


@pytest.mark.parametrize("absorb", ["always", "never"])
def test_mla_static_latents_in_either_attention_form(absorb):
    """MLA's static latents with the absorbed form everywhere, or never (the default absorbs in decode only)."""
    m = build({"name": "mla", "absorb": absorb}).double()
    x = torch.randint(0, V, (2, 25), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = m(x)
    torch.testing.assert_close(static_decode(m, x, 9, 30)[0], full, atol=1e-10, rtol=0)


def test_models_without_a_static_cache_fall_back_and_say_so(monkeypatch):
    """A mixer that does not implement new_static_cache (a user's) decodes through its dynamic cache."""
    from attnzoo.mixers.base import Mixer
    from attnzoo.mixers.nsa import NativeSparseAttention

    monkeypatch.setattr(NativeSparseAttention, "new_static_cache", Mixer.new_static_cache)
    m = build({"name": "nsa"})
    dec = Decoder(m, 2, 30)
    assert dec.path == "eager, dynamic cache (nsa: no static cache yet)"
    got = dec.generate([[1, 2, 3], [4]], 8)
    for p, toks in zip([[1, 2, 3], [4]], got.tokens):
        assert m.generate(torch.tensor([p]), 8, temperature=0)[0, len(p):].tolist() == toks


@pytest.mark.parametrize("mixer,static", [({"name": "gqa"}, 1.0), ({"name": "mla"}, 1.0), ({"name": "moba"}, 1.0),
                                          ({"name": "nsa"}, 0.0)])
def test_the_run_summary_decode_rate_takes_the_static_path(mixer, static, monkeypatch):
    """training/measure.measure_inference (the summary's perf/decode_tokens_per_sec): through the Decoder, saying
    which path it took (a mixer without a static form: the dynamic one); the bytes after the prefill are the
    analytic cache bytes."""
    from attnzoo.mixers.base import Mixer
    from attnzoo.mixers.nsa import NativeSparseAttention
    from attnzoo.training.measure import measure_inference

    if not static:
        monkeypatch.setattr(NativeSparseAttention, "new_static_cache", Mixer.new_static_cache)
    m = build(mixer)
    got = measure_inference(m, 16, 3, V)
    assert got["perf/decode_static"] == static and got["perf/decode_compiled"] == 0.0
    assert got["cache/bytes_at_ctx"] == m.cache_bytes(16, 1, torch.float32)
    assert got["perf/decode_tokens_per_sec"] > 0


@pytest.mark.parametrize("prompts,new,kw,field", [
    ([[1]] * 3, 4, {}, "prompts"),
    ([[1], []], 4, {}, "prompts"),
    ([[1] * 30], 11, {}, "max_new_tokens"),
    ([[1]], 0, {}, "max_new_tokens"),
    ([[1]], 4, {"stop": ["x"]}, "stop"),
])
def test_bad_input_refused_before_work(prompts, new, kw, field):
    dec = Decoder(build({"name": "gqa"}), 2, 40, compile=False)
    with pytest.raises(ConfigError) as e:
        dec.generate(prompts, new, **kw)
    assert e.value.field == field


def test_learned_positions_and_a_routed_ffn_compile_to_one_graph():
    """gpt2's learned positions (no int(max) read: torch._assert_async) and MoE (a compiled decode step takes the
    experts' gathered weights, no split sizes read on the host) in one model: one graph (fullgraph), the same
    greedy tokens as the eager static decode (issue 51 item 2: both decoded eagerly before)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "gqa"}, position={"name": "learned"}, max_seq_len=48,
                                 ffn={"name": "moe", "n_experts": 4, "top_k": 2}), vocab_size=V).eval()
    backend, graphs = counting_backend()
    dec = Decoder(m, batch=2, max_len=40, backend=backend)
    assert dec.path.startswith("compiled static cache") and dec.compiled
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    assert dec.generate(prompts, 10).tokens == Decoder(m, 2, 40, compile=False).generate(prompts, 10).tokens
    assert len(graphs) == 1


def test_the_decode_rate_is_the_median_window_so_one_stall_does_not_halve_it(monkeypatch):
    """Decoder.decode_rate times its steps in 4 windows and reports the median window's rate: with a clock on which
    one window of 8 steps stalls (1 s instead of 10 ms), the rate is the other windows' 800 tokens/s (one window
    over all 32 steps: ~31); 0 steps time nothing and report 0, as before."""
    import types

    from attnzoo.models import decoding

    ticks = iter([0.0, 0.01, 0.01, 0.02, 0.02, 1.02, 1.02, 1.03])
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    dec = Decoder(build({"name": "gqa"}), batch=1, max_len=48, compile=False)
    assert dec.decode_rate([1, 2, 3], 32)["tokens_per_sec"] == pytest.approx(800.0)
    assert next(ticks, None) is None  # two clock reads a window, four windows
    assert dec.decode_rate([1, 2, 3], 0)["tokens_per_sec"] == 0.0
