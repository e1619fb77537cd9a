"""Token sampling for the reference engine: greedy, or seeded temperature / top-k / top-p.

Every request owns a ``torch.Generator`` seeded from its ``seed`` (or from the engine's seed
stream when it has none), so the same prompt and seed give the same tokens whatever else runs in
the batch. Greedy ties break to the lowest id (``argmax``).

Fault isolation: rows are sampled one by one and a row that cannot be sampled (a distribution
with no finite positive mass, whatever the cause) is reported in ``errors`` instead of
raising, so the engine fails that request alone and the rest of the batch goes on. The top_p
filter always keeps the most likely token: a tiny top_p (1e-50 rounds to 0 in float32) used to
filter out every token, and ``torch.multinomial`` raised inside the rank step, killing the rank.
"""

from __future__ import annotations

import torch

from rank.engine import SamplingParams

_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & _SEED_MASK)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    errors: dict[int, str] | None = None,
) -> list[int]:
    """One token per row of float32 ``logits`` ``[rows, vocab]``.

    With ``errors`` given, a row that cannot be sampled gets token -1 and its reason in
    ``errors[row]`` (the engine fails that request alone); without it, the error is raised."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.is_greedy:
            continue
        try:
            tokens[row] = _sample_row(logits[row], p, gen)
        except (RuntimeError, ValueError, OverflowError) as exc:
            if errors is None:
                raise
            tokens[row] = -1
            errors[row] = f"sampling failed: {type(exc).__name__}: {exc}"
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
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        drop = (cumulative - sorted_probs) >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        _check_mass(sorted_probs)
        choice = torch.multinomial(sorted_probs, 1, generator=gen)
        return int(order[choice])
    _check_mass(probs)
    return int(torch.multinomial(probs, 1, generator=gen))


def _check_mass(probs: torch.Tensor) -> None:
    total = float(probs.sum())
    if not (total > 0 and total < float("inf")) or bool(torch.isnan(probs).any()):
        raise ValueError(f"no finite positive probability mass (sum {total})")
