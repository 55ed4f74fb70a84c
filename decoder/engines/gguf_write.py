"""Writing a GGUF's tensors once its key-values are set: one sequence shared by every GGUF the project writes
(the dequantised SmolLM2 target, the SmolLM2 drafter). `gguf` itself stays an optional import of the callers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def write_tensors(writer: Any, tensors: Sequence[tuple[str, Any, Any]]) -> None:
    """Write (name, numpy data, GGML type) tensors, then the header, key-values and tensor infos, and close.
    uint8 data is read as bytes of its type; the writer derives the shape."""
    for name, data, tt in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, tt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, data, _tt in tensors:
        writer.write_tensor_data(data)
    writer.close()
