"""The GPT model and the attention swap point it calls through."""

from model.attention import ATTENTIONS, Attention, get_attention
from model.gpt import GPT

__all__ = ["ATTENTIONS", "GPT", "Attention", "get_attention"]
