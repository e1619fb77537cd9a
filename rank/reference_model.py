"""The reference engine's decoder: RMSNorm, rotary attention (GQA), SwiGLU MLP, paged KV.

Random weights from a fixed seed by default, so **its text is meaningless**: it exists to
exercise the serving stack with real compute, a real paged KV cache and real token ids (the
vocabulary is DeepSeek-V4's, 129,280 ids). Optional weights come from a safetensors file with the
names in ``weight_shapes``.

Batch invariance (CPU, ``exact=True``): a token's hidden states, KV and logits must not depend on
which other tokens share its step, or on whether it was computed in a prefill chunk or a decode
step, so that a request started from cached blocks gives exactly the tokens of a cold run. CPU
GEMMs are not row-invariant across batch sizes (measured: rows differ in the last bits for
different M), but they are for a fixed shape. So every row-wise op runs on fixed
``TILE_ROWS``-row tiles, and attention for a query at position ``p`` runs on a fixed-shape tile
(query rows ``p % ATTN_TILE``, keys ``[0, (p // block_size + 1) * block_size)`` with the future
masked), whatever the chunking. On CUDA (``exact=False``) the model uses plain batched kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

VOCAB_SIZE = 129_280  # DeepSeek-V4 vocabulary (ids 129280+ are multimodal placeholders)
TILE_ROWS = 16
ATTN_TILE = 16


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def is_null(self) -> bool:
        return self.num_layers == 0

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in weight_shapes(self).values())


MODEL_SPECS: dict[str, ModelSpec] = {
    # 'null' computes nothing: the engine emits deterministic ids and stores them in the KV rows.
    "null": ModelSpec("null", 0, 0, 1, 1, 0),
    "tiny": ModelSpec("tiny", 2, 64, 4, 2, 128),  # ~17M params (mostly the vocab), CPU tests
    "small": ModelSpec("small", 4, 256, 8, 4, 768),  # ~70M
    "medium": ModelSpec("medium", 12, 1024, 16, 8, 2816),  # ~0.4B
    "large": ModelSpec("large", 24, 2048, 16, 8, 8192),  # ~2.0B, ~4 GB in bf16 (H200 benchmarks)
}


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    if spec.is_null:
        return {}
    qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (spec.vocab_size, spec.dim)}
    for i in range(spec.num_layers):
        shapes[f"layers.{i}.attn_norm.weight"] = (spec.dim,)
        shapes[f"layers.{i}.wqkv.weight"] = (qkv_out, spec.dim)
        shapes[f"layers.{i}.wo.weight"] = (spec.dim, spec.num_heads * spec.head_dim)
        shapes[f"layers.{i}.mlp_norm.weight"] = (spec.dim,)
        shapes[f"layers.{i}.w_gate_up.weight"] = (2 * spec.ffn_dim, spec.dim)
        shapes[f"layers.{i}.w_down.weight"] = (spec.dim, spec.ffn_dim)
    shapes["norm.weight"] = (spec.dim,)
    shapes["lm_head.weight"] = (spec.vocab_size, spec.dim)
    return shapes


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """One pool row: K and V of every layer for ``block_size`` tokens (null: the token ids)."""
    if spec.is_null:
        return block_size * 4
    elem = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem


def random_weights(spec: ModelSpec, seed: int, device: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(spec).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        fan_in = 1 if name == "embed.weight" else shape[1]
        w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / math.sqrt(fan_in)
        weights[name] = w.to(dtype)
    return weights


def load_weights(spec: ModelSpec, path: Path, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # optional dependency, only for real weights

    loaded = load_file(str(path), device="cpu")
    expected = weight_shapes(spec)
    missing = sorted(set(expected) - set(loaded))
    extra = sorted(set(loaded) - set(expected))
    if missing or extra:
        raise ValueError(
            f"weights {path}: missing {missing[:5]} unexpected {extra[:5]} for model {spec.name}")
    for name, shape in expected.items():
        if tuple(loaded[name].shape) != shape:
            raise ValueError(f"weights {path}: {name} has shape {tuple(loaded[name].shape)}, want {shape}")
    return {name: t.to(device=device, dtype=dtype) for name, t in loaded.items()}


@dataclass(slots=True)
class SeqBatchItem:
    """One sequence's rows in a forward pass: rows ``[row_start, row_start+num_rows)`` of the step
    hold positions ``[start_pos, start_pos+num_rows)``; ``block_table`` covers all of them."""

    row_start: int
    num_rows: int
    start_pos: int
    block_table: torch.Tensor  # int64 on the model's device


class ReferenceModel:
    """Stateless forward over a paged KV pool (the pool belongs to the engine)."""

    def __init__(
        self, spec: ModelSpec, weights: dict[str, torch.Tensor], block_size: int, *, exact: bool
    ) -> None:
        assert not spec.is_null
        self.spec = spec
        self.block_size = block_size
        self.exact = exact
        self.w = weights
        device = weights["embed.weight"].device
        self.device = device
        self.dtype = weights["embed.weight"].dtype
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2,
                                                           dtype=torch.float64) / spec.head_dim))
        self._inv_freq = inv_freq.to(device)
        self._rope_cache_len = 0
        self._cos = self._sin = torch.empty(0)
        self.attn_tile = math.gcd(block_size, ATTN_TILE)

    def kv_view(self, pool: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` view of the uint8 pool."""
        s = self.spec
        return pool.view(self.dtype).view(
            pool.shape[0], s.num_layers, 2, self.block_size, s.num_kv_heads, s.head_dim
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self._rope_cache_len:
            size = max(needed, 2 * self._rope_cache_len, 4096)
            angles = torch.outer(torch.arange(size, dtype=torch.float64, device=self.device), self._inv_freq)
            self._cos, self._sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
            self._rope_cache_len = size
        return self._cos[positions], self._sin[positions]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.spec.norm_eps)).to(x.dtype) * weight

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    def _tiles(self, num_rows: int) -> list[slice]:
        if not self.exact:
            return [slice(0, num_rows)]
        return [slice(i, i + TILE_ROWS) for i in range(0, num_rows, TILE_ROWS)]

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        items: list[SeqBatchItem],
        pool: torch.Tensor,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Compute the step's rows, write their K/V into the pool, return float32 logits of
        ``sample_rows``. ``token_ids``/``positions`` are int64 on the model device."""
        s = self.spec
        num_rows = token_ids.shape[0]
        padded = -(-num_rows // TILE_ROWS) * TILE_ROWS if self.exact else num_rows
        x = torch.zeros(padded, s.dim, device=self.device, dtype=self.dtype)
        x[:num_rows] = self.w["embed.weight"][token_ids]
        pos_padded = torch.zeros(padded, dtype=torch.int64, device=self.device)
        pos_padded[:num_rows] = positions
        cos, sin = self._rope(pos_padded)
        kv = self.kv_view(pool)
        # Where each row's K/V goes: block id and offset (padding rows go nowhere).
        blocks = torch.cat([
            it.block_table[(it.start_pos + torch.arange(it.num_rows, device=self.device)) // self.block_size]
            for it in items
        ])
        offsets = positions % self.block_size
        q_all = torch.empty(padded, s.num_heads, s.head_dim, device=self.device, dtype=self.dtype)
        k_all = torch.empty(padded, s.num_kv_heads, s.head_dim, device=self.device, dtype=self.dtype)
        v_all = torch.empty_like(k_all)
        attn = torch.empty(padded, s.num_heads * s.head_dim, device=self.device, dtype=self.dtype)
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for layer in range(s.num_layers):
            p = f"layers.{layer}."
            for t in self._tiles(padded):
                h = self._rms(x[t], self.w[p + "attn_norm.weight"])
                qkv = F.linear(h, self.w[p + "wqkv.weight"])
                q = qkv[:, :nq].view(-1, s.num_heads, s.head_dim)
                k = qkv[:, nq : nq + nkv].view(-1, s.num_kv_heads, s.head_dim)
                q_all[t] = self._rotate(q, cos[t], sin[t])
                k_all[t] = self._rotate(k, cos[t], sin[t])
                v_all[t] = qkv[:, nq + nkv :].view(-1, s.num_kv_heads, s.head_dim)
            kv[blocks, layer, 0, offsets] = k_all[:num_rows]
            kv[blocks, layer, 1, offsets] = v_all[:num_rows]
            if self.exact:
                self._attention_exact(q_all, kv[:, layer], items, attn)
            else:
                self._attention_fast(q_all, kv[:, layer], items, attn)
            for t in self._tiles(padded):
                x[t] = x[t] + F.linear(attn[t], self.w[p + "wo.weight"])
                h = self._rms(x[t], self.w[p + "mlp_norm.weight"])
                gate, up = F.linear(h, self.w[p + "w_gate_up.weight"]).chunk(2, dim=-1)
                x[t] = x[t] + F.linear(F.silu(gate) * up, self.w[p + "w_down.weight"])
        num_sample = sample_rows.shape[0]
        padded_sample = -(-num_sample // TILE_ROWS) * TILE_ROWS if self.exact else num_sample
        hs = torch.zeros(padded_sample, s.dim, device=self.device, dtype=self.dtype)
        hs[:num_sample] = x[sample_rows]
        logits = torch.empty(padded_sample, s.vocab_size, device=self.device, dtype=torch.float32)
        for t in self._tiles(padded_sample):
            logits[t] = F.linear(self._rms(hs[t], self.w["norm.weight"]), self.w["lm_head.weight"]).float()
        return logits[:num_sample]

    def _gather_kv(self, kv_layer: torch.Tensor, table: torch.Tensor,
                   num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, num_keys)`` (num_keys a multiple of block_size) as
        ``[heads, num_keys, head_dim]`` with the KV heads repeated for GQA."""
        s = self.spec
        nb = num_keys // self.block_size
        kvb = kv_layer[table[:nb]]  # [nb, 2, bs, kvh, hd]
        rep = s.num_heads // s.num_kv_heads
        k = kvb[:, 0].reshape(num_keys, s.num_kv_heads, s.head_dim).repeat_interleave(rep, dim=1)
        v = kvb[:, 1].reshape(num_keys, s.num_kv_heads, s.head_dim).repeat_interleave(rep, dim=1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _attention_exact(self, q_all: torch.Tensor, kv_layer: torch.Tensor, items: list[SeqBatchItem],
                         out: torch.Tensor) -> None:
        s, bs, tile = self.spec, self.block_size, self.attn_tile
        scale = 1.0 / math.sqrt(s.head_dim)
        for it in items:
            pos, end = it.start_pos, it.start_pos + it.num_rows
            gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            while pos < end:
                tile_start = pos - pos % tile
                tile_end = min(tile_start + tile, end)
                num_keys = (tile_start // bs + 1) * bs
                if num_keys not in gathered:
                    gathered = {num_keys: self._gather_kv(kv_layer, it.block_table, num_keys)}
                k, v = gathered[num_keys]
                rows = slice(it.row_start + pos - it.start_pos, it.row_start + tile_end - it.start_pos)
                q = torch.zeros(tile, s.num_heads, s.head_dim, device=self.device, dtype=self.dtype)
                q[pos - tile_start : tile_end - tile_start] = q_all[rows]
                scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, tile, L]
                qpos = torch.arange(tile_start, tile_start + tile, device=self.device)
                future = torch.arange(num_keys, device=self.device)[None, :] > qpos[:, None]
                scores = scores.float().masked_fill(future, float("-inf"))
                probs = torch.softmax(scores, dim=-1).to(self.dtype)
                o = torch.matmul(probs, v)  # [H, tile, hd]
                o_rows = o.transpose(0, 1)[pos - tile_start : tile_end - tile_start]
                out[rows] = o_rows.reshape(-1, s.num_heads * s.head_dim)
                pos = tile_end

    def _attention_fast(self, q_all: torch.Tensor, kv_layer: torch.Tensor, items: list[SeqBatchItem],
                        out: torch.Tensor) -> None:
        s, bs = self.spec, self.block_size
        decode = [it for it in items if it.num_rows == 1]
        for it in items:
            if it.num_rows == 1:
                continue
            end = it.start_pos + it.num_rows
            num_keys = -(-end // bs) * bs
            k, v = self._gather_kv(kv_layer, it.block_table, num_keys)
            q = q_all[it.row_start : it.row_start + it.num_rows].transpose(0, 1)
            qpos = torch.arange(it.start_pos, end, device=self.device)
            allowed = torch.arange(num_keys, device=self.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=allowed)
            out[it.row_start : it.row_start + it.num_rows] = o[0].transpose(0, 1).reshape(it.num_rows, -1)
        if not decode:
            return
        # Decode: one padded batch; tables padded with scratch block 0, masked out.
        max_blocks = max(it.start_pos // bs + 1 for it in decode)
        tables = torch.zeros(len(decode), max_blocks, dtype=torch.int64, device=self.device)
        for i, it in enumerate(decode):
            nb = it.start_pos // bs + 1
            tables[i, :nb] = it.block_table[:nb]
        kvb = kv_layer[tables]  # [B, nb, 2, bs, kvh, hd]
        rep = s.num_heads // s.num_kv_heads
        num_keys = max_blocks * bs
        k = kvb[:, :, 0].reshape(len(decode), num_keys, s.num_kv_heads,
                                 s.head_dim).repeat_interleave(rep, dim=2)
        v = kvb[:, :, 1].reshape(len(decode), num_keys, s.num_kv_heads,
                                 s.head_dim).repeat_interleave(rep, dim=2)
        rows = torch.tensor([it.row_start for it in decode], device=self.device)
        qpos = torch.tensor([it.start_pos for it in decode], device=self.device)
        q = q_all[rows].unsqueeze(2)  # [B, H, 1, hd]
        allowed = (torch.arange(num_keys, device=self.device)[None, :] <= qpos[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
        out[rows] = o[:, :, 0].reshape(len(decode), -1)


def null_forward(
    pool: torch.Tensor, block_size: int, vocab_size: int, token_ids: np.ndarray, positions: np.ndarray,
    items: list[SeqBatchItem], sample_rows: list[int], seeds: np.ndarray,
) -> list[int]:
    """The 'null' model: no compute. It writes each token id as the "KV" of its position (so block
    export/import carry real data) and samples a hash of (last id, position, the request's seed),
    never EOS or another id below 3. ``seeds`` holds one u64 per sampled row."""
    bs = block_size
    # "KV" = the token ids, written at block_table[pos // bs] * bs + pos % bs of the flat view.
    slots = np.empty(len(positions), dtype=np.int64)
    for it in items:
        table = it.block_table  # a plain list for the null model
        if it.num_rows == 1:
            p = it.start_pos
            slots[it.row_start] = table[p // bs] * bs + p % bs
        else:
            pos = positions[it.row_start : it.row_start + it.num_rows]
            span = slice(it.row_start, it.row_start + it.num_rows)
            slots[span] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
    flat = pool.view(torch.int32).view(-1)
    values = torch.from_numpy(token_ids.astype(np.int32)).to(pool.device)
    flat[torch.from_numpy(slots).to(pool.device)] = values
    if not sample_rows:
        return []
    idx = np.asarray(sample_rows, dtype=np.int64)
    x = (token_ids[idx].astype(np.uint64) * np.uint64(0x9E3779B1)
         + positions[idx].astype(np.uint64) * np.uint64(0x85EBCA77)
         + seeds * np.uint64(0xC2B2AE3D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(12)
    ids: list[int] = (x % np.uint64(vocab_size - 3) + np.uint64(3)).tolist()
    return ids
