"""Triton kernels and their torch reference twins. Deliberately no `__version__`: transformers probes for
Hugging Face's own `kernels` package by this import name (tests/test_packaging.py checks it is not fooled)."""
