"""Autoregressive sampling with a KV cache that returns each sampled token's log-prob.

RL needs, for every response, the token ids exactly as sampled and the log-prob the sampler gave
each one (the engine side of the rollout/trainer mismatch check). `transformers.generate` can
return per-step logits, but only by keeping a `(steps, batch, vocab)` copy and running its
logits-processor machinery each step; this loop does the one thing a rollout needs:

- Prompts are left-padded; position ids come from the attention mask, so a padded row computes
  exactly what it would alone.
- `repeats` samples per prompt share one prefill: the prompt forward runs once per prompt and its
  KV cache and last logits are repeated for the prompt's samples (a group of 8 costs one prompt
  forward, not 8); the draws are the same as with the prompts repeated beforehand.
- Temperature T > 0 samples from softmax(logits / T): the policy's own distribution at T, no
  top-k/top-p. The log-prob recorded is log softmax(logits / T) of the drawn token, the quantity
  the trainer recomputes (its forward divides the logits by the same T). T = 0 is greedy, with
  log-probs of the untempered softmax.
- Draws use a `torch.Generator` seeded per call: the same seed gives the same samples, and the
  caller's global random state is left alone.
- A row stops at its first EOS (kept in the response); finished rows are fed padding until every
  row is done or `max_new_tokens` is reached.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, temperature: float,
           eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None, repeats: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample `repeats` continuations of each left-padded prompt.

    input_ids, attention_mask: `(P, L)`, padding on the left. B = P x repeats rows come back, the
    samples of prompt i in rows `i * repeats ... (i + 1) * repeats - 1`.
    Returns `(tokens (B, N), logprobs (B, N) float32, lengths (B,))` with N <= max_new_tokens:
    row i's response is `tokens[i, :lengths[i]]` (its EOS included when it produced one); entries
    past a row's length are `pad_id` and 0.
    """
    device = input_ids.device
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    attention = attention_mask.clone()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
        logits, attention, positions = (t.repeat_interleave(repeats, 0) for t in (logits, attention, positions))
    batch = logits.shape[0]
    next_position = positions[:, -1] + 1
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = logits.float()
        if temperature > 0:
            log_dist = torch.log_softmax(logits / temperature, dim=-1)
            token = torch.multinomial(log_dist.exp(), 1, generator=generator).squeeze(-1)
        else:
            log_dist = torch.log_softmax(logits, dim=-1)
            token = log_dist.argmax(-1)
        logprob = log_dist.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logprobs.append(torch.where(done, torch.zeros_like(logprob), logprob))
        lengths += (~done).long()
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        attention = torch.cat([attention, (~done).long().unsqueeze(-1)], dim=-1)
        out = model(input_ids=token.unsqueeze(-1), attention_mask=attention, position_ids=next_position.unsqueeze(-1),
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_position = next_position + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), lengths
