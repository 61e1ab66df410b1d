"""A word-level tokenizer with one token per id ("t0", "t1", ...) for the tiny random test models.

vLLM loads a tokenizer from the model directory (detokenization, stop strings); random models
made by transformers come without one, and downloading one is not an option here."""

from __future__ import annotations

from pathlib import Path


def write_tokenizer(directory: Path, vocab_size: int, bos_id: int = 1, eos_id: int = 2) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=f"t{bos_id}", eos_token=f"t{eos_id}",
                                      unk_token="t0", pad_token="t0")
    wrapped.save_pretrained(directory)
