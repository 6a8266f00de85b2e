"""Inference: the numpy MoE engine, the expert slot cache, prefetch, telemetry,
sessions and quantized kernels. It reaches bytes only through ``store``."""
