"""Kernels of quantized linear layers: activation quantization and the FP8, INT8 and W4A16 GEMMs."""
