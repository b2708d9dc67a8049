"""mlxinfer: local LLM chat, bench and convert on MLX."""

__version__ = "0.1.0"
