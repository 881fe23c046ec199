"""Hydra configs: YAML presets per group, validated by the dataclasses in configs/schema.py."""
