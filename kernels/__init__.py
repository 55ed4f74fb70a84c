"""Triton kernels and their torch reference twins. Deliberately no `__version__`: transformers probes for
Hugging Face's own `kernels` package by this import name (tests/test_packaging.py checks it is not fooled).

- `w12.py`: the lossless 12-bit bf16 weight format (pack/unpack, escape table, the torch reference,
  `W12Linear`); needs only torch.
- `w12_triton.py`: its fused unpack-and-multiply kernel for 1-64 rows; imported only when used.
"""
