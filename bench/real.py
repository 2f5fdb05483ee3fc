"""Real architectures, tiny and with random weights, built from transformers'
configs (no downloads): GPT-2, Llama, BERT, ViT, ResNet, and ``llama8``, the
Llama-style model at a realistic sequence length (8 layers, d=256, seq 512).
transformers is in the bench extra; without it they are skipped with a note.
(timm's ViT and ResNet would need torchvision, which does not import beside
the CPU build of torch this project pins, so transformers' own are used.)"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.cases import Case

# name -> package it needs
REAL = {name: "transformers" for name in ("gpt2", "llama", "bert", "vit", "resnet", "llama8")}
# Families at realistic sizes (bench/families.py) the peak model was not fitted on.
FAMILY_CASES = ("t5", "convnext", "gpt_neox", "gemma", "whisper", "swin", "mobilenet_v2", "mamba2")
REAL.update({name: "transformers" for name in FAMILY_CASES})

SEQ, VOCAB, BATCH = 64, 512, 4  # tiny: CPU-sized, like the built-in GPT
# llama8: the shape a user reported (8 layers, d=256, 4 heads, 2 KV heads).
LONG_SEQ, LONG_BATCH = 512, 2
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


def _tokens(batch: int, seq: int = SEQ):
    return (torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0)),)


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
    if name == "llama8":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=LONG_SEQ, use_cache=False,
                                attn_implementation="sdpa")
        return tf.LlamaForCausalLM(config)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=SEQ,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, use_cache=False)
    return tf.BertForMaskedLM(config)


def _vision_model(name: str) -> nn.Module:
    """A classifier returning logits (transformers returns an output object)."""
    import transformers as tf

    if name == "vit":  # ViT-Tiny's width and heads, 4 layers, 4x4 patches
        config = tf.ViTConfig(image_size=IMAGE, patch_size=4, hidden_size=192, num_hidden_layers=4,
                              num_attention_heads=3, intermediate_size=768, num_labels=CLASSES,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return _Logits(tf.ViTForImageClassification(config))
    config = tf.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                             layer_type="basic", num_labels=CLASSES)  # ResNet-18
    return _Logits(tf.ResNetForImageClassification(config))


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits


def real_case(name: str) -> Case:
    """The Case of a real model; call only when ``missing(name)`` is None."""
    if name in FAMILY_CASES:
        from bench.families import family_case

        return family_case(name)
    if name == "llama8":
        return Case(
            name, f"transformers Llama, 8 layers, d=256, 4 heads, 2 KV heads, seq {LONG_SEQ}",
            lambda: LanguageModelLoss(_hf_model(name)), lambda b: _tokens(b, LONG_SEQ), LONG_BATCH,
            unit="tokens", per_sample=LONG_SEQ, enable_checkpointing=_hf_checkpointing,
        )
    if name in ("vit", "resnet"):
        return Case(
            name, f"transformers {name}, tiny config, random weights, {IMAGE}x{IMAGE} images",
            lambda: ClassifierLoss(_vision_model(name)), _images, IMAGE_BATCH,
            enable_checkpointing=lambda wrapper: _hf_checkpointing(wrapper.model),
        )
    return Case(
        name, f"transformers {name}, tiny config, random weights, seq {SEQ}",
        lambda: LanguageModelLoss(_hf_model(name)), _tokens, BATCH,
        unit="tokens", per_sample=SEQ, enable_checkpointing=_hf_checkpointing,
    )
