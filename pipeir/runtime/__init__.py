"""Runtime: executes lowered per-rank programs on torch.distributed (imports torch)."""
