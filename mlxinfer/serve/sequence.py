"""One request inside the engine: its ``Ticket`` (what the HTTP side holds) and its decoding state (``SeqState``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..engine.generate import _holdback, reply_detokenizer
from ..engine.sampling import make_logits_processors, make_sampler
from .schemas import Job


@dataclass
class Ticket:
    """One request's handle: the job, where its events go, and whether the client still wants them.

    Events: ("text", piece, [logprob entries]), ("done", finish_reason, usage), ("error", ApiError)."""

    job: Job
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    cancelled: bool = False

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class SeqState:
    def __init__(self, ticket: Ticket, cache: list, reused: int, tokenizer):
        import mlx.core as mx

        job = ticket.job
        self.ticket, self.job, self.cache, self.reused = ticket, job, cache, reused
        self.todo = job.prompt[reused:-1]           # prompt tokens still to prefill (the last one is fed by decode)
        self.started = False                        # its prompt is in a batched prefill or prefilling alone
        self.next_input = job.prompt[-1]
        self.history = list(job.prompt)             # prompt + generated: what the repetition penalty looks at
        self.generated = 0
        self.sampler = make_sampler(job.params)
        self.greedy = job.params.temperature == 0
        self.processors = make_logits_processors(job.params)
        self.rng = mx.random.key(job.params.seed) if job.params.seed is not None and not self.greedy else None
        self.detok = reply_detokenizer(tokenizer, completion=job.kind == "completion")
        self.text, self.emitted, self.last = "", 0, 0.0
        self.pending_lp: list[dict] = []             # logprob entries whose token's text is not shown yet
        self._lp_ends: list[int] = []                 # where each pending token's bytes end in the reply's bytes
        self._lp_total = 0
        self._lead_space = False
        self.stopped_by_string = False

    def add(self, tok: int, entry: dict | None, eos: set) -> str | None:
        """Take one sampled token: emit the text that is safe to show (not a possible stop-string start);
        returns the finish reason when the sequence is done."""
        self.generated += 1
        self.history.append(tok)
        self.next_input = tok
        if tok in eos and not self.job.ignore_eos:
            return "stop"
        if entry is not None:
            if not self._lp_total:
                self._lead_space = entry["bytes"].startswith(b" ")  # the detokenizer drops a reply's first space
            self._lp_total += len(entry["bytes"])
            self.pending_lp.append(entry)
            self._lp_ends.append(self._lp_total)
        self.detok.add_token(tok)
        self.text += self.detok.last_segment
        stops = self.job.stop
        if stops:
            found = min((p for p in (self.text.find(x, max(0, self.emitted - len(x))) for x in stops) if p >= 0),
                        default=-1)
            if found >= 0:
                self.emit(self.emitted, found)
                self.emitted, self.stopped_by_string = len(self.text), True
                return "stop"
            safe = len(self.text) - _holdback(self.text, stops)
        else:
            safe = len(self.text)
        self.emit(self.emitted, max(safe, self.emitted))
        self.emitted = max(safe, self.emitted)
        return "length" if self.generated >= self.job.max_tokens else None

    def emit(self, start: int, end: int, final: bool = False) -> None:
        """Push the text [start:end] with the logprob entries of the tokens it completes (a token whose text is
        held back, for a stop string or the rest of a character, goes out with the piece that shows it)."""
        if final:
            n = len(self.pending_lp)
        else:
            shown = len(self.text[:end].encode("utf-8"))
            if shown and self._lead_space and not self.text.startswith(" "):
                shown += 1
            n = next((i for i, e in enumerate(self._lp_ends) if e > shown), len(self._lp_ends))
        entries, self.pending_lp, self._lp_ends = self.pending_lp[:n], self.pending_lp[n:], self._lp_ends[n:]
        if end > start or entries:
            self.ticket.push(("text", self.text[start:end], entries))

    def close(self, reason: str) -> None:
        """The held-back tail and the detokenizer's last bytes belong to the reply; then the usage."""
        if not self.stopped_by_string:
            self.detok.finalize()
            self.text += self.detok.last_segment
            self.emit(self.emitted, len(self.text), final=True)
            self.emitted = len(self.text)
        prompt = len(self.job.prompt)
        usage = {"prompt_tokens": prompt, "completion_tokens": self.generated,
                 "total_tokens": prompt + self.generated, "cached_tokens": self.reused}
        self.ticket.push(("done", reason, usage))

    def sample(self, logprobs):
        """This sequence's sampler on its row. With a seed it draws from its own key (mlx-lm's samplers use the
        global random state, which other sequences advance), through the same filters."""
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if self.rng is None:
            return self.sampler(logprobs)
        p = self.job.params
        self.rng, key = mx.random.split(self.rng)
        x = logprobs
        if 0 < p.top_p < 1:
            x = apply_top_p(x, p.top_p)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        if 0 < p.top_k < x.shape[-1]:
            x = apply_top_k(x, p.top_k)
        return mx.random.categorical(x * (1 / p.temperature), key=key)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's table; SmolLM2, Llama 3, Qwen use it):
    printable Latin-1 stands for itself, the other bytes for U+0100 upwards, in order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(0x100 + i): b for i, b in enumerate(moved)}}


_ALPHABET: dict[str, int] = {}


def token_bytes(detok, tokenizer, tid: int) -> bytes:
    """A token's own bytes: a byte-level or byte-fallback token may hold part of a character, which decoding it
    alone turns into U+FFFD."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    if isinstance(detok, SPMStreamingDetokenizer):  # its map holds bytes already (<0xF0> tokens as that byte)
        return detok.tokenmap[tid].replace("\u2581".encode(), b" ")
    if isinstance(detok, BPEStreamingDetokenizer):
        if not _ALPHABET:
            _ALPHABET.update(_byte_level_alphabet())
        piece = detok.tokenmap[tid]
        if all(c in _ALPHABET for c in piece):
            return bytes(_ALPHABET[c] for c in piece)
        return piece.encode("utf-8")  # an added token stored as plain text
    return tokenizer.decode([tid]).encode("utf-8")


def token_text(raw: bytes) -> str:
    """OpenAI's token string: the bytes as text, or 'bytes:\\xf0\\x9f' when they are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprob_entries(rows: list[SeqState], logprobs, tokens: list[int], tokenizer) -> dict[int, dict]:
    """Per row that asked for logprobs: its token's logprob and its top alternatives (OpenAI's fields)."""
    import mlx.core as mx

    want = [(j, s.job.logprobs) for j, s in enumerate(rows) if s.job.logprobs is not None]
    if not want:
        return {}
    lps = [logprobs[j] for j, _ in want]
    tops = [mx.argpartition(-r, k - 1)[:k] if k else None for r, (_, k) in zip(lps, want)]
    mx.eval(lps, [t for t in tops if t is not None])
    out = {}
    for (j, k), r, top in zip(want, lps, tops):
        detok = rows[j].detok
        alts = []
        if top is not None:
            alts = sorted(((t, token_bytes(detok, tokenizer, t), v) for t, v in zip(top.tolist(), r[top].tolist())),
                          key=lambda a: -a[2])
        out[j] = {"id": tokens[j], "bytes": token_bytes(detok, tokenizer, tokens[j]), "logprob": r[tokens[j]].item(),
                  "top": alts}
    return out
