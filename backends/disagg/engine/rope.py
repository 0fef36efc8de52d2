"""Rotary position embedding tables ("default" and "llama3" frequency schedules)."""

from __future__ import annotations

import math

import torch

from disagg.engine.checkpoint import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of the rotary embedding."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_schedule(inv_freq, rope)
    return inv_freq


def _llama3_schedule(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 long-context schedule: wavelengths longer than the original context / low_freq_factor
    # are stretched by `factor`, shorter than context / high_freq_factor kept, and the band between
    # interpolated linearly in (context / wavelength).
    context = rope.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_wave = context / rope.low_freq_factor
    short_wave = context / rope.high_freq_factor
    scaled = torch.where(wavelength > long_wave, inv_freq / rope.factor, inv_freq)
    weight = (context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - weight) * scaled / rope.factor + weight * scaled
    between = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(between, blended, scaled)


class RotaryTable:
    """cos / sin for every position up to ``max_positions``, computed once in float32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, hd] at positions [T] (rotate-half convention)."""
        return rotate(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd] rotated by ``cos`` / ``sin`` (broadcast to it), rotate-half convention."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
