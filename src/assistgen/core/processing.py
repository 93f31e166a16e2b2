"""The history-dependent part of the processed distribution: min_tokens, bad words, logit bias and the penalties,
applied to every row the target gives as plain decoding applies them at that position.

Contract: `process_rows(logits [n+1, vocab], config, prompt, output, draft, eos)` returns the rows processed, row i
as plain decoding would process it after `output + draft[:i]` (a draft token is history for the rows after it, so
that greedy speculation keeps plain decoding's tokens and speculative sampling stays lossless); `active(config)` says
whether there is anything to do (nothing is copied otherwise). In order, as vLLM applies them:
- `min_tokens`: the end tokens `eos` are forbidden (-inf) at rows whose position is below it;
- `bad_words` (token sequences): a one-token word is forbidden everywhere, a longer one's last token where the history
  ends with the rest;
- `logit_bias` ({token: bias}) is added;
- `repetition_penalty` r (HF's and vLLM's): for every token in the prompt or the history, a positive logit is divided
  by r and a negative one multiplied;
- `frequency_penalty` f and `presence_penalty` p (OpenAI's): a token's logit less f times its count in the history
  (the output only, not the prompt) and less p once it has occurred.
Temperature, min-p, top-k and top-p follow in `spec.sampling.Sampler`. Only the columns of tokens that occur are
gathered, so that a step costs in the history's length, not in the vocabulary's.
"""

from __future__ import annotations

import torch

from assistgen.config import GenerationConfig


def banned_sequences(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """Bad words as the token sequences `bad_words` takes: each word tokenized alone and after a space (at the start
    of the text and inside it), as vLLM bans them."""
    banned = {tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
              for word in words for text in (word.lstrip(), " " + word.lstrip())}
    return tuple(sorted(ids for ids in banned if ids))


def active(config: GenerationConfig) -> bool:
    return bool(config.min_tokens or config.bad_words or config.logit_bias or config.repetition_penalty != 1.0
                or config.frequency_penalty or config.presence_penalty)


def process_rows(logits: torch.Tensor, config: GenerationConfig, prompt: list[int], output: list[int],
                 draft: list[int], eos: set[int]) -> torch.Tensor:
    """logits [n+1, vocab] (row i after output + draft[:i]) -> the processed rows (a new tensor)."""
    rows = logits.shape[0]
    draft = draft[: rows - 1]
    logits = logits.float().clone()
    forbid_early_ends(logits, config.min_tokens, len(output), eos)
    forbid_bad_words(logits, config.bad_words, output, draft)
    if config.logit_bias:
        tokens = torch.tensor([t for t, _ in config.logit_bias], device=logits.device)
        logits[:, tokens] += torch.tensor([b for _, b in config.logit_bias], device=logits.device)
    if config.repetition_penalty != 1.0 or config.frequency_penalty or config.presence_penalty:
        penalize(logits, config, prompt, output, draft)
    return logits


def forbid_early_ends(logits: torch.Tensor, min_tokens: int, written: int, eos: set[int]) -> None:
    """Rows at positions below `min_tokens` (row i is output position written + i) may not end."""
    early = max(0, min(logits.shape[0], min_tokens - written))
    if early and eos:
        logits[:early, sorted(eos)] = float("-inf")


def forbid_bad_words(logits: torch.Tensor, words: tuple[tuple[int, ...], ...], output: list[int],
                     draft: list[int]) -> None:
    history = output + draft
    for word in words:
        *head, last = word
        for i in range(logits.shape[0]):
            end = len(output) + i  # row i follows history[:end]
            if not head or (end >= len(head) and history[end - len(head): end] == head):
                logits[i, last] = float("-inf")


def penalize(logits: torch.Tensor, config: GenerationConfig, prompt: list[int], output: list[int],
             draft: list[int]) -> None:
    """The repetition, frequency and presence penalties, on the columns of the tokens that occur."""
    rows = logits.shape[0]
    in_prompt = set(prompt) if config.repetition_penalty != 1.0 else set()
    columns = sorted(set(output) | set(draft) | in_prompt)
    if not columns:
        return
    where = {t: j for j, t in enumerate(columns)}
    counts = torch.zeros(rows, len(columns))  # [rows, c]: each row's count of each token in its history
    for t in output:
        counts[:, where[t]] += 1
    for i, t in enumerate(draft):  # draft token i is history for rows i+1..
        counts[i + 1:, where[t]] += 1
    counts = counts.to(logits.device)
    index = torch.tensor(columns, device=logits.device)
    cols = logits[:, index]  # [rows, c]
    r = config.repetition_penalty
    if r != 1.0:
        seen = counts > 0
        if in_prompt:
            seen |= torch.tensor([t in in_prompt for t in columns], device=logits.device)
        cols = torch.where(seen, torch.where(cols > 0, cols / r, cols * r), cols)
    cols = cols - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).float()
    logits[:, index] = cols
