"""Running the model over the paged cache: dense prefill and decode steps (dense.py, with paged_attention.py), the
sparse decode driver (sparse_decoder.py) and its per-layer jitted calls (sparse_layer.py) with their typed inputs
(sparse_inputs.py), the layer-segmented prefill of offloaded prompts (offloaded_prefill.py), sampling (sampling.py)."""
