"""SPIN's predicted block scores (the per-step prediction pass over V and D)."""
from pallas_kernels.spin_predict.gpu import POOLINGS, block_scores_gpu

__all__ = ["POOLINGS", "block_scores_gpu"]
