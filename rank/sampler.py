"""Token sampling for the reference engine: greedy, or seeded temperature / top-k / top-p.

Every request owns a ``torch.Generator`` seeded from its ``seed`` (or from the engine's seed
stream when it has none), so the same prompt and seed give the same tokens whatever else runs in
the batch. Greedy ties break to the lowest id (``argmax``).
"""

from __future__ import annotations

import torch

from rank.engine import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of float32 ``logits`` ``[rows, vocab]``."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.is_greedy:
            continue
        tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cumulative - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=gen)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=gen))
