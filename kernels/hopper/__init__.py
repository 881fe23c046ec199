"""The FlashAttention kernels for Hopper (sm_90) in Gluon, FlashAttention-3's structure: fwd.py,
bwd.py, the tile ranges and mask they share (blocks.py), what their warp-specialized partitions
share and how they hand off (pipeline.py), and their table (config.py, the only one importable
without triton 3.6)."""
