"""A tiny random Llama and a tokenizer trained on local text: SGLang serves it on this CPU
with nothing downloaded.  Random weights make outputs meaningless but deterministic at
temperature 0, which is what comparing two deployments needs."""

from __future__ import annotations

import glob
import os
from pathlib import Path

VOCAB = 1024


def make_model(out: Path) -> Path:
    """Write the model and tokenizer to `out` (once: an existing one is kept)."""
    if (out / "config.json").exists():
        return out
    import sglang
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(
        glob.glob(os.path.join(os.path.dirname(sglang.__file__), "srt", "managers", "*.py"))
    )
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        (Path(f).read_text() for f in sources[:30]),
        trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out
