"""Pallas kernels (sparse paged decode attention, block scoring/top-k, gather/scatter, MoE grouped matmul), each
beside its jnp reference. Engines pick the Pallas or jnp version per platform (EngineConfig.decode_attention,
EngineConfig.moe_strategy)."""
