"""The engine settings shared by test_draft_catch_up_buffers.py and its interpreted child: input buffers small
enough (max_num_batched_tokens 8 + 2 requests x (k 2 + 2) = 16 tokens) that a draft which sat out a dozen steps
catches up on more than they hold."""

ENGINE_KW = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=8,
                 max_model_len=64, num_speculative_tokens=2, rejection_sampling="strict", small_m_rows=1)
