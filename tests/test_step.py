"""The step model (partitioners/step.py): a graph's plan judged in the
step it runs in, on hand-made sequences with hand-computed peaks."""
import dataclasses

import pytest

from partitioners.step import GraphCost, gathered_per_call, predicted_step_peak, repeated_inputs, step_context

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


def test_repeated_inputs_are_those_an_earlier_call_of_the_graph_was_handed():
    # Per call, one identity per input (None: not a tensor). The mask (m) is
    # handed to every block call at position 1; each call's hidden state is new.
    sequence = ["block", "block", "head", "block"]
    inputs = [("h0", "m", None), ("h1", "m", None), ("h2", "m"), ("h3", "m", None)]
    assert repeated_inputs(sequence, inputs) == (frozenset(), {1}, frozenset(), {1})
    # The same tensor at another position, or in another graph, is not a repeat.
    assert repeated_inputs(["a", "a", "b"], [("x", "y"), ("y", "x"), ("x", "y")]) == (frozenset(),) * 3


def test_a_tensor_handed_to_every_call_is_held_once():
    # Each call of the block holds 10 bytes of its own and a 50-byte mask at
    # input 1; four calls hand it the same mask: held 60 + 3 * 10 before the
    # last call, whose backward peaks at 100. Not knowing that: 4 * 60.
    block = GraphCost(held_bytes=60, forward_bytes=70, backward_bytes=100, gradient_bytes=0,
                      held_inputs=((1, 50),), input_count=2)
    sequence = ["block"] * 4
    repeated = repeated_inputs(sequence, [(f"h{i}", "mask") for i in range(4)])
    assert predicted_step_peak(sequence, {"block": block}, repeated) == 60 + 2 * 10 + 100
    assert predicted_step_peak(sequence, {"block": block}) == 3 * 60 + 100
    context = step_context("block", sequence, {"block": block}, repeated=repeated)
    assert context.step_peak(block) == 60 + 2 * 10 + 100
    # A plan that does not save the mask holds only its own bytes.
    lean = dataclasses.replace(block, held_bytes=10, held_inputs=())
    assert context.step_peak(lean) == 3 * 10 + 100


def test_activation_gradients_a_call_hands_back_are_not_held_for_the_step():
    # A block's backward returns its parameters' gradients (8 bytes, kept in
    # .grad) and its input's (32 bytes), which the call before it reads as
    # its tangent and frees: only the 8 stay for the rest of backward.
    from partitioners.peak import PeakEstimate

    peak = PeakEstimate(forward_bytes=5, backward_bytes=50, held_bytes=1, gradient_bytes=40,
                        input_gradient_bytes=32, tangent_bytes=32, input_gradients=((0, 32),), input_count=2)
    cost = GraphCost.of(peak)
    assert cost.gradient_bytes == 8
    # Three calls: the first one's backward sees the later two's parameter
    # gradients (16), the second one's the last's (8), the last none.
    assert predicted_step_peak(["block"] * 3, {"block": cost}) == 50 + 16 == max(50 + 16, 1 + 50 + 8, 2 + 50)


def test_the_gradient_of_a_tensor_handed_to_several_calls_is_alive_once():
    # An encoder's output handed to every decoder block (input 1, 32 bytes):
    # autograd sums its gradients from the last block's backward on, one
    # copy, until the encoder's backward reads it.
    block = GraphCost(held_bytes=0, forward_bytes=0, backward_bytes=50, gradient_bytes=0,
                      input_count=2, input_gradients=((0, 32), (1, 32)))
    sequence = ["block"] * 3
    repeated = repeated_inputs(sequence, [(f"h{i}", "encoder") for i in range(3)])
    assert predicted_step_peak(sequence, {"block": block}, repeated) == 50 + 32
    assert predicted_step_peak(sequence, {"block": block}) == 50  # handed to one call each: freed by the one before
    assert step_context("block", sequence, {"block": block}, repeated=repeated).step_peak(block) == 50 + 32


def test_what_fsdp_gathers_around_each_call():
    # Three blocks whose 8 bytes of parameters FSDP2 gathers (freed by the
    # step's end), a head without: a block's backward holds its own, the
    # ones prefetched for the block before it, and the reduce-scatter
    # buffers (input 8, output 8 / 2 ranks) of the block after it.
    gathered = gathered_per_call([8, 8, 8, 0], kept=0.5)
    assert [(g.forward, g.backward) for g in gathered] == [(8, 8 + 12), (8, 8 + 8 + 12), (8, 8 + 8), (0, 0)]
    # Each block's 8 bytes of parameter gradients are scattered: 4 stay.
    block = GraphCost(held_bytes=10, forward_bytes=20, backward_bytes=50, gradient_bytes=8)
    head = GraphCost(held_bytes=0, forward_bytes=5, backward_bytes=5, gradient_bytes=0)
    sequence, costs = ["block"] * 3 + ["head"], {"block": block, "head": head}
    # Per block's backward: what the earlier blocks hold + its backward +
    # what is gathered around it + the later blocks' 4-byte gradient shards.
    peak = max(0 + 50 + 20 + 2 * 4, 10 + 50 + 28 + 4, 20 + 50 + 16)
    assert peak == 92
    assert predicted_step_peak(sequence, costs, gathered=gathered) == peak
    assert step_context("block", sequence, costs, gathered=gathered).step_peak(block) == peak
    # Not sharded: nothing gathered, every gradient kept whole.
    assert predicted_step_peak(sequence, costs) == max(50 + 16, 10 + 50 + 8, 20 + 50)
