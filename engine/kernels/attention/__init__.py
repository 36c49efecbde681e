"""Attention's kernels: paged and tree attention, their launch arguments, the KV store and its fused prologue."""
