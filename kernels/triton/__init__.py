"""The portable FlashAttention-2 kernels in Triton, for any GPU Triton compiles for and for the CPU
through its interpreter: fwd.py, bwd.py, the tile ranges and mask they share (blocks.py), and
their tile table (config.py)."""
