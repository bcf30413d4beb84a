"""SPIN's GPU kernels: the EMA update of the slot states V and D, in place, over the selected
blocks only; the block scores (max pooling) from V and D in one vectorised pass."""
from pallas_kernels.spin_update.gpu import predict_blocks_gpu, update_vd_gpu

__all__ = ["predict_blocks_gpu", "update_vd_gpu"]
