"""The FlashAttention kernels for Hopper (sm_90) in Gluon, FlashAttention-3's structure: fwd.py,
bwd.py and the backward's two Triton passes around it (bwd_passes.py), the tile ranges and mask
they share (blocks.py), what their warp-specialized partitions share and how they hand off
(pipeline.py), their table (config.py), and sm90.py, which compiles them for an H100 on a machine
without one. config.py and bwd_passes.py import with any Triton; the others need its Gluon."""
