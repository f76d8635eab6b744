"""Several devices: tensor parallelism over a `tp` mesh axis (layout.py, weights.py, kernels.py) and several hosts
(distributed.py)."""
