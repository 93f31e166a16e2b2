"""Two genuinely different tokenizers trained in the tests, and tiny models that use them.

- `byte_bpe()`: byte-level BPE (GPT-2 / SmolLM2 style: 'Ġ' marks a space, every byte is a token),
  with ChatML special tokens and a chat template.
- `sentencepiece_bpe()`: SentencePiece style (Llama / Gemma: '▁' marks a space, a '▁' is prepended
  to the text, unknown characters fall back to <0xNN> byte tokens), with <s> as BOS.
"""

from __future__ import annotations

import json
from functools import cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from assistgen.backends.torch.model import Model

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps all day long.",
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "Il gatto è sulla sedia. Perché no? Città, università, caffè, più.",
    "我们今天去公园散步。天气很好。",
    "Numbers: 12345 67890 3.14159 2024-11-29",
    "Emoji: 😀 🎉 👍🏽 🚀",
    "Привет, как дела? Ελληνικά.",
]

HARD_TEXTS = {
    "leading spaces": "  two spaces, then   three and a tab\tend",
    "newlines and indentation": "def f(x):\n    if x:\n        return 1\n\n    return 2\n",
    "digits": "In 2024 we paid 1234567 dollars, 3.14159 each.",
    "emoji": "Great job 😀🎉 see you 👍🏽 soon 🚀!",
    "chinese": "我们今天去公园散步。天气很好,我们很开心。",
    "italian": "Perché la città è così bella? Perché è antica.",
    "cyrillic and greek": "Привет, мир. Καλημέρα κόσμε.",
    "rare characters (byte fallback)": "Ωμέγα ≈ ∑ ∫ ☃ ꙮ",
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@cache
def byte_bpe(vocab: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    out.chat_template = CHAT_TEMPLATE
    return out


@cache
def sentencepiece_bpe(vocab: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    for b in range(256):  # byte-fallback tokens, as SentencePiece models carry them
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    tok = Tokenizer.from_str(json.dumps(spec))
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_model(tokenizer, seed: int, layers: int = 2, hidden: int = 64, scale: float = 0.3) -> Model:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return Model(hf.eval(), tokenizer, f"tiny-{type(tokenizer).__name__}-{seed}")
