"""The training run, short: ckpt's losses are torch.compile's, bit for bit, at
every budget; a run stopped and resumed in a new process loses nothing."""
import dataclasses
import json

import pytest
import torch

from bench.corpus import load_corpus, stdlib_files, train_batch, validation_batches
from bench.harness import fresh_inductor_cache
from bench.modes import parse_mode
from bench.training import SIZES, train
from bench.train_results import agreement, resume_in_new_process

SETTINGS = dataclasses.replace(SIZES["quick"], steps=4, eval_every=2)
RESUME_AT = 2
MODES = ("eager", "compile", "ckpt", "ckpt+budget=0.0")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every mode trained once, the ckpt modes checkpointed at RESUME_AT and
    reporting, in a fresh Inductor cache that stays open for the resumed
    processes (their compiles read it)."""
    folder = tmp_path_factory.mktemp("train")
    corpus = load_corpus(stdlib_files()[:20])
    with fresh_inductor_cache():
        runs, checkpoints, reports = {}, {}, {}
        for mode in map(parse_mode, MODES):
            if mode.kind == "ckpt":
                checkpoints[str(mode)] = str(folder / f"{mode.budget}.pt")
                reports[str(mode)] = folder / f"reports-{mode.budget}"
            runs[str(mode)] = train(mode, SETTINGS, corpus, checkpoint_at=RESUME_AT,
                                    checkpoint_path=checkpoints.get(str(mode)), report_dir=reports.get(str(mode)))
        yield runs, checkpoints, reports


def test_corpus_splits_by_file_and_batches_depend_on_the_step_alone():
    files = stdlib_files()[:20]
    corpus = load_corpus(files)
    assert corpus.files == tuple(map(str, files))
    assert len(corpus.train) + len(corpus.validation) == sum(f.stat().st_size for f in files)
    assert bytes(corpus.validation[:100]) == files[9].read_bytes()[:100]  # the 10th file
    state = torch.get_rng_state()
    first = train_batch(corpus, 7, batch=3, seq=16)
    assert torch.equal(torch.get_rng_state(), state)  # the dropout generator is not touched
    assert all(torch.equal(a, b) for a, b in zip(first, train_batch(corpus, 7, batch=3, seq=16)))
    assert not torch.equal(first[0], train_batch(corpus, 8, batch=3, seq=16)[0])
    inputs, targets = first
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    assert [b[0].shape for b in validation_batches(corpus, 2, batch=3, seq=16)] == [(3, 16)] * 2


def test_ckpt_losses_are_torch_compiles_bit_for_bit_at_every_budget(trained):
    runs, _, _ = trained
    reference = runs["compile"]
    assert len(reference.losses) == SETTINGS.steps
    assert reference.validation[-1][1] < reference.validation[0][1]  # it learns
    for mode in ("ckpt", "ckpt+budget=0.0"):
        # Same seed, same dropout masks (replayed from the seeds, not stored),
        # same updates: every training loss and validation loss is equal.
        result = agreement(runs[mode], reference)
        assert result.bitwise, (mode, result)
        assert runs[mode].validation == reference.validation
    # Eager draws its masks from the generator in its own way: other losses.
    assert agreement(runs["eager"], reference).bitwise_equal_steps == 0
    assert runs["eager"].validation[0] == reference.validation[0]  # the same initial model


def test_ledger_of_a_training_step_adds_up(trained):
    runs, _, _ = trained
    for run in runs.values():
        ledger = run.ledger
        assert ledger.gradients_bytes == ledger.parameters_bytes  # one float32 gradient per parameter
        # AdamW: two float32 moments per parameter, and a float32 step count per tensor.
        tensors = len(list(torch.nn.Module.parameters(_quick_model())))
        assert ledger.optimizer_state_bytes == 2 * ledger.parameters_bytes + 4 * tensors
        assert ledger.gradients_at_peak + ledger.saved_at_peak + ledger.temporaries_at_peak == ledger.peak_bytes
        assert ledger.temporaries_at_peak >= 0 and ledger.peak_phase in ("forward", "backward", "optimizer")
    assert runs["ckpt+budget=0.0"].ledger.saved_activations_bytes < runs["compile"].ledger.saved_activations_bytes
    assert runs["ckpt"].ledger.saved_activations_bytes == runs["ckpt"].plan_saved_bytes


def test_reports_ledger_is_the_measured_one_and_lists_the_optimizer_state(trained):
    runs, _, reports = trained
    for mode, folder in reports.items():
        (path,) = folder.glob("*.json")  # one graph
        ledger, measured = json.loads(path.read_text())["ledger"], runs[mode].ledger
        assert ledger["parameters_bytes"] == measured.parameters_bytes
        assert ledger["gradients_bytes"] == measured.gradients_bytes
        assert ledger["saved_activation_bytes"] == measured.saved_activations_bytes
        assert ledger["optimizer_state_bytes"] == measured.optimizer_state_bytes
        nbytes = measured.optimizer_state_bytes
        line = (f"- optimizer state (AdamW, all its parameters, measured by the training loop): "
                f"{nbytes / 2**20:.2f} MiB ({nbytes} bytes)")
        assert line in path.with_suffix(".md").read_text()


def test_resume_in_a_new_process_loses_nothing(trained):
    runs, checkpoints, _ = trained
    for mode, path in checkpoints.items():
        resumed = resume_in_new_process(path, timeout_s=300)
        assert resumed.start == RESUME_AT and len(resumed.losses) == SETTINGS.steps - RESUME_AT
        result = agreement(resumed, runs[mode])
        assert result.bitwise, (mode, result)
        assert resumed.validation == [v for v in runs[mode].validation if v[0] > RESUME_AT]


def _quick_model():
    from bench.models import GPT

    return GPT(SETTINGS.model)
