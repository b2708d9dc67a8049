"""mlxinfer: local LLM chat, bench and convert on MLX.

The Python API the CLI is a thin shell over::

    import mlxinfer
    m = mlxinfer.load("smollm2")                      # alias, org/name[@rev], MLX dir or .gguf
    for r in mlxinfer.stream_generate(m, "Once upon a time"):  # text is continued as is (no chat template)
        print(r.text, end="")                                     # Response(text, token, stats, finish_reason)
    mlxinfer.generate(m, mlxinfer.chat_prompt(m, [{"role": "user", "content": "Hi"}]))  # an assistant's reply
    chat = mlxinfer.Session(m)                       # a conversation, the KV cache kept across turns
    print("".join(r.text for r in chat.send("What is the capital of France?")))

Attributes are imported lazily so that ``mlxinfer --help`` does not pay for importing MLX and mlx-lm.
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = {
    "load": "mlxinfer.engine.loader",
    "LoadedModel": "mlxinfer.engine.loader",
    "stream_generate": "mlxinfer.engine.generate",
    "generate": "mlxinfer.engine.generate",
    "chat_prompt": "mlxinfer.engine.prompts",
    "Response": "mlxinfer.engine.generate",
    "GenerationStats": "mlxinfer.engine.generate",
    "SamplingParams": "mlxinfer.engine.sampling",
    "Session": "mlxinfer.engine.session",
    "Registry": "mlxinfer.registry",
    "MlxinferError": "mlxinfer.errors",
    "InvalidParameter": "mlxinfer.errors",
    "SessionError": "mlxinfer.engine.session",
}
__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mlxinfer' has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too, before they are first used
    return sorted(set(globals()) | set(__all__))
