"""End-to-end recall through train() with the shipped MQAR recipe (experiment=mqar): softmax attention
and DeltaNet learn an easy MQAR; a sliding window that cannot reach the pairs from the queries stays
at chance. Guards the recipe itself (conv, untied head, no positions, optimiser) — the reason
docs/sweeps.md once reported attention failing recall (issue 13)."""
import pytest

from attnzoo.training.run import train
from tests.conftest import compose_cfg

# N=4 pairs in 32 tokens, d_model 64, 4 heads: 5-15 s per run on one thread (early stop at 99%)
EASY = ["experiment=mqar", "data.seq_len=32", "data.num_kv_pairs=4", "model.d_model=64", "data.val_size=256", "trainer.max_steps=400",
        "trainer.val_check_interval=25", "trainer.enable_progress_bar=false", "perf.measure_decode=false",
        "seed=0"]


@pytest.mark.parametrize("mixer", ["gqa", "deltanet"])
def test_shipped_recipe_learns_easy_mqar(tmp_path, mixer):
    """The recipe's trajectory (cosine over its 400 steps) stopped once it holds what is asserted: early stop at
    95% instead of the recipe's 99% (deltanet passes 95% well before 99%: the time of this test halves)."""
    metrics = train(compose_cfg(EASY + [f"model/mixer={mixer}", "callbacks.early_stop.threshold=0.95"],
                                tmp_path / mixer))
    assert metrics["val/acc"] >= 0.95, metrics


def test_sliding_window_that_cannot_reach_the_pairs_stays_at_chance(tmp_path):
    """Window 1 and no conv: each position sees only itself, so a query cannot read its value; the best
    a model can do is guess among the values (chance: 1/128 of the value range, ~1/N if it learns
    which values occur — it cannot see them either)."""
    metrics = train(compose_cfg(EASY + ["model/mixer=sliding_window", "model.mixer.window=1", "model.mixer.conv_size=0",
                                        "trainer.max_steps=250"],  # where gqa and deltanet pass 95% (the test above)
                                tmp_path / "swa"))
    assert metrics["val/acc"] <= 0.05, metrics
