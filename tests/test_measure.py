"""The measurement helpers measure what they claim, exactly."""
import torch

from bench.measure import count_saved_bytes, peak_cpu_bytes


def test_peak_cpu_bytes_of_a_known_allocation_pattern():
    def allocate():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        del a
        c = torch.empty(500, dtype=torch.uint8)
        del b, c

    assert peak_cpu_bytes(allocate) == 4000


def test_saved_bytes_count_each_storage_once_and_skip_excluded():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with count_saved_bytes(exclude=[w, x]) as saved:
        h = x @ w  # saves x and w: excluded
        y = h.sin()  # saves h: 4*8 float32
        z = y * h  # saves y and h again: h counted once
    z.sum().backward()
    assert saved["bytes"] == 2 * 4 * 8 * 4
    assert saved["tensors"] == 2
