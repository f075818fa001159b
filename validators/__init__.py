"""What may be accepted: numerics against the baseline, kernels against their torch reference,
static safety of candidate sources, and speedup statistics with calibrated noise floors."""
