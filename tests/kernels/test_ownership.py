"""Clean ownership of the kernel swaps: per model instance, a typed provider contract checked once, an own KV-cache
type for the in-place layers, and a one-way import chain inside ``mlxinfer.kernels``."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import llama, phi3

from kernel_cases import tiny_llama
from mlxinfer.errors import MlxinferError
from mlxinfer.kernels import kv_cache, patch, provider as provider_lib

KERNELS = Path(patch.__file__).parent


class CorrectCountingProvider:
    """MLX's own maths (so the self-check passes and logits stay right), counting every call."""

    name = "fake-correct"

    def __init__(self):
        self.calls = {"qmm": 0, "sdpa": 0}

    def quantized_matmul(self, x, w, scales, biases, *, group_size, bits, mode="affine"):
        self.calls["qmm"] += 1
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    def sdpa(self, q, k, v, *, scale, mask):
        self.calls["sdpa"] += 1
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.fixture
def fake(monkeypatch):
    prov = CorrectCountingProvider()
    monkeypatch.setattr(patch, "select_provider", lambda name=None: (prov, "fake provider"))
    return prov


def tiny_phi3(seed: int = 1) -> nn.Module:
    """An architecture outside the fused table: its attention call is routed, nothing else of it fused."""
    mx.random.seed(seed)
    model = phi3.Model(phi3.ModelArgs(model_type="phi3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      vocab_size=300))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def run(model, tokens=(3, 1, 4, 1, 5, 9, 2, 6), steps=3):
    cache = cache_lib.make_prompt_cache(model)
    out = [model(mx.array([list(tokens)]), cache=cache)[:, -1]]
    for t in range(steps):
        out.append(model(mx.array([[10 + t]]), cache=cache)[:, -1])
    mx.eval(out)
    return mx.concatenate(out)


@pytest.mark.parametrize("make", [tiny_llama, tiny_phi3], ids=["llama", "phi3"])
def test_two_models_in_one_process_do_not_interfere(fake, make):
    sdpa_before = {m: m.scaled_dot_product_attention for m in (llama, phi3)}
    with_kernels, plain = make(), make()
    expected = run(plain)
    report = patch.apply_kernels(with_kernels, "auto")
    assert report.name == "fake-correct" and "attention in mlx_lm.models." in report.detail, report.detail
    # mlx-lm's modules are untouched: the routing lives in the model's own attention classes.
    assert all(m.scaled_dot_product_attention is f for m, f in sdpa_before.items())
    assert llama.scaled_dot_product_attention is mlx_lm_base.scaled_dot_product_attention

    fake.calls = {"qmm": 0, "sdpa": 0}
    got = run(with_kernels)
    assert fake.calls["sdpa"] == 2 * 4 and fake.calls["qmm"] > 0  # 2 layers x (prefill + 3 decode steps)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()

    fake.calls = {"qmm": 0, "sdpa": 0}
    again = run(plain)  # the builtin model, after the other got its kernels: MLX only, same logits
    assert fake.calls == {"qmm": 0, "sdpa": 0}
    assert mx.array_equal(again, expected).item()
    assert all(type(m).__module__.startswith(("mlx.", "mlx_lm.")) for _, m in plain.named_modules())

    patch.apply_kernels(with_kernels, "builtin")
    assert all(type(m).__module__.startswith(("mlx.", "mlx_lm.")) for _, m in with_kernels.named_modules())
    fake.calls = {"qmm": 0, "sdpa": 0}
    assert mx.array_equal(run(with_kernels), expected).item() and fake.calls == {"qmm": 0, "sdpa": 0}


def test_native_model_next_to_a_builtin_one(native_ext_or_skip):
    """The real provider: one-op layers in one model, MLX in the other, both right, caches of their own kind."""
    with_kernels, plain = tiny_llama(), tiny_llama()
    expected = run(plain)
    report = patch.apply_kernels(with_kernels, "custom")
    assert "2 decoder layers as one op" in report.detail
    got = run(with_kernels)
    assert mx.allclose(got, expected, atol=2e-3, rtol=2e-3).item(), float(mx.abs(got - expected).max())
    assert mx.array_equal(run(plain), expected).item()
    assert type(cache_lib.make_prompt_cache(with_kernels)[0]) is kv_cache.InPlaceKVCache
    assert type(cache_lib.make_prompt_cache(plain)[0]) is cache_lib.KVCache
    patch.apply_kernels(with_kernels, "builtin")
    assert type(cache_lib.make_prompt_cache(with_kernels)[0]) is cache_lib.KVCache


@pytest.fixture
def native_ext_or_skip():
    from mlxinfer import native

    if native.provider() is None:
        pytest.skip(native.status())
    return native.provider()


def test_in_place_cache_keeps_mlx_lm_contract(native_ext_or_skip):
    model = tiny_llama()
    patch.apply_kernels(model, "custom")
    try:
        cache = cache_lib.make_prompt_cache(model)
        assert all(isinstance(c, cache_lib.KVCache) for c in cache)
        model(mx.array([list(range(12))]), cache=cache)
        mx.eval([c.state for c in cache])
        assert cache[0].offset == 12 and cache[0].size() == 12 and cache_lib.can_trim_prompt_cache(cache)
        assert cache_lib.trim_prompt_cache(cache, 5) == 5 and cache[0].offset == 7
        keys, values, offset = cache[0].state
        assert keys.shape[2] == 256 and offset == 7 and keys.dtype == kv_cache.kv_dtype()
        batch = cache_lib.BatchKVCache.merge([cache[0], cache_lib.make_prompt_cache(model)[0]])
        assert isinstance(batch, cache_lib.BatchKVCache)
        # A plain mlx-lm KVCache (made elsewhere, e.g. a server's prefix-cache copy) is taken over on first write.
        plain = [cache_lib.KVCache() for _ in model.layers]
        a = model(mx.array([[1, 2, 3]]), cache=plain)[:, -1]
        assert all(type(c) is kv_cache.InPlaceKVCache for c in plain)
        b = model(mx.array([[1, 2, 3]]), cache=cache_lib.make_prompt_cache(model))[:, -1]
        assert mx.allclose(a, b).item()
    finally:
        patch.apply_kernels(model, "builtin")


def greedy(model, prompts, n=8):
    """Greedy tokens for a batch of equal-length prompts, decoded together (B = len(prompts))."""
    cache = cache_lib.make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1]
    out = []
    for _ in range(n):
        y = mx.argmax(logits, axis=-1)
        out.append(y.tolist())
        logits = model(y[:, None], cache=cache)[:, -1]
    return [list(col) for col in zip(*out)]


def test_batched_decode_matches_single(native_ext_or_skip):
    """B > 1 through the kernels (the server's batched decode relies on it) gives each sequence's own tokens."""
    model = tiny_llama(7)
    prompts = [[5, 17, 42, 99, 7, 3], [1, 2, 3, 4, 5, 6], [250, 11, 0, 299, 8, 64]]
    reference = greedy(model, prompts)
    report = patch.apply_kernels(model, "custom")
    try:
        assert "decoder layers as one op" in report.detail
        batched = greedy(model, prompts)
        single = [greedy(model, [p])[0] for p in prompts]
    finally:
        patch.apply_kernels(model, "builtin")
    assert batched == single == reference


# ---- the provider contract ----

class NoResidual(CorrectCountingProvider):
    def swiglu(self, x, gate, up, *, group_size, bits, norm_weight=None, norm_eps=0.0):
        return None

    def qkv_rope(self, x, q, k, v, **kw):
        return None


def test_capabilities_are_checked_once_by_signature():
    caps = provider_lib.capabilities(CorrectCountingProvider())
    assert caps == provider_lib.Capabilities()
    # qkv_rope without a quantized_matmul taking residual= (nor an sdpa taking heads_last=): not fused attention.
    caps = provider_lib.capabilities(NoResidual())
    assert caps.swiglu and not caps.fused_attention and not caps.decoder_block
    with pytest.raises(TypeError, match="lacks the kernel provider methods"):
        provider_lib.capabilities(object())


def test_native_provider_has_every_capability(native_ext_or_skip):
    caps = provider_lib.capabilities(native_ext_or_skip)
    assert caps.fused_attention and caps.decoder_block and caps.kv_append and caps.rms_norm and caps.embedding
    assert caps.batched and caps.batched_block and caps.notes


def test_a_decoder_layer_without_starts_is_not_asked_for_batches(native_ext_or_skip):
    """A provider whose decoder_layer predates ``starts=`` keeps its one-op single-sequence path; batches go
    per op (``fused_block`` asks only a ``batched_block`` provider)."""
    native = native_ext_or_skip

    class OldLayer:  # the native provider, its decoder_layer without starts=
        def __getattr__(self, name):
            return getattr(native, name)

        def decoder_layer(self, x, arrays, k_buf, v_buf, *, offset, causal, plan, write=-1, first=0):
            return native.decoder_layer(x, arrays, k_buf, v_buf, offset=offset, causal=causal, plan=plan,
                                        write=write, first=first)

    caps = provider_lib.capabilities(OldLayer())
    assert caps.decoder_block and caps.batched and not caps.batched_block, caps


def test_a_provider_without_the_contract_is_refused(monkeypatch):
    monkeypatch.setattr(patch, "select_provider", lambda name=None: (object(), "odd provider"))
    model = tiny_llama()
    report = patch.apply_kernels(model, "auto")
    assert report.name == "builtin" and "lacks the kernel provider methods" in report.detail
    with pytest.raises(MlxinferError, match="lacks the kernel provider methods"):
        patch.apply_kernels(model, "custom")


# ---- the module chain ----

def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported from mlxinfer.kernels, names taken from it) for every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "mlxinfer.kernels":
                found += [(a.name, []) for a in node.names]
            elif node.module.startswith("mlxinfer.kernels."):
                found.append((node.module.rsplit(".", 1)[1], [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name.rsplit(".", 1)[1], []) for a in node.names if a.name.startswith("mlxinfer.kernels.")]
    return found


def test_kernels_is_a_one_way_chain_without_private_imports():
    graph = {}
    for path in KERNELS.glob("*.py"):
        deps = _imports(path)
        private = [(mod, n) for mod, names in deps for n in names if n.startswith("_")]
        assert not private, f"{path.name} imports private names {private}"
        graph[path.stem] = {mod for mod, _ in deps if mod != path.stem}
    seen, done = set(), set()

    def visit(name, trail):
        assert name not in seen or name in done, f"import cycle: {' -> '.join(trail + [name])}"
        if name in done:
            return
        seen.add(name)
        for dep in graph.get(name, ()):
            visit(dep, trail + [name])
        done.add(name)

    for name in graph:
        visit(name, [])
    below_patch = {"layers", "fused_block", "fused_llama", "selfcheck", "kv_cache", "provider", "eligibility"}
    assert all("patch" not in graph[m] for m in below_patch)


def test_merged_batch_of_in_place_caches_matches_single(native_ext_or_skip):
    """The server's batching: prompts of different lengths prefilled into their own caches, merged into a
    left-padded BatchKVCache (mlx-lm's merge of InPlaceKVCaches), decoded together: each sequence's own tokens."""

    def batched(model, prompts, n=6):
        caches, first = [], []
        for p in prompts:
            cache = cache_lib.make_prompt_cache(model)
            first.append(mx.argmax(model(mx.array([p]), cache=cache)[:, -1], axis=-1))
            caches.append(cache)
        merged = [cache_lib.BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
        y, out = mx.concatenate(first), []
        for _ in range(n):
            out.append(y.tolist())
            y = mx.argmax(model(y[:, None], cache=merged)[:, -1], axis=-1)
        return [list(col) for col in zip(*out)]

    model = tiny_llama(7)
    prompts = [[5, 17, 42, 99, 7, 3], [1, 2, 3], [250, 11, 0, 299, 8, 64, 9, 9, 9]]
    reference = [greedy(model, [p], 6)[0] for p in prompts]
    patch.apply_kernels(model, "custom")
    try:
        got = batched(model, prompts)
    finally:
        patch.apply_kernels(model, "builtin")
    assert got == reference
