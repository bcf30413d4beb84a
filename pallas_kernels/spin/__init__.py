"""SPIN's GPU kernels: A1's max-pooled block scores, block selection + compaction, and the
EMA update in place (block states; slot states V, D for A0/A1) over the selected blocks only."""
from pallas_kernels.spin.config import SpinKernelConfig
from pallas_kernels.spin.gpu import block_scores_max_gpu, select_compact_gpu, update_states_gpu

__all__ = ["SpinKernelConfig", "block_scores_max_gpu", "select_compact_gpu", "update_states_gpu"]
