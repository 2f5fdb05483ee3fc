"""Architecture families from transformers' configs (random weights, no
downloads), at realistic sizes, for the budget benches: each a model, its
batches and its loss, and whether transformers can checkpoint it per layer.

Decoders: Qwen2, Mistral, GPT-NeoX (parallel attention and MLP, partial
rotary), Gemma (GeGLU, one KV head, tied embeddings). Others: T5
(encoder-decoder, relative position bias, cross-attention), ConvNeXt
(depthwise convolutions, LayerNorm over channels with permutes), Whisper
(audio: a convolutional front end, then an encoder-decoder) and Swin
(windowed attention with shifted windows and relative position bias),
MobileNetV2 (inverted residuals, depthwise convolutions, BatchNorm) and
Mamba2 (a state-space decoder: a causal depthwise convolution, then
transformers' PyTorch chunked scan, no attention).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

VOCAB = 512
CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build, feed and train one family."""

    name: str
    build: Callable[[int, int, int], torch.nn.Module]
    """(layers, width, seq) -> a model with random weights (seeded)."""
    batch: Callable[[torch.Generator, int, int], dict]
    """(generator, batch size, seq) -> the keyword arguments of one step."""
    per_layer_checkpointing: bool = True
    """transformers' gradient_checkpointing_enable() works on it."""
    decoder: bool = False
    """A causal language model (``input_ids`` and ``labels``)."""
    size: tuple[int, int, int, int] = (6, 128, 512, 2)
    """Realistic for this machine: (layers, width, seq or image side, batch)."""

    def loss(self, model, inputs: dict) -> torch.Tensor:
        return model(**inputs).loss


def _decoder_common(layers, width, seq):
    return dict(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq, 512), use_cache=False,
        attn_implementation="sdpa",
    )


def _qwen2(layers, width, seq):
    import transformers as tf

    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_decoder_common(layers, width, seq)))


def _mistral(layers, width, seq):
    import transformers as tf

    return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **_decoder_common(layers, width, seq)))


def _gemma(layers, width, seq):
    import transformers as tf

    common = _decoder_common(layers, width, seq)
    common.update(num_key_value_heads=1, head_dim=width // 4)
    return tf.GemmaForCausalLM(tf.GemmaConfig(**common))


def _gpt_neox(layers, width, seq):
    import transformers as tf

    common = _decoder_common(layers, width, seq)
    del common["num_key_value_heads"]
    common.update(intermediate_size=width * 4, use_parallel_residual=True)
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))


def _t5(layers, width, seq):
    import transformers as tf

    config = tf.T5Config(
        vocab_size=VOCAB, d_model=width, d_kv=width // 4, d_ff=width * 4, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, relative_attention_num_buckets=32, dropout_rate=0.0,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )
    return tf.T5ForConditionalGeneration(config)


def _whisper(layers, width, seq):
    import transformers as tf

    config = tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=80, d_model=width, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=width * 4,
        decoder_ffn_dim=width * 4, max_source_positions=seq, max_target_positions=max(seq, 448),
        use_cache=False, attn_implementation="sdpa", dropout=0.0, decoder_start_token_id=0,
        pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )
    return tf.WhisperForConditionalGeneration(config)


def _convnext(layers, width, seq):
    import transformers as tf

    # Four stages (ConvNeXt-T's shape, scaled): ``layers`` blocks in stage 3.
    config = tf.ConvNextConfig(
        num_channels=3, hidden_sizes=[width // 2, width, 2 * width, 4 * width],
        depths=[2, 2, layers, 2], num_labels=CLASSES, drop_path_rate=0.0,
    )
    return tf.ConvNextForImageClassification(config)


def _swin(layers, width, seq):
    import transformers as tf

    config = tf.SwinConfig(
        image_size=seq, patch_size=4, num_channels=3, embed_dim=width // 2, depths=[2, layers, 2],
        num_heads=[2, 4, 8], window_size=4, num_labels=CLASSES, drop_path_rate=0.0,
        attn_implementation="eager",
    )
    return tf.SwinForImageClassification(config)


def _mobilenet_v2(layers, width, seq):
    import transformers as tf

    # MobileNetV2's 17 inverted-residual blocks are fixed; ``width`` scales
    # every channel count (64: the published network), ``layers`` is unused.
    config = tf.MobileNetV2Config(
        num_channels=3, image_size=seq, depth_multiplier=width / 64, num_labels=CLASSES,
    )
    return tf.MobileNetV2ForImageClassification(config)


def _mamba2(layers, width, seq):
    import transformers as tf

    # Mamba2's published shape scaled to ``width``: expand 2, heads of 32,
    # one group, its default chunk of 256 tokens; the state of 32 (published
    # 128) keeps the state at width / 4 as in the published models.
    config = tf.Mamba2Config(
        vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers, expand=2, head_dim=32,
        num_heads=2 * width // 32, n_groups=1, state_size=width // 4, chunk_size=256, use_cache=False,
    )
    return tf.Mamba2ForCausalLM(config)


def _tokens(generator, batch, seq):
    tokens = torch.randint(VOCAB, (batch, seq), generator=generator)
    return {"input_ids": tokens, "labels": tokens}


def _seq2seq(generator, batch, seq):
    return {
        "input_ids": torch.randint(VOCAB, (batch, seq), generator=generator),
        "labels": torch.randint(1, VOCAB, (batch, seq // 2), generator=generator),
    }


def _audio(generator, batch, seq):
    # Whisper's encoder halves the frames with a stride-2 convolution.
    return {
        "input_features": torch.randn(batch, 80, 2 * seq, generator=generator),
        "labels": torch.randint(1, VOCAB, (batch, seq // 4), generator=generator),
    }


def _images(generator, batch, size):
    return {
        "pixel_values": torch.randn(batch, 3, size, size, generator=generator),
        "labels": torch.randint(CLASSES, (batch,), generator=generator),
    }


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2", _qwen2, _tokens, decoder=True),
        Family("mistral", _mistral, _tokens, decoder=True),
        Family("gpt_neox", _gpt_neox, _tokens, decoder=True),
        Family("gemma", _gemma, _tokens, decoder=True),
        Family("t5", _t5, _seq2seq, size=(4, 128, 256, 4)),
        Family("whisper", _whisper, _audio, size=(4, 128, 256, 4)),
        Family("convnext", _convnext, _images, per_layer_checkpointing=False, size=(6, 64, 64, 8)),
        Family("swin", _swin, _images, size=(6, 64, 64, 8)),
        Family("mobilenet_v2", _mobilenet_v2, _images, per_layer_checkpointing=False, size=(17, 64, 64, 8)),
        Family("mamba2", _mamba2, _tokens, decoder=True),
    )
}


def build(name: str, layers: int, width: int, seq: int) -> torch.nn.Module:
    """A model of family ``name`` with seeded random weights."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; use one of {', '.join(FAMILIES)}")
    torch.manual_seed(0)
    return FAMILIES[name].build(layers, width, seq)


def batches(name: str, steps: int, batch: int, seq: int) -> list[dict]:
    """``steps`` batches of family ``name`` (the same for every mode)."""
    generator = torch.Generator().manual_seed(0)
    return [FAMILIES[name].batch(generator, batch, seq) for _ in range(steps)]


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The model's lists of repeated layers (decoder layers; an
    encoder-decoder's two stacks; a vision model's stages' blocks)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    # The innermost lists of repeated blocks: drop a list that holds another.
    return [m for m in lists if not any(other is not m and other in set(m.modules()) for other in lists)]


class _KeywordLoss(torch.nn.Module):
    """A transformers model's own loss, its keyword inputs given in order
    (the bench's harness passes inputs positionally)."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *tensors):
        return self.model(**dict(zip(self.keys, tensors))).loss


def family_case(name: str):
    """The family as a bench Case (bench.peak_model, bench.calibrate, the
    side-by-side suite), at its realistic size."""
    from bench.cases import Case

    family = FAMILIES[name]
    layers, width, seq, batch = family.size
    keys = tuple(family.batch(torch.Generator().manual_seed(0), 1, seq))

    def inputs(size: int) -> tuple:
        values = family.batch(torch.Generator().manual_seed(0), size, seq)
        return tuple(values[key] for key in keys)

    def enable_checkpointing(wrapper):
        wrapper.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    return Case(
        name, f"transformers {name}, {layers} layers, width {width}, seq/image {seq}, random weights",
        lambda: _KeywordLoss(FAMILIES[name].build(layers, width, seq), keys), inputs, batch,
        enable_checkpointing=enable_checkpointing if family.per_layer_checkpointing else lambda wrapper: None,
    )
