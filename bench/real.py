"""Optional real architectures, tiny and with random weights, built from
configs (no downloads): transformers GPT-2, Llama, BERT; timm ViT, ResNet.
Each is used only when its package is installed; neither is a dependency."""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.cases import Case

# name -> package it needs
REAL = {"gpt2": "transformers", "llama": "transformers", "bert": "transformers",
        "vit": "timm", "resnet": "timm"}

SEQ, VOCAB, BATCH = 64, 512, 4  # tiny: CPU-sized, like the built-in GPT
IMAGE, CLASSES, IMAGE_BATCH = 32, 10, 16  # CIFAR-sized


class LanguageModelLoss(nn.Module):
    """A transformers model's own loss on ``tokens`` as labels."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss


class ClassifierLoss(nn.Module):
    """Cross-entropy of an image classifier's logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


def missing(name: str) -> str | None:
    """Why the real model ``name`` cannot run here, or None if it can."""
    package = REAL[name]
    return None if importlib.util.find_spec(package) else f"{package} is not installed"


def _tokens(batch: int):
    return (torch.randint(VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0)),)


def _images(batch: int):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 3, IMAGE, IMAGE, generator=generator),
            torch.randint(CLASSES, (batch,), generator=generator))


def _hf_checkpointing(wrapper: nn.Module) -> None:
    model, kwargs = wrapper.model, {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _timm_checkpointing(wrapper: nn.Module) -> None:
    wrapper.model.set_grad_checkpointing(True)


def _hf_model(name: str) -> nn.Module:
    import transformers as tf

    # Dropout off so that every mode can be compared with eager's gradients;
    # no key-value cache: training steps never read it back.
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                               bos_token_id=0, eos_token_id=0)  # within the tiny vocabulary
        return tf.GPT2LMHeadModel(config)
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=SEQ, use_cache=False)
        return tf.LlamaForCausalLM(config)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=SEQ,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, use_cache=False)
    return tf.BertForMaskedLM(config)


def _timm_model(name: str) -> nn.Module:
    import timm

    if name == "vit":
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=4,
                                 depth=4, num_classes=CLASSES)
    return timm.create_model("resnet18", pretrained=False, num_classes=CLASSES)


def real_case(name: str) -> Case:
    """The Case of a real model; call only when ``missing(name)`` is None."""
    if REAL[name] == "transformers":
        return Case(
            name, f"transformers {name}, tiny config, random weights, seq {SEQ}",
            lambda: LanguageModelLoss(_hf_model(name)), _tokens, BATCH,
            unit="tokens", per_sample=SEQ, enable_checkpointing=_hf_checkpointing,
        )
    return Case(
        name, f"timm {name}, tiny config, random weights, {IMAGE}x{IMAGE} images",
        lambda: ClassifierLoss(_timm_model(name)), _images, IMAGE_BATCH,
        enable_checkpointing=_timm_checkpointing,
    )
