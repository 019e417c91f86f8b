"""The MFU peak table is matched by the whole device name the driver reports (issue 51 item 9: a substring
match took "NVIDIA L40" for the L4 row and gave an H100 PCIe the SXM peak). Names as torch.cuda.get_device_name()
returns them on those cards; an unlisted card gets None (its matmul peak is then measured)."""
import pytest
import torch

from attnzoo.models.flops import datasheet_peak

NAMES = {
    "NVIDIA H200": ("H200", 989e12),
    "NVIDIA H200 NVL": ("H200 NVL", 835e12),
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989e12),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756e12),
    "NVIDIA H100 NVL": ("H100 NVL", 835e12),
    "NVIDIA A100-SXM4-80GB": ("A100", 312e12),
    "NVIDIA A100-SXM4-40GB": ("A100", 312e12),
    "NVIDIA A100-PCIE-40GB": ("A100", 312e12),
    "NVIDIA A100 80GB PCIe": ("A100", 312e12),
    "NVIDIA L40S": ("L40S", 362e12),
    "NVIDIA L40": ("L40", 181e12),
    "NVIDIA L4": ("L4", 121e12),
    "NVIDIA A10": ("A10", 125e12),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 165e12),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_each_real_device_name_gets_its_own_row(name):
    row, bf16 = NAMES[name]
    assert datasheet_peak(name, torch.bfloat16) == (bf16, f"datasheet:{row}")
    fp32, _ = datasheet_peak(name, torch.float32)
    assert fp32 < bf16  # the fp32 row is the non-tensor-core rate


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA RTX A6000", "NVIDIA GeForce RTX 4090 D", "NVIDIA A40",
                                  "Tesla V100-SXM2-16GB", "NVIDIA H20"])
def test_an_unlisted_card_is_not_taken_for_a_listed_one(name):
    assert datasheet_peak(name, torch.bfloat16) is None
