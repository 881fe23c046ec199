"""What launches the kernels: launch.py (one launch layer for both dialects), internals.py (every
use of Triton's internals: CPU tensors through its interpreter, the direct launch, the sm_90
stand-in), chips.py (what a GPU reports)."""
