"""Qwen3-MoE decoder layer: the Qwen3 block (q/k RMSNorm) with its MLP replaced by routed experts (models/moe.py)."""

from __future__ import annotations

from jaxtyping import Array, Float
from pulseinfer_jax.models.moe import MoEFeedForward, MoEOptions
from pulseinfer_jax.models.qwen3 import Qwen3DecoderLayer
from pulseinfer_jax.pallas_kernels.common import matmul_precision


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    moe_options: MoEOptions = MoEOptions()  # how the experts compute (models/moe.py)

    def setup_mlp(self) -> None:
        c = self.cfg
        self.moe = MoEFeedForward(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                                  self.dtype, matmul_precision(self.dtype), self.moe_options)

    def mlp(self, h: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        return self.moe(h)
