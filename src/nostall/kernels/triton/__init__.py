"""Triton GPU kernels, one per file, each the twin of a pure-torch truth in kernels/ref.

Importing these modules defines `triton.jit` functions: set TRITON_INTERPRET=1 before the first
import to run them on CPU tensors through Triton's interpreter (tests on machines without a GPU).
"""
