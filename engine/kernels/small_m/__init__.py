"""Few-row products (decode, verify, the draft's steps): the split-K linear kernel, its tiles and fusions."""
