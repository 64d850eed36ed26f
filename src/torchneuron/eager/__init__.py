"""Eager execution: schema-driven kernels, the executable cache, CPU fallback, adaptive mode."""
