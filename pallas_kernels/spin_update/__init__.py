"""SPIN's EMA update of the slot states V and D, in place, over the selected blocks only."""
from pallas_kernels.spin_update.gpu import update_vd_gpu

__all__ = ["update_vd_gpu"]
