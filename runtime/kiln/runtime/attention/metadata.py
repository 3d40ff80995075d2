"""What the attention layers need to know about one step's batch, built by the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout (a mixed batch: prefill chunks and decodes together).

    Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` of the
    flattened ``[num_tokens, ...]`` activations.  Its K/V for the new tokens are written to
    the cache through ``slot_mapping`` before attention reads them back through
    ``block_tables``.
    """

    # int64 [num_tokens]: flat KV-pool index (block_id * block_size + offset) per new token;
    # -1 marks padding tokens whose K/V must not be written.
    slot_mapping: torch.Tensor
    # int32 [num_seqs, max_blocks_per_seq]: block ids per sequence (block table), padded.
    block_tables: torch.Tensor
    # int32 [num_seqs]: context length per sequence INCLUDING this step's new tokens.
    seq_lens: torch.Tensor
    # int32 [num_seqs + 1]: prefix sums of the number of new (query) tokens per sequence.
    query_start_loc: torch.Tensor
    # Largest number of query tokens of one sequence in this batch (1 for pure decode).
    max_query_len: int
    # Largest context length of one sequence in this batch (tokens).
    max_seq_len: int
    # Host copies of seq_lens / query lengths (the torch backend plans with them).
    seq_lens_list: list[int]
    query_lens_list: list[int]
    # Tokens per KV block.
    block_size: int
    # Mixed batches: the first ``num_decodes`` sequences have exactly one query token (the
    # model runner orders decodes first) and run through the decode kernel, the rest
    # through the prefill kernel with ``prefill_query_start_loc`` (int32 [num_seqs -
    # num_decodes + 1], query_start_loc[num_decodes:] - num_decodes).  0: one launch.
    num_decodes: int = 0
    prefill_query_start_loc: torch.Tensor | None = None
    # Largest context among the decode sequences (tokens; sizes the decode split-K).
    max_decode_seq_len: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
