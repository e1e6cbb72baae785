"""Tiny, locally built Qwen3 models and a character tokenizer.

Tests, the offline demo, benchmarks and the notebook's smoke mode use these so nothing is ever downloaded.
The tokenizer has one token per printable ASCII character plus Qwen's chat special tokens, and a
Qwen-style chat template, so chat-formatted datasets work exactly as with the real Qwen3 tokenizer.
"""

from __future__ import annotations

import string

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

__all__ = ["CHAT_TEMPLATE", "build_char_tokenizer", "build_tiny_qwen3", "build_tiny_qwen3_critic"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(characters: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (pad ``<|endoftext|>``, eos ``<|im_end|>``) with a chat template.

    Args:
        characters: the alphabet; defaults to printable ASCII plus newline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = (
        characters if characters is not None else string.printable.replace("\r", "").replace("\x0b", "")
    )
    alphabet = "".join(dict.fromkeys(alphabet.replace("\x0c", "")))
    specials = [PAD_TOKEN, IM_START, IM_END]
    vocab = {token: index for index, token in enumerate(specials + list(alphabet))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    max_position_embeddings: int,
    head_dim: int | None = None,
    **overrides,
) -> Qwen3Config:
    head_dim = head_dim or hidden_size // num_heads
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **overrides,
    )


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    head_dim: int | None = None,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM (about 50k parameters at the defaults). ``head_dim`` defaults to
    ``hidden_size // num_heads``; Qwen3 projects to ``num_heads * head_dim``, so it may differ (vLLM's CPU
    attention needs at least 32)."""
    tokenizer = tokenizer or build_char_tokenizer()
    torch.manual_seed(seed)
    config = _tiny_config(tokenizer, hidden_size, num_layers, num_heads, max_position_embeddings, head_dim)
    model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_qwen3_critic(
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Qwen3ForSequenceClassification:
    """A tiny Qwen3 sequence classifier with one label, the shape TRL expects of a value model."""
    tokenizer = tokenizer or build_char_tokenizer()
    torch.manual_seed(seed)
    config = _tiny_config(
        tokenizer, hidden_size, num_layers, num_heads, max_position_embeddings, num_labels=1
    )
    return Qwen3ForSequenceClassification(config)
