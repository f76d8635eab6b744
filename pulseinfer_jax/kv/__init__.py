"""The KV cache's formats, at the bottom of the package: the paged cache's layout (cache.py), block allocators and
bucketing (blocks.py), the float8 storage format (quant.py). Imports nothing else of the package."""
