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


MiB = 2**20


def test_peak_cpu_bytes_is_exact_in_mebibytes():
    def allocate():
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a  # 2 MiB live, 3 MiB peak so far
        c = torch.empty(MiB // 2, dtype=torch.uint8)  # 2.5 MiB live: under the peak
        del b, c

    assert peak_cpu_bytes(allocate) == 3 * MiB


def test_peak_cpu_bytes_counts_only_what_the_block_allocates():
    live = torch.empty(4 * MiB, dtype=torch.uint8)  # allocated before: not counted
    assert peak_cpu_bytes(lambda: torch.empty(MiB, dtype=torch.uint8)) == MiB
    del live


def test_saved_bytes_of_a_known_tiny_model():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Sigmoid()
    )
    x = torch.randn(5, 8)
    with count_saved_bytes(exclude=[*model.parameters(), x]) as saved:
        loss = model(x).sum()
    loss.backward()
    # Linear saves its input and weight (x and parameters: excluded); Tanh and
    # Sigmoid each save their 5x16 float32 output, which the second Linear
    # also saves (the same storage, counted once); sum saves nothing.
    assert (saved["bytes"], saved["tensors"]) == (2 * 5 * 16 * 4, 2)
