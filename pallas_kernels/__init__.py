"""Pallas kernels (sparse paged decode attention, block scoring/top-k, gather/scatter), each beside its jnp
reference. The dense engine currently runs the jnp attention in `pulseinfer_jax.attention`."""
