"""How much a conversion changed the model: next-token KL divergence, perplexity and top-1 agreement.

Both models read the same built-in text sample (``mlxinfer/data/eval_sample.txt``) in windows of ``window``
tokens; at every position we compare the source's next-token distribution P with the converted one's Q:
  KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))   (nats, averaged over positions; 0 = identical)
  perplexity = exp(mean -log p(next token))         (for each model; the ratio is the quality cost)
  top-1 agreement = share of positions where argmax P == argmax Q (what greedy decoding would pick)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .._resources import data_path
from ..errors import InvalidModel, MlxinferError, one_line

Progress = Callable[[str, int, int], None]
SAMPLE_FILE = "eval_sample.txt"


@dataclass
class QualityReport:
    tokens: int                 # positions compared
    kl_mean: float              # nats
    kl_p99: float
    kl_max: float
    ppl_source: float
    ppl_converted: float
    top1_agreement: float       # 0..1

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change, e.g. 0.031 = +3.1 %."""
        return self.ppl_converted / self.ppl_source - 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ppl_change"] = self.ppl_change
        d["sample"] = SAMPLE_FILE
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("tokens compared", str(self.tokens)),
            ("KL divergence (mean)", f"{self.kl_mean:.5f} nats"),
            ("KL divergence (p99 / max)", f"{self.kl_p99:.4f} / {self.kl_max:.4f} nats"),
            ("perplexity source", f"{self.ppl_source:.3f}"),
            ("perplexity converted", f"{self.ppl_converted:.3f} ({self.ppl_change:+.2%})"),
            ("top-1 agreement", f"{self.top1_agreement:.2%}"),
        ]


class NotFinite(InvalidModel):
    """NaN/inf logits: the conversion fails (a model that answers nothing must not be written), where other
    evaluation errors only skip the report."""


def sample_text() -> str:
    return data_path(SAMPLE_FILE).read_text(encoding="utf-8")


def sample_tokens(tokenizer, limit: int) -> list[int]:
    """``limit + 1`` tokens of the sample (inputs plus the last target); fewer if the sample is shorter."""
    import logging

    # transformers warns when a text is longer than the model's context; we cut it into windows ourselves.
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        ids = list(tokenizer.encode(sample_text()))
    finally:
        log.setLevel(level)
    return ids[: limit + 1]


def _log_softmax(logits):
    import mlx.core as mx

    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _load(path: Path):
    from ..engine.loader import apply_dtype_policy, load_model_dir

    import mlx.core as mx

    model, _ = load_model_dir(path, lazy=True)
    apply_dtype_policy(model)  # the backend's activation dtype, as mlxinfer runs it
    mx.eval(model.parameters())
    return model


def evaluate(
    source_dir: Path,
    converted_dir: Path,
    *,
    max_tokens: int,
    window: int = 512,
    tokenizer=None,
    progress: Progress | None = None,
) -> QualityReport:
    """Compare the converted model with the source on up to ``max_tokens`` positions of the sample."""
    import mlx.core as mx
    import numpy as np

    if tokenizer is None:
        from ..engine.trust import load_tokenizer  # no remote code, no downloads, no stdin questions

        try:
            tokenizer = load_tokenizer(Path(source_dir))
        except MlxinferError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers raises many types for tokenizers it cannot build
            raise InvalidModel(f"cannot load the tokenizer in {source_dir} for the quality check: {one_line(e)}",
                               hint="convert with --no-eval") from None
    ids = sample_tokens(tokenizer, max_tokens)
    if len(ids) < 2:
        raise ValueError("the evaluation sample is empty after tokenization")
    src, conv = _load(source_dir), _load(converted_dir)
    n = len(ids) - 1
    kls, nll_src, nll_conv, agree = [], 0.0, 0.0, 0
    if progress:
        progress("eval", 0, n)
    for start in range(0, n, window):
        x = mx.array(ids[start:min(start + window, n)])[None]          # (1, L)
        y = mx.array(ids[start + 1:min(start + window, n) + 1])          # (L,)
        lp = _log_softmax(src(x)[0].astype(mx.float32))                  # (L, V)
        lq = _log_softmax(conv(x)[0].astype(mx.float32))                 # (L, V)
        kl = mx.sum(mx.exp(lp) * (lp - lq), axis=-1)                     # (L,)
        pick = y[:, None]
        s_nll = -mx.take_along_axis(lp, pick, axis=-1).sum()
        c_nll = -mx.take_along_axis(lq, pick, axis=-1).sum()
        same = (mx.argmax(lp, axis=-1) == mx.argmax(lq, axis=-1)).sum()
        mx.eval(kl, s_nll, c_nll, same)
        kls.append(np.array(kl))
        nll_src += s_nll.item()
        nll_conv += c_nll.item()
        agree += same.item()
        del lp, lq
        if progress:
            progress("eval", min(start + window, n), n)
    del src, conv
    mx.clear_cache()
    # NaN/inf logits (a NaN scale in the file) would report "KL nan, top-1 agreement 100%" and keep the output.
    if not math.isfinite(nll_src):
        raise NotFinite(f"the source model's output is not finite (NaN or inf): its weights in {source_dir} are "
                        "corrupt", hint="download the source again")
    if not math.isfinite(nll_conv):
        raise NotFinite("the converted model's output is not finite (NaN or inf) where the source's is",
                        hint="convert with more bits (--bits 8), or report it")
    k = np.maximum(np.concatenate(kls), 0.0)  # tiny negative values are float rounding
    return QualityReport(
        tokens=n,
        kl_mean=float(k.mean()),
        kl_p99=float(np.percentile(k, 99)),
        kl_max=float(k.max()),
        ppl_source=math.exp(nll_src / n),
        ppl_converted=math.exp(nll_conv / n),
        top1_agreement=agree / n,
    )
