"""SPIN's GPU kernels: block selection + compaction, and the EMA updates in place (slot
states V, D for A0/A1; block states for A2) over the selected blocks only."""
from pallas_kernels.spin.gpu import select_compact_gpu, update_block_states_gpu, update_vd_gpu

__all__ = ["select_compact_gpu", "update_block_states_gpu", "update_vd_gpu"]
