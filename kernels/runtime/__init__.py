"""What launches the kernels: launch.py (one launch layer for both dialects), interpreter.py (CPU
tensors through Triton's interpreter), chips.py (what a GPU reports)."""
