"""The kernels' algorithm in PyTorch: flash_ref.py (the executable specification the tests hold
the kernels to) and flash_steps.py (the derivation step by step, each step checked)."""
