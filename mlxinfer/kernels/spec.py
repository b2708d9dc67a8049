"""What a decoder layer computes, as data: :class:`LayerSpec`, built from an mlx-lm block by a table keyed by class.

The native one-op layer (``decoder_layer`` in cpu_kernels/src/layer.cpp) runs whatever a LayerSpec describes:

  a = attn(norm_a(x) | x),  h = x + (norm_ao(a) | a),  m = mlp(norm_m(h) | h),  y = h + (norm_mo(m) | m)

with the knobs below. Its weights travel BY NAME: :attr:`LayerSpec.weights` lists (slot name, path in the block),
the op resolves the names once (``decoder_layer_plan``) and no position order exists anywhere else.

``BUILDERS`` maps an mlx-lm block class (module, class name; looked up by identity, for the versions in
``eligibility.VALIDATED_MLX_LM``) to the function that reads one block instance into a spec, or gives the one-line
reason it cannot. Each builder reads the maths of that class' code in mlx-lm 0.32 (llama, qwen2, qwen3,
qwen3_moe, gemma3_text, phi3, olmo2, olmo3, ministral3; SmolLM3 and Mistral run llama's classes). What a builder
cannot see (a method changed under the same class) the load-time self-check (``kernels.selfcheck``) catches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.kernels.eligibility import MLP_SWIGLU, has_role, table_key
from mlxinfer.kernels.layers import builtin_class

SILU, GELU_TANH = "silu", "gelu_tanh"
_ACTIVATIONS = (SILU, GELU_TANH)  # their index is the op's activation code


@dataclass(frozen=True)
class RopeSpec:
    dims: int                      # rotated leading dims of each head (partial rotary: < head_dim)
    traditional: bool = False      # interleaved pairs (else halves, "neox")
    base: float = 10000.0          # unused when freqs_path is set
    scale: float = 1.0             # position scale (linear scaling: 1 / factor)
    input_scale: float = 1.0       # Phi-3 SuScaled/LongRoPE, YaRN: the rotated dims are multiplied by this first
    freqs_path: str = ""           # a precomputed periods array in the block (Llama-3, SuScaled, YaRN): its path


@dataclass(frozen=True)
class LayerSpec:
    family: str                    # the mlx-lm module the builder read
    n_heads: int
    n_kv_heads: int
    head_dim: int
    group_size: int                # every projection: affine-quantized with one group size and bits
    bits: int
    weights: tuple                 # ((slot name, dotted path in the block), ...): what the op gets, by name
    norm_eps: float                # every hidden-state RMSNorm of the layer
    norm_placement: str = "pre"    # "pre" (llama), "sandwich" (Gemma: norms after attention and MLP too) or "post"
                                   # (OLMo: only after them); the norms' weights in `weights` say the same
    norm_offset: float = 0.0       # 1.0: the norms multiply by 1 + stored weight (Gemma)
    qk_norm_eps: float = 0.0       # q/k RMSNorms (when their weights are in `weights`)
    qk_norm_whole: bool = False    # the q/k norms span each row's whole projection (OLMo), not each head
    activation: str = SILU         # MLP: act(gate) * up
    rope: Optional[RopeSpec] = None  # None: a NoPE layer
    attn_scale: float = 1.0
    sliding_window: int = 0        # > 0: each query attends to the last sliding_window positions only
    q_row_scale: bool = False      # the block is called with a factor per query row (Ministral 3's attn_scale)

    def names(self) -> tuple:
        return tuple(name for name, _ in self.weights)

    # What the weight names imply (the op reads the same from the names it gets).
    @property
    def fused_qkv(self) -> bool:
        return "qkv.weight" in self.names()

    @property
    def fused_gate_up(self) -> bool:
        return "gate_up.weight" in self.names()

    @property
    def qkv_bias(self) -> bool:
        return "q.bias" in self.names()

    @property
    def qk_norm(self) -> bool:
        return "q_norm" in self.names()

    def config(self) -> dict:
        """The op's numbers, by name (``decoder_layer_plan``'s config)."""
        rope = self.rope or RopeSpec(dims=0)
        return {"group_size": self.group_size, "bits": self.bits, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "rope_dims": rope.dims,
                "traditional": float(rope.traditional), "rope_base": rope.base, "rope_scale": rope.scale,
                "rope_mscale": rope.input_scale, "attn_scale": self.attn_scale, "norm_eps": self.norm_eps,
                "qk_norm_eps": self.qk_norm_eps, "qk_norm_whole": float(self.qk_norm_whole),
                "norm_offset": self.norm_offset,
                "activation": float(_ACTIVATIONS.index(self.activation)), "window": float(self.sliding_window),
                "q_row_scale": float(self.q_row_scale)}


def resolve(block: nn.Module, path: str):
    """The array at dotted ``path`` in ``block`` (module children by key, then a parameter or attribute)."""
    obj = block
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) and part in obj else getattr(obj, part)
    return obj


def owners(block: nn.Module, spec: LayerSpec) -> tuple:
    """((module, key), ...) in the order of ``spec.names()``: the array of each is ``module[key]`` (modules are
    dicts; resolved once, so that a call costs one dict lookup per weight and sees weights updated in place)."""
    out = []
    for _, path in spec.weights:
        mod_path, _, leaf = path.rpartition(".")
        owner = resolve(block, mod_path) if mod_path else block
        if leaf not in owner:
            raise KeyError(path)
        out.append((owner, leaf))
    return tuple(out)


Built = Union[LayerSpec, str]  # a spec, or why not (one line)


# ---- the pieces builders share ----

def _linear(block, path: str, name: str, q: list) -> list:
    lin = resolve(block, path)
    q.append(lin)
    return [(f"{name}.{part}", f"{path}.{part}") for part in ("weight", "scales", "biases")]


def _quant(q: list) -> Optional[str]:
    """Why these linears are not what the op multiplies (affine-quantized, one group size and bits), or None."""
    if not all(isinstance(x, nn.QuantizedLinear) and x.mode == "affine" and x.get("biases") is not None for x in q):
        return "projections are not affine-quantized (the one-op layer multiplies quantized weights only)"
    if len({(x.group_size, x.bits) for x in q}) != 1:
        return "projections mix group sizes or bits"
    return None


# The separate q/k/v/o and gate/up/down projections of most families: (slot name, path in the block).
_SEPARATE = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
             ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))


def _linears(block, paths=_SEPARATE, *, biases: bool = False) -> tuple:
    """(weight slots, the linear modules, why not or None) for the projections at ``paths``; ``biases``: a
    projection may carry a bias (the builder then decides which may)."""
    q: list = []
    weights: list = []
    for name, path in paths:
        weights += _linear(block, path, name, q)
    why = _quant(q)
    if not why and not biases and any("bias" in x for x in q):
        why = "projections with a bias"
    return weights, q, why


def _rope(rope) -> Union[RopeSpec, None, str]:
    """The RopeSpec of an mlx-lm rope module, None for SmolLM3's NoPE, or why not."""
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

    cls = type(rope)
    if builtin_class(cls) is nn.RoPE:
        return RopeSpec(dims=rope.dims, traditional=rope.traditional, base=float(rope.base), scale=float(rope.scale))
    if cls is Llama3RoPE and isinstance(getattr(rope, "_freqs", None), mx.array):
        return RopeSpec(dims=rope.dims, traditional=rope.traditional, freqs_path="self_attn.rope._freqs")
    if cls is SuScaledRoPE and isinstance(getattr(rope, "_freqs", None), mx.array):
        return RopeSpec(dims=rope.dim, input_scale=float(rope._scale), freqs_path="self_attn.rope._freqs")
    if cls is YarnRoPE and isinstance(getattr(rope, "_freqs", None), mx.array):
        # x[..., :dims] *= mscale, then mx.fast.rope with the precomputed periods (scale 1: the callers pass none)
        return RopeSpec(dims=rope.dims, traditional=rope.traditional, input_scale=float(rope.mscale),
                        freqs_path="self_attn.rope._freqs")
    if cls.__name__ == "NoPE" and cls.__module__ == "mlx_lm.models.smollm3":
        return None
    return f"RoPE {cls.__name__} is not one the op computes"


def _rope_slots(rope, weights: list, *, nope: bool = False) -> Union[RopeSpec, None, str]:
    """``_rope(rope)``, its periods array added to ``weights`` when it has one; a NoPE layer (None) only where
    ``nope``, else the reason."""
    spec = _rope(rope)
    if spec is None and not nope:
        return "no RoPE"
    if isinstance(spec, RopeSpec) and spec.freqs_path:
        weights.append(("rope_freqs", spec.freqs_path))
    return spec


def _rms(m, cls=nn.RMSNorm) -> Optional[float]:
    return float(m.eps) if isinstance(m, cls) else None


# ---- builders, one per mlx-lm block class ----

def _prenorm(block, window: int, family: str, *, qk_norm: bool = False) -> Built:
    """llama / qwen2 / qwen3 / qwen3_moe (dense layers): pre-norm, SwiGLU, separate q/k/v (Qwen2 with biases)."""
    attn, mlp = block.self_attn, block.mlp
    if not has_role(mlp, MLP_SWIGLU):
        return "MLP is not the SwiGLU MLP class (e.g. a mixture of experts)"
    linears, q, why = _linears(block, biases=True)
    if why:
        return why
    weights = [("attn_norm", "input_layernorm.weight"), ("mlp_norm", "post_attention_layernorm.weight")] + linears
    with_bias = ["bias" in x for x in q]
    if any(with_bias[3:]) or with_bias[:3] not in ([False] * 3, [True] * 3):
        return "biases on other projections than q/k/v"
    if with_bias[0]:
        weights += [(f"{n}.bias", f"self_attn.{n}_proj.bias") for n in "qkv"]
    eps = {_rms(block.input_layernorm), _rms(block.post_attention_layernorm)}
    if None in eps or len(eps) != 1:
        return "norms are not two RMSNorms with one eps"
    qk_eps = 0.0
    if qk_norm:
        qk = {_rms(attn.q_norm), _rms(attn.k_norm)}
        if None in qk or len(qk) != 1:
            return "q/k norms are not RMSNorms with one eps"
        weights += [("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight")]
        qk_eps = qk.pop()
    head_dim = q[0]["weight"].shape[0] // attn.n_heads
    rope = _rope_slots(attn.rope, weights, nope=True)
    if isinstance(rope, str):
        return rope
    return LayerSpec(family, attn.n_heads, attn.n_kv_heads, head_dim, q[0].group_size, q[0].bits, tuple(weights),
                     eps.pop(), qk_norm_eps=qk_eps, rope=rope, attn_scale=float(attn.scale))


def _gemma3(block, window: int) -> Built:
    """gemma3_text: sandwich norms storing w - 1, q/k norms, GELU-tanh GeGLU, query_pre_attn_scalar, sliding
    layers (``is_sliding``: the model gives them a window mask and a RotatingKVCache of ``sliding_window``)."""
    from mlx_lm.models import gemma3_text

    attn = block.self_attn
    linears, q, why = _linears(block)
    if why:
        return why
    weights = [("attn_norm", "input_layernorm.weight"), ("attn_out_norm", "post_attention_layernorm.weight"),
               ("mlp_norm", "pre_feedforward_layernorm.weight"), ("mlp_out_norm", "post_feedforward_layernorm.weight"),
               ("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight")] + linears
    norms = [block.input_layernorm, block.post_attention_layernorm, block.pre_feedforward_layernorm,
             block.post_feedforward_layernorm, attn.q_norm, attn.k_norm]
    eps = {_rms(n, gemma3_text.RMSNorm) for n in norms}
    if None in eps or len(eps) != 1:
        return "norms are not gemma3's (1 + w) RMSNorms with one eps"
    if type(block.mlp) is not gemma3_text.MLP:
        return "MLP is not gemma3's GeGLU MLP class"
    rope = _rope_slots(attn.rope, weights)
    if isinstance(rope, str):
        return rope
    if not attn.is_sliding:
        window = 0
    elif window <= 0:
        return "sliding layer without a known window"
    eps_v = eps.pop()
    return LayerSpec("gemma3_text", attn.n_heads, attn.n_kv_heads, attn.head_dim, q[0].group_size, q[0].bits,
                     tuple(weights), eps_v, norm_placement="sandwich", norm_offset=1.0, qk_norm_eps=eps_v,
                     activation=GELU_TANH, rope=rope, attn_scale=float(attn.scale), sliding_window=window)


def _phi3(block, window: int) -> Built:
    """phi3 (Phi-3, Phi-4-mini): fused qkv_proj and gate_up_proj, partial rotary, SuScaled/LongRoPE."""
    attn = block.self_attn
    linears, q, why = _linears(block, (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"),
                                       ("gate_up", "mlp.gate_up_proj"), ("down", "mlp.down_proj")))
    if why:
        return why
    weights = [("attn_norm", "input_layernorm.weight"), ("mlp_norm", "post_attention_layernorm.weight")] + linears
    eps = {_rms(block.input_layernorm), _rms(block.post_attention_layernorm)}
    if None in eps or len(eps) != 1:
        return "norms are not two RMSNorms with one eps"
    rope = _rope_slots(attn.rope, weights)
    if isinstance(rope, str):
        return rope
    return LayerSpec("phi3", attn.n_heads, attn.n_kv_heads, attn.head_dim, q[0].group_size, q[0].bits,
                     tuple(weights), eps.pop(), rope=rope, attn_scale=float(attn.scale))


def _olmo(block, _model_window: int, family: str) -> Built:
    """olmo2 / olmo3: no pre norms, an RMSNorm after attention and after the MLP (post placement), q/k RMSNorms
    over each row's whole projection before the head split, SwiGLU. olmo3's sliding layers (``layer_types``) get a
    RotatingKVCache of ``args.sliding_window`` and a window mask from the model; its full layers may use YaRN. The
    window comes from the block's own ``args`` (olmo3 blocks keep them), not from the model."""
    attn, args = block.self_attn, block.args
    if not has_role(block.mlp, MLP_SWIGLU):
        return "MLP is not the SwiGLU MLP class"
    linears, q, why = _linears(block)
    if why:
        return why
    weights = [("attn_out_norm", "post_attention_layernorm.weight"),
               ("mlp_out_norm", "post_feedforward_layernorm.weight"),
               ("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight")] + linears
    eps = {_rms(block.post_attention_layernorm), _rms(block.post_feedforward_layernorm)}
    qk = {_rms(attn.q_norm), _rms(attn.k_norm)}
    if None in eps or None in qk or len(eps) != 1 or len(qk) != 1:
        return "norms are not RMSNorms with one eps per kind"
    n_heads = attn.num_attention_heads if family == "olmo3" else attn.n_heads
    n_kv_heads = attn.num_key_value_heads if family == "olmo3" else attn.n_kv_heads
    if attn.q_norm.weight.shape[0] != n_heads * attn.head_dim:
        return "q/k norms are not over the whole projection"
    rope = _rope_slots(attn.rope, weights)
    if isinstance(rope, str):
        return rope
    if family == "olmo3" and args.layer_types[attn.layer_idx] != "full_attention":
        window = int(args.sliding_window)
        if window <= 0:
            return "sliding layer without a known window"
    else:
        window = 0
    return LayerSpec(family, n_heads, n_kv_heads, attn.head_dim, q[0].group_size, q[0].bits, tuple(weights),
                     eps.pop(), norm_placement="post", qk_norm_eps=qk.pop(), qk_norm_whole=True, rope=rope,
                     attn_scale=float(attn.scale), sliding_window=window)


def _ministral3(block, _model_window: int) -> Built:
    """ministral3 (Ministral 3, the text model inside mlx-lm's mistral3): llama's pre-norm layer, YaRN, sliding
    layers (``use_sliding``, the window from ``args.sliding_window``) and queries multiplied by the model's
    ``attn_scale``, a factor per position (llama-4 scaling: 1 + beta * log(1 + floor(pos / original max))), which
    the block gets as an argument and the op as ``q_scale`` (``query_scale`` computes it when the caller passes
    none, with the attention's own function and numbers)."""
    from mlx_lm.models import ministral3

    attn = block.self_attn
    if not callable(getattr(ministral3, "_get_llama_4_attn_scale", None)):
        return "mlx-lm's ministral3 has no _get_llama_4_attn_scale"
    if not all(isinstance(getattr(attn, n), (int, float))
               for n in ("scaling_beta", "original_max_position_embeddings")):
        return "the attention's llama-4 scaling numbers are not numbers"
    spec = _prenorm(block, 0, "ministral3")
    if isinstance(spec, str):
        return spec
    window = 0
    if block.use_sliding:
        window = int(block.args.sliding_window or 0)
        if window <= 0:
            return "sliding layer without a known window"
    return replace(spec, sliding_window=window, q_row_scale=True)


def query_scale(block: nn.Module, length: int, offset) -> mx.array:
    """The ``attn_scale`` a ministral3 block's attention computes itself when its caller passes none: (length, 1),
    or (B, 1, length, 1) for per-row offsets."""
    from mlx_lm.models import ministral3

    attn = block.self_attn
    return ministral3._get_llama_4_attn_scale(length, offset, attn.scaling_beta, attn.original_max_position_embeddings)


# (mlx_lm.models module, block class name) -> builder. Mistral and SmolLM2/SmolLM3 run llama's classes.
BUILDERS: dict[tuple[str, str], Callable[[nn.Module, int], Built]] = {
    ("llama", "TransformerBlock"): lambda b, w: _prenorm(b, w, "llama"),
    ("qwen2", "TransformerBlock"): lambda b, w: _prenorm(b, w, "qwen2"),
    ("qwen3", "TransformerBlock"): lambda b, w: _prenorm(b, w, "qwen3", qk_norm=True),
    ("qwen3_moe", "Qwen3MoeDecoderLayer"): lambda b, w: _prenorm(b, w, "qwen3_moe", qk_norm=True),
    ("gemma3_text", "TransformerBlock"): _gemma3,
    ("phi3", "TransformerBlock"): _phi3,
    ("olmo2", "TransformerBlock"): lambda b, w: _olmo(b, w, "olmo2"),
    ("olmo3", "Olmo3DecoderLayer"): lambda b, w: _olmo(b, w, "olmo3"),
    ("ministral3", "TransformerBlock"): _ministral3,
}


def builder_of(cls: type) -> Optional[Callable[[nn.Module, int], Built]]:
    """The builder for an mlx-lm block class (by identity, validated mlx-lm versions only), or None."""
    key = table_key(cls)
    return BUILDERS.get(key) if key is not None else None


def spec_of(block: nn.Module, window: int = 0) -> Built:
    """The block's LayerSpec, or one line saying why the one-op layer does not take it. ``window``: the model's
    sliding window (gemma3_text keeps it on the model; its sliding layers need it)."""
    build = builder_of(type(block))
    if build is None:
        return f"{type(block).__name__} is not a block class in the spec table"
    try:
        return build(block, window)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a block shaped unlike its class' code
        return f"cannot read the block ({exc})"

