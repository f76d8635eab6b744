"""Qwen3 decoder layer: the Llama block plus per-head RMSNorm on q and k (before RoPE), explicit head_dim."""

from __future__ import annotations

from jaxtyping import Array
from pulseinfer_jax.models.llama import DecoderLayer, RMSNorm


class Qwen3DecoderLayer(DecoderLayer):
    def setup_qk_norm(self) -> None:
        self.q_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)
        self.k_norm = RMSNorm(self.cfg.rms_norm_eps, self.dtype)

    def qk_norm(self, q: Array, k: Array) -> tuple[Array, Array]:
        return self.q_norm(q), self.k_norm(k)
