"""The README's Python API example works as printed."""
import torch

import attnzoo


def test_readme_api_example():
    cfg = attnzoo.load_config(["model/mixer=mqa", "model.n_layers=2"])
    model = attnzoo.build_model(cfg.model, vocab_size=256)
    logits = model(torch.randint(0, 256, (2, 64)))
    assert logits.shape == (2, 64, 256)
    # MQA: 2 layers x (k, v) x 1 kv head x head_dim 32 x 4096 tokens x 4 bytes
    assert model.cache_bytes(4096) == 2 * 2 * 1 * 32 * 4096 * 4


def test_build_model_from_preset_name():
    m = attnzoo.build_model("gpt2", vocab_size=100, overrides=["model.d_model=64", "model.n_heads=4"])
    assert m.cfg.position.name == "learned" and m.cfg.mixer.name == "mha" and m.cfg.ffn.name == "mlp"
    out = m.generate(torch.zeros(1, 2, dtype=torch.long), 4, temperature=0.0)
    assert out.shape == (1, 6)
