"""SPIN's GPU kernels: block selection + compaction, and the EMA update in place (block states;
slot states V, D for A0/A1) over the selected blocks only."""
from pallas_kernels.spin.gpu import select_compact_gpu, update_states_gpu

__all__ = ["select_compact_gpu", "update_states_gpu"]
