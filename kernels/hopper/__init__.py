"""The FlashAttention kernels for Hopper (sm_90) in Gluon, FlashAttention-3's structure: fwd.py,
bwd.py, the backward's deterministic dQ (bwd_dq.py) and its two Triton passes around it
(bwd_passes.py); the tile scheduler (schedule.py), the softmax (softmax.py), the tile ranges and
mask (blocks.py), the buffers, barriers and handshakes of the warp-specialized partitions
(pipeline.py) and their table (config.py); scripts/sm90.py compiles them for an H100 on a machine
without one. config.py and bwd_passes.py need no Gluon; the others need triton 3.6's."""
