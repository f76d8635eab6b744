"""Lazy name -> numpy array over one or many safetensors files, bfloat16 and float8 included.

`safetensors`' numpy reader rejects bfloat16 ("data type 'bfloat16' not understood"), the dtype most released
checkpoints (Llama 3.x, Qwen3) are stored in. The files are validated by `safetensors.safe_open` (header, offsets)
and each tensor is then a zero-copy view of a read-only memory map, typed with `ml_dtypes` where numpy has no
such dtype. Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the data (offsets relative to its start).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from pulseinfer_jax.models.weights import CheckpointError

DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsDir(Mapping[str, Any]):
    """name -> np.ndarray (read on access, a view of the mapped file) over `files`."""

    def __init__(self, files: list[pathlib.Path]):
        from safetensors import SafetensorError, safe_open

        # name -> (the file, its map: pages are read only when touched; where its data starts; the header entry)
        self._where: dict[str, tuple[pathlib.Path, np.memmap, int, dict]] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"weight file {f} is listed but missing (incomplete download?)")
            try:
                safe_open(str(f), framework="numpy")  # validates the header and the offsets
            except SafetensorError as e:
                raise CheckpointError(f"{f} is not a readable safetensors file (truncated or corrupt?): {e}") from None
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            mapped = np.memmap(f, np.uint8, mode="r")
            for name, info in header.items():
                self._where[name] = (f, mapped, 8 + n, info)

    def __getitem__(self, name: str) -> np.ndarray:
        f, mapped, start, info = self._where[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{f}: tensor {name!r} has dtype {info['dtype']}, which the loader does not "
                                  f"read (supported: {', '.join(DTYPES)})")
        begin, end = info["data_offsets"]
        return mapped[start + begin:start + end].view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
