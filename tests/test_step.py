"""The step model (partitioners/step.py): a graph's plan judged in the
step it runs in, on hand-made sequences with hand-computed peaks."""
import pytest

from partitioners.step import GraphCost, predicted_step_peak, step_context

A = GraphCost(held_bytes=10, forward_bytes=5, backward_bytes=20, gradient_bytes=3, optimal_bytes=30)
B = GraphCost(held_bytes=7, forward_bytes=4, backward_bytes=9, gradient_bytes=1, optimal_bytes=10)


def test_predicted_step_peak_by_hand():
    # calls A, B, A: held before each 0, 10, 17; later gradients 1+3, 3, 0
    # A: max(5, 20 + 4) = 24; B: 10 + max(4, 9 + 3) = 22; A: 17 + max(5, 20) = 37
    assert predicted_step_peak(["A", "B", "A"], {"A": A, "B": B}) == 37


def test_a_graph_sees_its_own_calls_through_its_plan():
    costs = {"A": A, "B": B}
    context = step_context("A", ["A", "B", "A"], costs)
    assert context.calls == 2
    assert context.step_peak(A) == predicted_step_peak(["A", "B", "A"], costs)
    # Another plan of A: each of its calls holds less, so the later call sees less.
    lean = GraphCost(held_bytes=2, forward_bytes=6, backward_bytes=25, gradient_bytes=3)
    assert context.step_peak(lean) == predicted_step_peak(["A", "B", "A"], {"A": lean, "B": B}) == 34


def test_a_block_among_many_pays_its_saved_bytes_once_per_call():
    # Alone, the fat plan has the lower peak; in a step of 8 calls the lean one.
    fat = GraphCost(held_bytes=100, forward_bytes=100, backward_bytes=150, gradient_bytes=0)
    lean = GraphCost(held_bytes=10, forward_bytes=100, backward_bytes=200, gradient_bytes=0)
    alone = step_context("block", ["block"], {"block": fat})
    assert alone.step_peak(fat) < alone.step_peak(lean)
    many = step_context("block", ["block"] * 8, {"block": fat})
    assert many.step_peak(fat) == 7 * 100 + 150
    assert many.step_peak(lean) == 7 * 10 + 200
    assert many.step_peak(lean) < many.step_peak(fat)


def test_other_graphs_peaks_bound_the_step_too():
    # B, called after A, peaks high: A's held bytes count at B's moment.
    tall = GraphCost(held_bytes=0, forward_bytes=0, backward_bytes=100, gradient_bytes=0)
    context = step_context("A", ["A", "B"], {"A": A, "B": tall})
    assert context.step_peak(A) == 10 + 100
    assert context.step_peak(GraphCost(1, 5, 20, 0)) == 1 + 100


def test_correction_and_byte_share():
    context = step_context("A", ["A", "B", "B"], {"A": A, "B": B}, correction=1.5, measured=True)
    assert context.step_peak(A) == pytest.approx(1.5 * predicted_step_peak(["A", "B", "B"], {"A": A, "B": B}), abs=1)
    assert context.byte_share == pytest.approx(30 / (30 + 10 + 10))
    assert "corrected by x1.500" in context.describe()


def test_unknown_graphs_count_as_nothing():
    assert predicted_step_peak(["A", "fallback"], {"A": A}) == predicted_step_peak(["A"], {"A": A})
    assert step_context("A", ["fallback", "A"], {"A": A}).step_peak(A) == A.call_peak(0)
