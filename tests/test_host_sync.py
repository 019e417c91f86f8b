"""No host sync in the training step (issue 51 item 4): forward, loss, backward and the optimizer step of the
default model, gpt2 (learned positions), retnet and a MoE model, on the `meta` device (shapes only: it stands
for an accelerator here, since a read of one of its tensors cannot be answered from the host) under a dispatch
mode that records every `aten._local_scalar_dense` of a model tensor (what `.item()`, `int(t)` and `bool(t)` become;
a `.tolist()` of one fails outright). On a GPU each of those drains the queue before the next kernel can be launched. The
optimizer's own step counters live on the host (torch's AdamW without `capturable`): not reads. The presets at
a tiny width, in bf16 (as on a GPU; the grouped-matmul MoE path is bf16-only)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnzoo.api import build_model

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32"]
PRESETS = {
    "default": [],
    "gpt2": ["model=gpt2", "model.n_kv_heads=4"],
    "retnet": ["model/mixer=retnet"],
    "moe": ["model/ffn=moe"],
}
# MoE: the path a GPU with torch._grouped_mm takes (offsets from the counts on the device); the loop fallback
# (devices / dtypes without it: layers/moe.py grouped_mm_works) reads the counts as split sizes, by design


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            import traceback

            self.reads.append("".join(traceback.format_stack(limit=6)[:-1]))
            return 1  # what a host read of a device tensor would have waited for
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_training_step_reads_nothing_back_to_the_host(preset, monkeypatch):
    from attnzoo.layers import moe

    monkeypatch.setattr(moe, "grouped_mm_works", lambda device, dtype: True)
    model = build_model("default", vocab_size=64, overrides=[*PRESETS[preset], *SMALL]).train().to("meta", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0)).to("meta")
    for _ in range(2):  # the second step: nothing made on the first one's first call
        with HostReads() as mode:
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not mode.reads, "\n".join(mode.reads)
