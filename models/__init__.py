"""Flax decoder models (Llama family, Qwen3) and checkpoint loading (HF safetensors, GGUF, random presets)."""
