"""Byte-level BPE tokenizer trained on the train split (the ``tokenizers`` library), saved as a
Hugging Face tokenizer the way ``hybrid_engine.default_model`` saves its own: ``<pad>`` 0, ``<s>`` 1,
``</s>`` 2, left padding, no automatic BOS, and the default model's chat template."""
from __future__ import annotations

from hybrid_engine.default_model import CHAT_TEMPLATE, SPECIAL_TOKENS


def train_bpe(texts, vocab_size: int):
    """A ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens (exactly that many when the
    texts allow that many merges). Deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_files(tok, texts) -> list[list[int]]:
    """Token ids of each text (no special tokens), batched through the Rust tokenizer."""
    enc = tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in enc]
