"""Synthetic tasks: answers correct by construction (brute force), splits disjoint, determinism per seed."""
import numpy as np
import pytest

from attnzoo.config.schema import ConfigError, tagged
from attnzoo.data import DATAMODULES, build_datamodule
from attnzoo.data.copying import BLANK, SEP, generate_copying, generate_selective_copying
from attnzoo.data.induction import TRIGGER, generate_induction
from attnzoo.data.mqar import generate_mqar, generate_noisy_ar
from attnzoo.data.synthetic import make_splits, sample_distinct, sample_weighted_distinct
from tests.conftest import compose_cfg


def data_cfg(name, **kw):
    cfg = tagged(DATAMODULES, {"name": name, **kw}, "data")
    cfg.validate(None, "data")
    return cfg


def rng(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- mqar


def brute_force_mqar(x, y, mask, V, N):
    """Check one example against the task definition by reading it left to right."""
    L = len(x)
    ctx = 2 * N
    keys, values = x[0:ctx:2].tolist(), x[1:ctx:2].tolist()
    assert len(set(keys)) == N and all(1 <= k < V // 2 for k in keys)
    assert len(set(values)) == N and all(V // 2 <= v < V for v in values)
    table = dict(zip(keys, values))
    qpos = np.flatnonzero(mask).tolist()
    assert len(qpos) == N and all(p >= ctx and (p - ctx) % 2 == 0 for p in qpos)
    assert sorted(x[p] for p in qpos) == sorted(keys)  # every key queried exactly once
    for p in qpos:
        assert y[p] == table[x[p]]
    # unambiguous: a key occurs only in its pair and at its query (no filler copy of a key)
    assert all((x == k).sum() == 2 for k in keys)
    assert (y[~mask] == 0).all() and (x < V).all() and (x >= 0).all() and L == len(y)


@pytest.mark.parametrize("V,L,N", [(64, 32, 8), (256, 64, 4), (8192, 256, 16), (16, 40, 7)],
                         ids=["V64-L32-N8", "V256-L64-N4", "V8192-L256-N16", "V16-L40-N7-dense"])
def test_mqar_answers_by_brute_force(V, L, N):
    cfg = data_cfg("mqar", vocab_size=V, seq_len=L, num_kv_pairs=N)
    x, y, mask = generate_mqar(cfg, 200, rng())
    assert x.shape == y.shape == mask.shape == (200, L)
    for i in range(len(x)):
        brute_force_mqar(x[i], y[i], mask[i], V, N)


def test_mqar_query_gaps_follow_power_law():
    cfg = data_cfg("mqar", vocab_size=512, seq_len=256, num_kv_pairs=4)
    x, y, mask = generate_mqar(cfg, 2000, rng())
    gaps = (np.flatnonzero(mask.reshape(-1)) % 256 - 8) // 2  # slot index in [0, 124)
    # P(g) ∝ (g+1)^-0.99 puts ~3/4 of the queries in the first quarter of the slots; uniform would put 1/4
    assert 0.6 < (gaps < 31).mean() < 0.9
    assert (gaps < 124).all() and gaps.min() == 0


def test_mqar_fillers_random_or_zero():
    cfg = data_cfg("mqar", vocab_size=64, seq_len=64, num_kv_pairs=4, random_non_queries=False)
    x, _, mask = generate_mqar(cfg, 50, rng())
    assert (x[:, 8:][~mask[:, 8:]] == 0).all()
    cfg = data_cfg("mqar", vocab_size=64, seq_len=64, num_kv_pairs=4)
    x, _, mask = generate_mqar(cfg, 50, rng())
    assert len(np.unique(x[:, 8:][~mask[:, 8:]])) > 32


def test_mqar_pairs_clip_to_seq_len_under_smoke(tmp_path):
    cfg = compose_cfg(["experiment=mqar", "debug=smoke", "data.num_kv_pairs=16"], tmp_path)
    assert cfg.data.seq_len == 32
    from attnzoo.training.config_checks import validate

    dm = build_datamodule(validate(cfg)["data"], cache_dir=str(tmp_path), seed=0)
    dm.setup()
    assert dm.info["num_kv_pairs"] == 8 and dm.info["num_kv_pairs_requested"] == 16
    x, y, m = next(iter(dm.train_dataloader()))
    assert x.dtype == y.dtype and str(x.dtype) == "torch.int64" and m.dtype.is_floating_point is False
    assert (m.sum(1) == 8).all()


def test_mqar_vocab_too_small_is_a_config_error():
    with pytest.raises(ConfigError, match="data.vocab_size"):
        data_cfg("mqar", vocab_size=10, seq_len=64, num_kv_pairs=8)


# ----------------------------------------------------------------------------- splits


def rows(a):
    return {tuple(r) for r in np.concatenate([a[0], a[1], a[2]], axis=1).tolist()}


def test_splits_deterministic_per_seed():
    cfg = data_cfg("mqar", vocab_size=64, seq_len=32, num_kv_pairs=4, train_size=300, val_size=50)
    a, b, c = (make_splits(generate_mqar, cfg, s) for s in (7, 7, 8))
    for split in ("train", "val"):
        for i in range(3):
            np.testing.assert_array_equal(a[split][i], b[split][i])
    assert not np.array_equal(a["train"][0], c["train"][0])


def test_val_disjoint_from_train_in_a_tiny_task_space():
    # V=8, L=4, N=1: 3 keys x 4 values x 7 fillers (never the key) = 84 distinct examples; 150 draws cover most
    cfg = data_cfg("mqar", vocab_size=8, seq_len=4, num_kv_pairs=1, train_size=150, val_size=10)
    s = make_splits(generate_mqar, cfg, 0)
    train, val = rows(s["train"]), rows(s["val"])
    assert len(val) == 10 and not (train & val)
    # without the filter the same draws would overlap: the check above is not vacuous
    raw = generate_mqar(cfg, 10, np.random.default_rng(1))
    assert rows(raw) & train


def test_disjoint_split_impossible_is_reported():
    cfg = data_cfg("mqar", vocab_size=8, seq_len=4, num_kv_pairs=1, train_size=2000, val_size=50)
    with pytest.raises(ConfigError, match="data.val_size"):
        make_splits(generate_mqar, cfg, 0)


def test_sample_helpers():
    r = rng()
    for k, span in [(4, 100), (30, 40)]:  # sparse (rejection) and dense (argpartition) paths
        s = sample_distinct(r, 500, 5, 5 + span, k)
        assert s.min() >= 5 and s.max() < 5 + span
        assert all(len(set(row)) == k for row in s.tolist())
        assert abs(s.mean() - (5 + (span - 1) / 2)) < 1.5  # uniform over the range
    g = sample_weighted_distinct(r, 4000, np.log(np.array([0.7, 0.2, 0.1])), 1)[:, 0]
    np.testing.assert_allclose(np.bincount(g, minlength=3) / 4000, [0.7, 0.2, 0.1], atol=0.03)


# ----------------------------------------------------------------------------- other tasks


def test_noisy_ar_by_brute_force():
    V, L, N, nv = 64, 48, 6, 8
    cfg = data_cfg("noisy_ar", vocab_size=V, seq_len=L, num_kv_pairs=N, noise_vocab=nv)
    x, y, mask = generate_noisy_ar(cfg, 200, rng())
    noise = cfg.noise_len if cfg.noise_len is not None else (L - 3 * N) // 2
    ctx = 2 * N + noise
    for i in range(200):
        row = x[i, :ctx].tolist()
        table, j = {}, 0
        while j < ctx:  # read the context: noise tokens, or a key followed by its value
            if row[j] >= V - nv:
                j += 1
                continue
            k, v = row[j], row[j + 1]
            assert 1 <= k < (V - nv) // 2 <= v < V - nv
            table[k] = v
            j += 2
        assert len(table) == N
        q = np.flatnonzero(mask[i])
        assert len(q) == N and q.min() >= ctx and sorted(x[i, q]) == sorted(table)
        assert all(y[i, p] == table[x[i, p]] for p in q)
        others = np.setdiff1d(np.arange(ctx, L), q)
        assert (x[i, others] >= V - nv).all()


@pytest.mark.parametrize("selective", [False, True], ids=["copying", "selective_copying"])
def test_copying_by_brute_force(selective):
    V, L, n = 16, 32, 6
    cfg = data_cfg("selective_copying" if selective else "copying", vocab_size=V, seq_len=L, copy_len=n)
    x, y, mask = (generate_selective_copying if selective else generate_copying)(cfg, 100, rng())
    for i in range(100):
        sep = int(np.flatnonzero(x[i] == SEP)[0])
        assert sep == L - n and (x[i] == SEP).sum() == 1
        data = [t for t in x[i, :sep].tolist() if t != BLANK]
        assert len(data) == n and all(2 <= t < V for t in data)
        if not selective:
            assert x[i, :n].tolist() == data
        # answers: at the separator and each copied token, the next data token in order
        assert np.flatnonzero(mask[i]).tolist() == list(range(L - n, L))
        assert y[i, mask[i]].tolist() == data
        assert x[i, sep + 1 :].tolist() == data[:-1]  # teacher forcing


def test_induction_by_brute_force():
    cfg = data_cfg("induction_heads", vocab_size=16, seq_len=24)
    x, y, mask = generate_induction(cfg, 300, rng())
    for i in range(300):
        trig = np.flatnonzero(x[i] == TRIGGER)
        assert len(trig) == 2 and trig[1] == 23 and trig[0] <= 21
        assert np.flatnonzero(mask[i]).tolist() == [23] and y[i, 23] == x[i, trig[0] + 1] != TRIGGER


def test_copy_len_too_long_is_a_config_error():
    with pytest.raises(ConfigError, match="data.copy_len"):
        data_cfg("copying", seq_len=16, copy_len=9)


# ----------------------------------------------------------------------------- through train()


@pytest.mark.parametrize("task", ["mqar", "noisy_ar", "copying", "selective_copying", "induction_heads"])
def test_task_trains_and_reports_answer_accuracy(tmp_path, task):
    import json

    from attnzoo.training.run import train

    out = tmp_path / task
    metrics = train(compose_cfg([f"data={task}", "model/ffn=none", "model.n_layers=2", "debug=smoke", "data.train_size=64", "data.val_size=8",
                                 "perf.measure_decode=false", "trainer.max_steps=2", "trainer.val_check_interval=2"], out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["name"] == task and summary["data"]["val_examples"] == 8
    assert 0.0 <= metrics["val/acc"] <= 1.0 and metrics["val/loss"] > 0
    assert summary["metrics"]["val/acc"] == metrics["val/acc"]
