"""The decoder's forward pass over a paged KV cache (Llama / Mistral / Qwen2 family).

Shapes: T tokens of one prompt, B sequences in a decode batch, H hidden size, nh / nkv query / kv
heads, hd head dim, bs block size, MB blocks per sequence (padded), L = MB * bs.
The cache is the block pool's typed view [num_blocks, layers, 2, bs, nkv, hd].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.engine import blockcode, fp32kernel, kernel
from disagg.engine.checkpoint import ModelConfig
from disagg.engine.fusion import PLAIN, Pointwise, rms_norm
from disagg.engine.paged import PagedAttention
from disagg.engine.projection import Projection
from disagg.engine.rope import RotaryTable


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor  # [H]
    qkv: Projection  # H -> (nh + 2 nkv) hd: q, k, v projections stacked, one matmul
    o: Projection  # nh hd -> H
    ln_mlp: torch.Tensor  # [H]
    gate_up: Projection  # H -> 2 I: gate and up projections stacked
    down: Projection  # I -> H


@dataclass(frozen=True)
class DecodeRows:
    """The decode batch of one step: tokens and positions [B], block table [B, MB]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens [T] at positions start.. of a sequence whose blocks are ``blocks`` [MB];
    ``logits``: return its last token's logits (the chunk completes the prompt)."""

    tokens: torch.Tensor
    start: int
    blocks: torch.Tensor
    logits: bool


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)  # type: ignore[arg-type]


class Transformer:
    """Weights plus the forward pass the engine needs: prompt chunks and a decode batch in one step.

    ``native``: in bf16 on a CPU with AVX-512-BF16, the engine's own kernels (``disagg.engine.kernel``)
    for the projections and the paged decode attention; in fp32 with AVX2, the fp32 kernels
    (``disagg.engine.fp32kernel``) for the projections and the work between them, and the
    block-code kernel (``disagg.engine.blockcode``) for the decode rows of block-coded weights.
    ``pack``: elsewhere in bf16 on CPU, prepack the projections' weights for oneDNN (see
    ``disagg.engine.projection``): the same bits, faster."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        pack: bool = True,
        native: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the cache's; keys and values are rounded to it when written

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def b(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        # a bf16 pool on AVX-512-BF16 finds block codes in the checkpoint's fp32 values (see Projection)
        on_cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        codes = native and on_cpu_bf16 and blockcode.bf16_gemm() is not None

        def proj(names: list[str]) -> Projection:
            weight = torch.cat([w(name + ".weight") for name in names])
            stored = [weights[name + ".weight"] for name in names]
            source = torch.cat(stored) if codes and all(t.dtype == torch.float32 for t in stored) else None
            bias = _cat([b(name + ".bias") for name in names])
            return Projection(weight, bias, pack, native, source=source)

        self.embed = w("model.embed_tokens.weight")  # [V, H]
        self.norm = w("model.norm.weight")
        # a tied head lays out a copy of the embedding table (the lookup needs the plain one)
        head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        # logits unrounded (no false ties), and through the kernel for every row, AMX or not: a prompt
        # asks the head for its last row only
        self.lm_head = Projection(head, None, pack, native, wide=True, split=False)
        self.layers: list[LayerWeights] = []
        for n in range(cfg.num_layers):
            a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
            self.layers.append(
                LayerWeights(
                    ln_attn=w(f"model.layers.{n}.input_layernorm.weight"),
                    qkv=proj([a + "q_proj", a + "k_proj", a + "v_proj"]),
                    o=proj([a + "o_proj"]),
                    ln_mlp=w(f"model.layers.{n}.post_attention_layernorm.weight"),
                    gate_up=proj([m + "gate_proj", m + "up_proj"]),
                    down=proj([m + "down_proj"]),
                )
            )
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, cfg.max_context, dtype)
        self.rotary.cos, self.rotary.sin = self.rotary.cos.to(device), self.rotary.sin.to(device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        fits = kernel.attention_covers(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        bf16_cache = self.kv_dtype == torch.bfloat16  # the attention kernels read a bf16 cache
        # the decode rows' attention in one call over the paged cache, or None (grouped PyTorch path)
        self.paged = kernel.decode_attention() if native and on_cpu_bf16 and bf16_cache and fits else None
        # a prompt chunk's attention over the paged cache, or None (PyTorch's SDPA)
        self.prompt = kernel.prompt_attention() if self.paged is not None else None
        # the pointwise work between projections in one pass each, or None (PyTorch operations)
        kernels = native and on_cpu_bf16
        self.norm_kernel = kernel.rms_norm() if kernels and cfg.hidden_size % 16 == 0 else None
        self.act_kernel = kernel.silu_mul() if kernels and cfg.intermediate_size % 16 == 0 else None
        # rotary embedding and the cache writes in one pass, or None (PyTorch operations); with the
        # attention kernels only, which read the new keys and values from the cache
        fused = self.prompt is not None and cfg.head_dim % 32 == 0
        self.rope_kernel = kernel.rope_cache() if fused else None
        # fp32 with the engine's kernels (AVX2): the work between projections in one call each, where
        # PyTorch's per-operation cost is a large part of a decode step (disagg.engine.fp32kernel);
        # prompt rows read their keys and values back from the cache, exactly as written
        fp32_cache = dtype == torch.float32 and self.kv_dtype == torch.float32
        if native and device.type == "cpu" and fp32_cache and cfg.head_dim % 8 == 0:
            self.norm_kernel = fp32kernel.rms_norm()
            self.paged = fp32kernel.decode_attention()
            self.rope_kernel = fp32kernel.rope_cache() if self.paged is not None else None

    @property
    def paged_attention(self) -> bool:
        return self.paged is not None

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel is not None:
            return self.norm_kernel(x, weight, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _qkv(
        self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, decode_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        qkv = layer.qkv(self._rms_norm(x, layer.ln_attn), decode_rows)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary.apply(q.view(-1, cfg.num_heads, cfg.head_dim), positions)  # [T, nh, hd]
        k = self.rotary.apply(k.view(-1, cfg.num_kv_heads, cfg.head_dim), positions)  # [T, nkv, hd]
        return q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim)

    def _finish_layer(
        self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, decode_rows: int
    ) -> torch.Tensor:
        x = x + layer.o(attn, decode_rows)
        gate_up = layer.gate_up(self._rms_norm(x, layer.ln_mlp), decode_rows)
        if self.act_kernel is not None:
            return x + layer.down(self.act_kernel(gate_up), decode_rows)
        gate, up = gate_up.chunk(2, -1)
        return x + layer.down(F.silu(gate) * up, decode_rows)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms_norm(x, self.norm)).float()

    @torch.inference_mode()
    def step(
        self, decode: DecodeRows | None, chunks: list[PromptChunk], cache: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """One forward pass over a decode batch's rows and prompt chunks' rows together: every weight
        is read once for all of them. A decode row writes its new KV at the slot of its position and
        attends to positions 0..position of its own blocks: in bf16 on CPU through the paged-attention
        kernel, every row in one call reading only its own blocks; otherwise per group of sequences
        of similar length (block counts within a factor of 4), so a short sequence never pays for the
        padding of the longest one in the batch. Attention runs per part (the decode rows over their
        blocks, each chunk over its sequence's cached positions and itself: in bf16 on CPU through the
        prompt-attention kernel, reading the cache, else SDPA). Returns the decode rows'
        logits [B, V] (None without a batch) and, per chunk, its last token's logits [V] (None unless
        asked)."""
        bs = cache.shape[3]
        dev = cache.device
        tokens, positions, slot_blocks, parts = [], [], [], []
        if decode is not None:
            tokens.append(decode.tokens)
            positions.append(decode.positions)
            slot_blocks.append(decode.block_table.gather(1, (decode.positions // bs)[:, None])[:, 0])
            if self.paged is not None:  # the kernel's view of the batch, once for every layer
                group = self.cfg.num_heads // self.cfg.num_kv_heads
                plan = kernel.decode_plan(decode.block_table, decode.positions, group)
                how: object = (decode.block_table, decode.positions, plan)
            else:
                how = self._length_groups(decode.positions, decode.block_table, bs)
            parts.append(("decode", decode.tokens.shape[0], how))
        for chunk in chunks:
            count = chunk.tokens.shape[0]
            pos = torch.arange(chunk.start, chunk.start + count, device=dev)
            tokens.append(chunk.tokens)
            positions.append(pos)
            slot_blocks.append(chunk.blocks[pos // bs])
            if self.prompt is not None:
                parts.append(("prompt", count, (chunk.blocks, chunk.start)))
                continue
            span = chunk.start + count
            table = chunk.blocks[: -(-span // bs)]
            mask = (
                torch.arange(span, device=dev)[None, :] <= pos[:, None] if chunk.start else None
            )  # [T, span]
            parts.append(("chunk", count, (chunk.start, span, table, mask)))
        token_ids, position_ids, slot_block = (_joined(t) for t in (tokens, positions, slot_blocks))
        slot_offset = position_ids % bs
        x = self.embed[token_ids]  # [N, H]
        # the leading rows are the decode batch's: a projection may send prompt rows elsewhere
        decode_rows = 0 if decode is None else decode.tokens.shape[0]
        if self.rope_kernel is not None:  # the kernel's indices, once per step
            position_ids, slot_block, slot_offset = (
                t.to(torch.int64).contiguous() for t in (position_ids, slot_block, slot_offset)
            )
        for n, layer in enumerate(self.layers):
            if self.rope_kernel is not None:  # k and v go straight into the cache, read from there
                qkv = layer.qkv(self._rms_norm(x, layer.ln_attn), decode_rows)
                rotary = (self.rotary.cos, self.rotary.sin, self.cfg.num_heads, self.cfg.num_kv_heads)
                q = self.rope_kernel(qkv, cache, n, position_ids, slot_block, slot_offset, *rotary)
                k = v = None
            else:
                q, k, v = self._qkv(layer, x, position_ids, decode_rows)
                if self.kv_dtype != self.dtype:  # a prompt attends to the KV as cached, as decode will
                    k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
                cache[slot_block, n, 0, slot_offset] = k
                cache[slot_block, n, 1, slot_offset] = v
                if self.kv_dtype != self.dtype:
                    k, v = k.to(self.dtype), v.to(self.dtype)
            outs, row = [], 0
            for kind, count, how in parts:
                rows = slice(row, row + count)
                if kind == "decode" and self.paged is not None:
                    outs.append(self.paged(q[rows], cache, n, *how))
                elif kind == "decode":
                    outs.append(self._attend_batch(q[rows], cache, n, how))
                elif kind == "prompt":
                    outs.append(self.prompt(q[rows], cache, n, *how))
                else:
                    k_rows, v_rows = (None, None) if k is None else (k[rows], v[rows])
                    outs.append(self._attend_chunk(q[rows], k_rows, v_rows, cache, n, *how))
                row += count
            x = self._finish_layer(layer, x, _joined(outs).reshape(-1, self.q_size), decode_rows)
        decode_logits = None
        row = 0
        if decode is not None:
            row = decode.tokens.shape[0]
            decode_logits = self._logits(x[:row])
        chunk_logits: list[torch.Tensor | None] = []
        for chunk in chunks:
            row += chunk.tokens.shape[0]
            chunk_logits.append(self._logits(x[row - 1 : row])[0] if chunk.logits else None)
        return decode_logits, chunk_logits

    @torch.inference_mode()
    def decode_static(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        cache: torch.Tensor,
        attention: PagedAttention,
        pointwise: Pointwise = PLAIN,
    ) -> torch.Tensor:
        """A decode batch's step with static shapes and no host read, for capture as a CUDA graph
        (``disagg.engine.replay``): tokens, positions, seq_lens [B] and block_table [B, MB] on the
        cache's device -> logits [B, V] float32. Each row writes its new KV at the slot of its
        position in its own blocks and attends through ``attention`` (``disagg.engine.paged``) to
        positions 0..seq_len-1. The pointwise work is ``pointwise``'s (``disagg.engine.fusion``:
        plain torch, or compiled into fused kernels), never the CPU kernels: on CPU it is checked
        against ``step``, on a GPU it is what a graph replays."""
        cfg, bs, eps = self.cfg, cache.shape[3], self.cfg.rms_norm_eps
        slot_block = block_table.gather(1, (positions // bs)[:, None])[:, 0]  # [B]
        slot_offset = positions % bs
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]  # [B, hd]
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        layers = self.layers
        x, h = pointwise.norm(self.embed[tokens], None, layers[0].ln_attn, eps)  # [B, H]
        for n, layer in enumerate(layers):
            q = pointwise.rotary_write(layer.qkv(h), cos, sin, cache, n, slot_block, slot_offset, heads)
            attn = attention(q, cache, n, block_table, seq_lens)  # [B, nh, hd]
            x, h = pointwise.norm(x, layer.o(attn.reshape(-1, self.q_size)), layer.ln_mlp, eps)
            after = layers[n + 1].ln_attn if n + 1 < len(layers) else self.norm  # the next norm
            x, h = pointwise.norm(x, layer.down(pointwise.silu_mul(layer.gate_up(h))), after, eps)
        return self.lm_head(h).float()

    def _attend_batch(self, q: torch.Tensor, cache: torch.Tensor, layer: int, groups: list) -> torch.Tensor:
        """Decode rows q [B, nh, hd] over their sequences' blocks, per length group."""
        if len(groups) == 1:
            return self._attend(q, cache, layer, *groups[0][1:])
        attn = torch.empty_like(q)
        for rows, *group in groups:
            attn[rows] = self._attend(q[rows], cache, layer, *group)
        return attn

    def _attend_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache: torch.Tensor,
        layer: int,
        start: int,
        span: int,
        table: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A prompt chunk's rows q [T, nh, hd]: causal over itself, and over the positions already
        cached when it is not the first chunk (its KV is in the cache by now) -> [T, nh, hd]. ``k`` and
        ``v`` None: the chunk's own are in the cache too (written there by the rotary kernel)."""
        if start or k is None:  # the earlier chunks' KV comes from the cache: [span] positions
            k = cache[:, layer, 0].index_select(0, table).flatten(0, 1)[:span].to(q.dtype)  # [span, nkv, hd]
            v = cache[:, layer, 1].index_select(0, table).flatten(0, 1)[:span].to(q.dtype)
        # 4-D inputs: the CPU backend runs its fused kernel only for [batch, heads, T, hd].
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )[0]  # [nh, T, hd]
        return attn.transpose(0, 1)

    @staticmethod
    def _length_groups(
        positions: torch.Tensor, block_table: torch.Tensor, bs: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]:
        """(rows, flat block ids [b * width], span, bias [b, 1, 1, span]) per group of sequences: the
        bias is 0 where a row attends and -inf past its position, in float32."""
        max_blocks = block_table.shape[1]
        by_width: dict[int, list[int]] = {}
        for row, position in enumerate(positions.tolist()):
            width = 1
            while width * bs <= position:
                width *= 4
            by_width.setdefault(min(width, max_blocks), []).append(row)
        groups = []
        for width, rows in by_width.items():
            index = torch.tensor(rows, device=positions.device)
            span = width * bs
            past = torch.arange(span, device=positions.device)[None, :] > positions[index][:, None]
            bias = torch.zeros(past.shape, device=positions.device).masked_fill_(past, float("-inf"))
            table = block_table[index, :width].reshape(-1)
            groups.append((index, table, span, bias[:, None, None, :]))
        return groups

    def _attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        table: torch.Tensor,
        span: int,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """q [b, nh, hd] over the cached KV of its sequences' blocks -> [b, nh, hd].

        In bf16 / fp16: two batched matmuls, each kv head's query group as a [g, hd] matrix, with the
        scores and softmax in float32 (bf16 scores lost 10x the accuracy of the fused kernel on
        peaked attention). For one query row the CPU's fused SDPA kernel was 2x (batch 1, 112
        positions) to 8x (batch 32, 256 positions) slower than this in bf16 on this machine class.
        In fp32 the fused kernel is as fast (and twice as fast at batch 32 over these strided
        views), and fp32 is the reference: it keeps SDPA."""
        batch, kv_heads, head_dim = q.shape[0], self.cfg.num_kv_heads, self.cfg.head_dim
        # [b * width, bs, nkv, hd] -> [b, nkv, span, hd]
        keys = cache[:, layer, 0].index_select(0, table).view(batch, span, kv_heads, -1).transpose(1, 2)
        values = cache[:, layer, 1].index_select(0, table).view(batch, span, kv_heads, -1).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-ops unless kv_dtype differs
        if q.dtype == torch.float32:
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, values, attn_mask=bias, enable_gqa=True
            )
            return out[:, :, 0]
        grouped = q.view(batch, kv_heads, -1, head_dim).float()  # [b, nkv, g, hd]
        scores = torch.matmul(grouped, keys.float().transpose(-1, -2)) * head_dim**-0.5 + bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [b, nkv, g, span]
        return torch.matmul(probs, values).view(batch, -1, head_dim)
