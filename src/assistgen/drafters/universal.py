"""Universal assisted generation: an assistant whose tokenizer differs from the target's.

Contract: `UniversalDrafter` is a drafter like any other (see `spec/drafts.py`): it proposes target
token ids. Inside, it keeps the assistant's own token sequence and KV cache and translates between
the two tokenizations through text.

- Target -> assistant: the target's text (special tokens left out) is encoded with the assistant
  tokenizer; the assistant's cache is cropped to the prefix it shares with that encoding and fed
  only what it has not seen, so unconfirmed draft tokens are discarded. `AssistantContext` does this
  incrementally (decoding only new target tokens, re-encoding only a bounded tail of the text), and
  `TextBridge.to_target` decodes only a bounded tail of the target's tokens, so a drafting step
  costs the same on a 1,000-word prompt as on a 10-word one.
- Assistant -> target (greedy, string-level): the draft is decoded to text and re-encoded with the
  target tokenizer together with a look-behind window of the target's last tokens, so that merges
  across the boundary come out right; the re-encoding is aligned with the window to find where the
  new tokens start. Incomplete UTF-8 characters are held back.
- Sampling (token-level intersection, Timor et al. 2025): the assistant samples only among tokens
  whose bytes are also exactly one target token; its distribution, restricted and renormalised,
  is mapped into the target vocabulary (zero elsewhere) and verified with the same speculative
  sampling rule as any drafter. Target tokens outside the intersection still come out through
  the residual and bonus draws, so the output follows the target distribution exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler

BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
LOOK_BEHIND = 6  # target tokens re-encoded together with the draft text


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable-character -> byte table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=False)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
    return "ByteLevel" in kinds


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each token id stands for, with 'Ġ'/'▁' space markers and <0xNN> byte tokens resolved.

    None for special tokens and for tokens whose bytes cannot be read off.
    """
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    byte_level = _is_byte_level(tokenizer)
    table = _byte_decoder()
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            out.append(None)
        elif byte_level:
            out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode())
        elif m := BYTE_TOKEN.match(piece):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


@dataclass
class VocabIntersection:
    """Tokens whose bytes are a single token in both vocabularies, paired one to one."""

    assistant_ids: torch.Tensor  # [m]
    target_ids: torch.Tensor  # [m]

    @property
    def size(self) -> int:
        return int(self.assistant_ids.numel())

    @classmethod
    def build(cls, target_tokenizer, assistant_tokenizer) -> VocabIntersection:
        """Cached per tokenizer pair: building it reads both vocabularies (slow for a large vocabulary)."""
        return _build_intersection(target_tokenizer, assistant_tokenizer)


@lru_cache(maxsize=8)
def _build_intersection(target_tokenizer, assistant_tokenizer) -> VocabIntersection:
    target_index = _index_by_bytes(target_tokenizer)
    pairs = sorted((a, target_index[b]) for b, a in _index_by_bytes(assistant_tokenizer).items() if b in target_index)
    a_ids, t_ids = zip(*pairs, strict=True) if pairs else ((), ())
    return VocabIntersection(torch.tensor(a_ids, dtype=torch.long), torch.tensor(t_ids, dtype=torch.long))


def _index_by_bytes(tokenizer) -> dict[bytes, int]:
    """bytes -> one token id; a regular token wins over a <0xNN> byte-fallback token with the same bytes."""
    index: dict[bytes, int] = {}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    for i, b in enumerate(token_bytes(tokenizer)):
        if b and (b not in index or BYTE_TOKEN.match(pieces[index[b]] or "")):
            index[b] = i
    return index


def strip_partial(text: str) -> str:
    """Drop a trailing incomplete UTF-8 character (decoded as U+FFFD)."""
    return text.rstrip("\ufffd")


class TextBridge:
    """Moves token sequences between two tokenizers through text."""

    def __init__(self, target_tokenizer, assistant_tokenizer, look_behind: int = LOOK_BEHIND):
        self.target = target_tokenizer
        self.assistant = assistant_tokenizer
        self.look_behind = look_behind

    def to_assistant(self, ids: list[int]) -> list[int]:
        """Assistant tokens for the target's whole text (its special tokens left out, a partial character held
        back): the reference that `AssistantContext`, which the drafter uses, is tested against."""
        text = strip_partial(self.target.decode(ids, skip_special_tokens=True))
        return list(self.assistant(text, add_special_tokens=True)["input_ids"])

    def draft_text(self, context: list[int], draft: list[int]) -> str:
        """The text the assistant's draft adds after its context (complete characters only)."""
        tail = context[-self.look_behind :]
        before = self.assistant.decode(tail, skip_special_tokens=True)
        after = self.assistant.decode(tail + draft, skip_special_tokens=True)
        clean = strip_partial(before)
        if not after.startswith(clean):
            return ""
        return strip_partial(after[len(clean) :])

    def to_target(self, ids: list[int], new_text: str) -> list[int]:
        """Target tokens that continue `ids` with `new_text`, aligned through a look-behind window.

        The last few target tokens are decoded, `new_text` appended, and the whole re-encoded; where the
        re-encoding reproduces the window token for token, what follows it is the continuation. Only a
        bounded tail of `ids` is ever decoded, so a step costs the same after 10 or 10,000 tokens.
        """
        if not new_text:
            return []
        base = max(0, len(ids) - 5 * self.look_behind - 4)  # every window below starts at or after it
        tail = ids[base:]
        full = strip_partial(self.target.decode(tail, skip_special_tokens=False))
        first = max(base, len(ids) - self.look_behind)
        for start in range(first, max(base - 1, first - 4 * self.look_behind), -1):
            prefix = self.target.decode(ids[base:start], skip_special_tokens=False)
            if prefix.endswith("\ufffd") or not full.startswith(prefix):
                continue  # the window must start on a character boundary
            window = ids[start:]
            encoded = self.target(full[len(prefix) :] + new_text, add_special_tokens=False)["input_ids"]
            if encoded[: len(window)] == window:
                return list(encoded[len(window) :])
        # No window re-encodes to the target's own tokens (the new text merges with the last one):
        # encode the new text alone, and keep it only if it spells exactly that text after `ids`.
        alone = list(self.target(new_text, add_special_tokens=False)["input_ids"])
        spelled = strip_partial(self.target.decode(tail + alone, skip_special_tokens=False))
        return alone if spelled == full + strip_partial(new_text) else []


class AssistantContext:
    """The assistant's tokens for a growing target sequence, at a cost bounded by the new text, not the whole.

    The target's text is decoded incrementally (only tokens after the last complete character, with a few
    tokens before them so that leading-space rules come out as in the whole decode). The text before `cut`
    is encoded once and frozen; each call encodes only the text after it, and the cut moves forward to a
    space once more than 2 * `tail_chars` characters follow it. The assistant may so see a tokenization
    that differs from its own encoding of the whole text at a cut; drafts are still verified by the
    target, so only their quality could change, not the output.
    """

    def __init__(self, bridge: TextBridge, tail_chars: int = 256, prefix: list[int] | None = None):
        self.bridge = bridge
        self.tail_chars = tail_chars
        self.prefix = None if prefix is None else list(prefix)  # the assistant's own first tokens, instead of the
        # special tokens its tokenizer adds (an encoder-decoder assistant's decoder prompt)
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []  # target tokens whose text is in self.text (ending on a complete character)
        self.text = ""
        self.frozen: list[int] = []  # assistant tokens of text[:cut]
        self.cut = 0

    def __call__(self, ids: list[int]) -> list[int]:
        text = self.target_text(ids)
        encode = self.bridge.assistant
        specials = not self.frozen and self.prefix is None
        tail = list(encode(text[self.cut :], add_special_tokens=specials)["input_ids"]) if text else []
        context = (self.prefix or []) + self.frozen + tail
        if len(text) - self.cut > 2 * self.tail_chars:
            self.freeze(text)
        return context

    def target_text(self, ids: list[int]) -> str:
        """The target's text of `ids` (special tokens left out, a trailing partial character held back)."""
        decode = self.bridge.target.decode
        n = len(self.ids)
        if n > len(ids) or ids[:n] != self.ids:  # not a continuation of what was decoded: start over
            self.reset()
            n = 0
        if n == len(ids):
            return self.text
        start = max(0, n - 4)
        head = decode(ids[start:n], skip_special_tokens=True)
        whole = decode(ids[start:], skip_special_tokens=True)
        if not whole.startswith(head):
            if whole.endswith("\ufffd"):  # byte-fallback decoders spoil a run of bytes until its last one comes
                return self.text
            self.reset()  # a decoder that rewrites earlier text: decode everything
            head, whole = "", decode(ids, skip_special_tokens=True)
        new = whole[len(head) :]
        if new.endswith("\ufffd"):
            return self.text + strip_partial(new)  # wait for the character's other bytes before committing
        self.ids, self.text = list(ids), self.text + new
        return self.text

    def freeze(self, text: str) -> None:
        """Encode the text up to a space about `tail_chars` before the end once, and keep those tokens."""
        limit = len(text) - self.tail_chars
        cut = max(text.rfind(" ", self.cut + 1, limit), text.rfind("\n", self.cut + 1, limit))
        cut = cut if cut > self.cut else limit
        specials = not self.frozen and self.prefix is None
        self.frozen += self.bridge.assistant(text[self.cut : cut], add_special_tokens=specials)["input_ids"]
        self.cut = cut


class UniversalDrafter(Drafter):
    """Any causal LM drafts for any other, whatever the two tokenizers."""

    name = "universal"
    acceptance_prior = None

    def __init__(self, assistant, target, look_behind: int = LOOK_BEHIND, prefix: list[int] | None = None):
        self.model = assistant
        self.cache = assistant.new_cache()
        self.bridge = TextBridge(target.tokenizer, assistant.tokenizer, look_behind)
        self.context = AssistantContext(self.bridge, prefix=prefix)  # prefix: see AssistantContext
        self.context_length = assistant.context_length
        self.ends = frozenset(assistant.eos_token_ids)
        self.target_vocab = target.vocab_size
        self.target_device = target.device  # q rows are made where the target's p is
        self._intersection: VocabIntersection | None = None
        self.mass_sum, self.mass_steps = 0.0, 0

    @property
    def intersection(self) -> VocabIntersection:
        if self._intersection is None:  # the shared (CPU) table, its ids moved to where each side runs
            shared = VocabIntersection.build(self.bridge.target, self.bridge.assistant)
            self._intersection = VocabIntersection(shared.assistant_ids.to(self.model.device),
                                                   shared.target_ids.to(self.target_device))
        return self._intersection

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        context = self.context(ids)
        if not context:
            return Draft()
        pending = self.cache.sync(context)
        if sampler.greedy:
            return self._propose_greedy(ids, context, pending, k, min_confidence)
        return self._propose_sampled(pending, k, sampler, min_confidence)

    def _propose_greedy(self, ids, context, pending, k, min_confidence) -> Draft:
        drafted, passes = [], 0
        for _ in range(k):
            logits = self.cache.feed(pending)[-1]  # [assistant vocab]
            passes += 1
            token = int(logits.argmax())
            if min_confidence > 0 and float(torch.softmax(logits, -1)[token]) < min_confidence:
                break
            drafted.append(token)
            if token in self.ends:  # the assistant ended its text: nothing after it is emitted
                break
            pending = [token]
        tokens = self.bridge.to_target(ids, self.bridge.draft_text(context, drafted))[:k]
        return Draft(tokens=tokens, forward_passes=passes)

    def _propose_sampled(self, pending, k, sampler, min_confidence) -> Draft:
        inter = self.intersection
        a_ids, t_ids = inter.assistant_ids, inter.target_ids
        tokens, rows, passes = [], [], 0
        for _ in range(k):
            logits = self.cache.feed(pending)[-1]  # [assistant vocab]
            passes += 1
            q_a = sampler.probs(logits[None])[0][a_ids]  # [m] restricted to the intersection
            total = float(q_a.sum())
            if total <= 0:
                break
            q_a = q_a / total
            # Decide to stop on q alone, before drawing: a stop that looked at the drawn token would make
            # the proposal distribution differ from q, and min(1, p/q) would no longer yield p.
            if float(q_a.max()) < min_confidence:
                break
            j = sampler.draw(q_a)
            q = torch.zeros(self.target_vocab, device=self.target_device)  # [target vocab], 0 outside the intersection
            q[t_ids] = q_a.to(self.target_device)
            tokens.append(int(t_ids[j]))
            rows.append(q)
            pending = [int(a_ids[j])]
        return Draft(tokens=tokens, probs=torch.stack(rows) if rows else None, forward_passes=passes)

    def observe(self, num_accepted: int, target_probs: torch.Tensor | None = None) -> None:
        """target_probs [k+1, vocab]: record how much of the target's mass the intersection covers."""
        if target_probs is not None and self._intersection is not None:
            self.mass_sum += float(target_probs[:, self._intersection.target_ids].sum(-1).mean())
            self.mass_steps += 1

    def report(self) -> dict:
        out = {"tokenizers": "different (universal mode)"}
        if self._intersection is not None:
            out["vocab_intersection"] = self._intersection.size
            if self.mass_steps:
                out["target_mass_in_intersection"] = round(self.mass_sum / self.mass_steps, 4)
        return out
