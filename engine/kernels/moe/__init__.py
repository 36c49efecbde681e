"""Mixture-of-experts kernels: routing, few-row experts and grouped experts for longer batches."""
