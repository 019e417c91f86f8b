"""DSA's dense warm-up (`index_warmup_steps`, mixers/dsa.py; the paper's first stage): while the trainer's step is
below it, a training forward attends every visible key and the indexer's KL covers them all, exactly the dense
model's (top-k >= T); from it on, exactly the sparse model's; validation and decoding always use the top-k. The
trainer tells every layer the step before each batch (layers/aux_loss.set_train_step, from TrainingModule)."""
import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.mixers.dsa import DeepSeekSparseAttention
from attnzoo.models.decoder import DecoderLM
from tests.conftest import compose_cfg, tiny_model_cfg

V, T = 64, 24
SPARSE = {"name": "dsa", "index_topk": 4}


def _model(**mixer) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(tiny_model_cfg({**SPARSE, **mixer}, max_seq_len=64), vocab_size=V).double()


def _forward(model, x, train: bool):
    """Logits and the summed indexer loss of one forward (training mode or eval)."""
    model.train(train)
    out = model(x)
    return out, model.aux_loss()


def test_warm_steps_train_dense_then_sparse_and_eval_is_always_sparse():
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    warm, dense, sparse = _model(index_warmup_steps=3), _model(index_topk=T), _model()
    for step, twin in ((0, dense), (2, dense), (3, sparse), (7, sparse)):
        for m in warm.modules():
            if isinstance(m, DeepSeekSparseAttention):
                m.set_train_step(step)
        got, got_kl = _forward(warm, x, train=True)
        want, want_kl = _forward(twin, x, train=True)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"step {step}")
        torch.testing.assert_close(got_kl, want_kl, atol=1e-12, rtol=0, msg=f"step {step}")
    with torch.no_grad():
        warm_eval = _model(index_warmup_steps=3)
        torch.testing.assert_close(_forward(warm_eval, x, train=False)[0], _forward(sparse, x, train=False)[0],
                                   atol=1e-12, rtol=0)
        assert (_forward(dense, x, train=False)[0] - _forward(sparse, x, train=False)[0]).abs().max() > 1e-3


def test_the_trainer_tells_every_layer_each_step(tmp_path, monkeypatch):
    """A 4-step run with index_warmup_steps=2: every DSA layer is told steps 0, 1, 2, 3 before their batches, and
    trains dense for the first two only."""
    from attnzoo.training.run import train

    seen = []
    original = DeepSeekSparseAttention.set_train_step

    def spy(self, step):
        original(self, step)
        seen.append((self.layer_idx, step, self._warm))

    monkeypatch.setattr(DeepSeekSparseAttention, "set_train_step", spy)
    train(compose_cfg(["debug=smoke", "model/mixer=dsa", "model.mixer.index_warmup_steps=2",
                       "model.mixer.index_topk=4", "trainer.max_steps=4", "perf.decode_tokens=0"], tmp_path / "run"))
    layers = sorted({i for i, _, _ in seen})
    assert len(layers) >= 2
    for i in layers:
        assert [(s, w) for j, s, w in seen if j == i] == [(0, True), (1, True), (2, False), (3, False)]


def test_negative_warmup_is_refused_in_one_line():
    from attnzoo.config.schema import resolve_model

    with pytest.raises(ConfigError) as e:
        resolve_model({"d_model": 32, "n_heads": 4, "mixer": {"name": "dsa", "index_warmup_steps": -1}})
    assert str(e.value).startswith("model.layers[0].mixer.index_warmup_steps: must be >= 0"), str(e.value)


def test_a_frozen_warmup_trains_the_indexers_alone(tmp_path, monkeypatch):
    """index_warmup_freeze (the paper's stage 1): a 4-step run with index_warmup_steps=2 leaves every parameter but
    the indexers' exactly as initialised through the two warm steps (each indexer parameter moves), and trains
    everything from the third step on."""
    from attnzoo.layers import aux_loss as hooks
    from attnzoo.training import lit_lm
    from attnzoo.training.run import train

    snapshots = []
    step, set_step = lit_lm.TrainingModule.optimizer_step, hooks.set_train_step

    def first_batch(model, global_step):
        if global_step == 0 and not snapshots:
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        set_step(model, global_step)

    def after_step(self, *a, **kw):
        step(self, *a, **kw)
        snapshots.append({n: p.detach().clone() for n, p in self.model.named_parameters()})

    monkeypatch.setattr(hooks, "set_train_step", first_batch)
    monkeypatch.setattr(lit_lm.TrainingModule, "optimizer_step", after_step)
    train(compose_cfg(["debug=smoke", "model/mixer=dsa", "model.mixer.index_warmup_steps=2",
                       "model.mixer.index_warmup_freeze=true", "model.mixer.index_topk=4", "trainer.max_steps=4",
                       "perf.decode_tokens=0"], tmp_path / "run"))
    assert len(snapshots) == 5  # the initial weights and after each of the 4 steps
    init = snapshots[0]
    indexer = [n for n in init if ".indexer." in n]
    assert indexer and len(indexer) < len(init)
    for k in (1, 2):  # the warm steps
        for n, p in snapshots[k].items():
            moved = not torch.equal(p, init[n])
            assert moved == (n in indexer), f"after step {k}: {n} {'moved' if moved else 'did not move'}"
    rest = [n for n in init if n not in indexer and not torch.equal(snapshots[3][n], snapshots[2][n])]
    assert len(rest) == len(init) - len(indexer), "the first sparse step trains the whole model"

