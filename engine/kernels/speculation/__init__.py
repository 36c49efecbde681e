"""Speculation's kernels: rejection sampling, greedy argmax, the draft loop's input rebuild, the verify's ids gate."""
