"""SPIN: shadow predictive indexer for decode (shared/papers/spin-shadow-predictive-indexer.txt).

Per request and layer SPIN keeps
  V [N_cap]  an EMA of observed indexer scores by absolute slot     (vertical pattern, sec. 3.2)
  D [N_cap]  an EMA of observed scores by relative offset q_t - i   (diagonal pattern)
  VM [B_cap] the max of V over each block (kept by every update; read by A1's GPU block scores)
  VB, DB [B_cap] block-level EMAs (reduction A2)
  age [B_cap] the step at which each block was last scored            (block-age exploration)
and predicts slot scores `max(V[i], D[q_t - i])`, pools them per block, and scores only the
m_t best blocks (Algorithm 1), plus the sink block, the newest block and a few explored blocks
(sec. 3.2.1). Speculative decoding (sec. 3.2.2): one mask per verifier row, union or row-0
sharing; EMA updates deferred until acceptance is known, then replayed for rows 0..a (prefix)
or row 0 only.

Modules: `config` (SpinConfig), `algorithm` (pure functions over the state pytree), `kernels`
(dispatch to the Pallas kernels in `pallas_kernels.spin`), `serving` (the batched decode step
over a paged cache, speculative rows and commit), `studies` (trace replay, predictor study).
Everything is jit-compiled for a fixed capacity (`N_cap` slots): lengths are data, so a growing
context never recompiles.
"""
from jaxsparse.spin.algorithm import (block_scores, compact_blocks, init_state, num_blocks_budget,
                                      predicted_slot_scores, realized_sparsity, request_seeds,
                                      query_priorities, reset, select_blocks,
                                      select_blocks_batched, select_rows,
                                      top_mask, update, update_block_states, update_blocks,
                                      update_dense, update_rows)
from jaxsparse.spin.config import STATE_DTYPES, SpinConfig
from jaxsparse.spin.kernels import select_compact_batched, update_batched
from jaxsparse.spin.serving import commit, decode_step, decode_step_rows, max_selected_blocks
from jaxsparse.spin.studies import predictor_study, replay

__all__ = [
    "SpinConfig", "STATE_DTYPES", "init_state", "reset",
    "num_blocks_budget", "predicted_slot_scores", "block_scores", "top_mask", "request_seeds",
    "select_blocks", "select_blocks_batched", "select_rows", "query_priorities", "compact_blocks",
    "update", "update_dense", "update_blocks", "update_block_states", "update_rows",
    "realized_sparsity",
    "select_compact_batched", "update_batched",
    "decode_step", "decode_step_rows", "commit", "max_selected_blocks",
    "replay", "predictor_study",
]
