"""The GPT model and the attention swap point it calls through."""

from model.attention import ATTENTIONS, get_attention
from model.gpt import GPT

__all__ = ["ATTENTIONS", "GPT", "get_attention"]
