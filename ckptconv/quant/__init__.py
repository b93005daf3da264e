"""Quantized weight formats: block FP8 (DeepSeek-V3 / transformers "fp8") and MXFP4 (gpt-oss).

The math lives here, pure (tensors in, tensors out); see docs/notes/quantized-formats.md for the references
each function is bit-identical to.
"""
