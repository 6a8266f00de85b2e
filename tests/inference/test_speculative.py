"""Speculative decoding (inference.speculative): drafters, the draft length, and output
unchanged: greedy tokens identical to decoding without drafts on every architecture the
engine runs, sampled tokens distributed as without drafts (chi-square on the bundled
model, fixed seeds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.opened import OpenedModel
from czyx.inference.options import SpeculateOptions
from czyx.inference.sampling import Sampler, SamplingParams
from czyx.inference.speculative import (
    PLAIN_FIRST,
    PROBE_EVERY,
    REMEASURE_EVERY,
    Drafter,
    DraftLength,
    ModelDrafter,
    PromptLookup,
    SharedRowCost,
    SpeculationError,
    Speculator,
    choose_tokens,
    speculative_decode,
)
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import ENGINE_ARCHES, make_tiny_checkpoint


class Replay:
    """Drafts the reference continuation, every third position's token wrong: steps with
    every draft accepted, and steps rejected at each place, deterministically."""

    name = "replay"

    def __init__(self, ref: list[int], vocab: int) -> None:
        self.ref, self.vocab = ref, vocab

    def propose(self, history, k):
        n = len(history)
        assert list(history) == self.ref[:n]  # the history is the run's own tokens
        out = self.ref[n : n + k]
        return [(t + 1) % self.vocab if (n + j) % 3 == 0 else t for j, t in enumerate(out)]

    def close(self) -> None:
        pass


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    look = PromptLookup(ngram=3)
    assert isinstance(look, Drafter)
    #            0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert look.propose(history, 2) == [7, 8]  # the latest match of (1, 2, 3)
    assert look.propose(history, 10) == [7, 8, 1, 2, 3]  # up to the end of the history
    assert look.propose([5, 6, 1, 2, 6], 3) == [1, 2, 6]  # only n = 1 matches
    assert look.propose([4, 4], 3) == [4]  # one token repeated: n = 1 matches
    assert look.propose([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    assert look.propose(history, 0) == [] and look.propose([1], 3) == []
    # A longer n-gram wins over a later shorter one.
    assert PromptLookup(2).propose([5, 6, 8, 0, 6, 9, 5, 6], 1) == [8]
    with pytest.raises(ValueError, match="ngram"):
        PromptLookup(0)


def _latest_match(history: list[int], ngram: int, k: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest tail."""
    size = len(history)
    if size < 2 or k <= 0:
        return []
    for n in range(min(ngram, size - 1), 0, -1):
        for e in range(size - 1, n - 1, -1):
            if history[e - n : e] == history[size - n :]:
                return history[e : e + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    ngram=st.integers(1, 4),
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=8),
    k=st.integers(0, 5),
    restart=st.integers(0, 8),
)
def test_prompt_lookup_is_the_latest_longest_match_for_all_histories(ngram, chunks, k, restart):
    """For every history grown chunk by chunk (and one started afresh), the indexed
    drafts are the brute-force search's."""
    look = PromptLookup(ngram)
    history: list[int] = []
    for i, chunk in enumerate(chunks):
        history = list(chunk) if i == restart else history + chunk
        assert look.propose(history, k) == _latest_match(history, ngram, k)


def test_prompt_lookup_reindexes_a_history_that_is_not_an_extension() -> None:
    look = PromptLookup(ngram=2)
    long_a = [*range(100, 300), 5, 6, 7, 5, 6]
    assert look.propose(long_a, 1) == [7]
    grown = [*long_a, 7, 8, 5, 6]  # an extension: the latest (5, 6) is followed by 7 still
    assert look.propose(grown, 2) == [7, 8]
    other = [5, 6, 9, 9, 5, 6]  # a new text, shorter: indexed afresh
    assert look.propose(other, 2) == [9, 9]
    changed_tail = [*grown[:-3], 1, 5, 6]  # same length class, its recent tokens differ
    assert look.propose(changed_tail, 1) == [7]


def test_draft_length_follows_the_acceptance() -> None:
    dl = DraftLength(6, measure=False)
    assert 0 < dl.best() < 6  # the prior
    for _ in range(20):
        dl.update(6, 6)
    assert dl.next() == 6 and dl.acceptance > 0.9
    for _ in range(40):
        dl.update(dl.most, 0)
    assert dl.acceptance < 0.1 and dl.best() == 0
    ks = [dl.next() for _ in range(PROBE_EVERY)]
    assert ks == [0] * (PROBE_EVERY - 1) + [1]  # a probe after PROBE_EVERY idle steps
    assert dl.probing
    dl.update(1, 0)  # rejected: the next probe comes twice as late
    ks = [dl.next() for _ in range(2 * PROBE_EVERY)]
    assert ks == [0] * (2 * PROBE_EVERY - 1) + [1] and dl.probing
    assert dl.next() == 0 and not dl.probing  # a probe with no drafts is not pending
    assert DraftLength(3, adaptive=False).next() == 3
    with pytest.raises(ValueError):
        DraftLength(0)


def test_draft_length_weighs_the_measured_step_cost() -> None:
    cheap, dear = DraftLength(4), DraftLength(4)
    for dl, verify_s in ((cheap, 1.2), (dear, 5.0)):
        for _ in range(PLAIN_FIRST):
            assert dl.next() == 0  # plain steps first, to time them
            dl.plain(1.0)
        dl.plain(9.0)  # one slowed by another process: the quickest is the unit
        for _ in range(30):
            dl.update(4, 3, verify_s)  # acceptance 3/4 of each step's 4 drafts
    assert cheap.cost < 0.1  # rows nearly free: draft the most, a plain step now and then
    ks = [cheap.next() for _ in range(REMEASURE_EVERY)]
    assert sorted(ks) == [0] + [4] * (REMEASURE_EVERY - 1)
    assert dear.cost > 0.9 and dear.next() <= 1  # a row costs a step: hardly worth it


def test_first_drafts_are_probes_until_a_row_is_timed() -> None:
    """Before any batched verification is timed, the prior's row cost is a guess: drafts
    are one-token probes until one is accepted, then a batched step times the rows."""
    miss, hit = DraftLength(4), DraftLength(4)
    for dl in (miss, hit):
        for _ in range(PLAIN_FIRST):
            assert dl.next() == 0
            dl.plain(1.0)
        assert dl.next() == 1 and dl.probing  # the prior would batch: probe instead
    miss.update(1, 0)  # rejected: no batched step at the prior's cost
    assert [miss.next() for _ in range(2 * PROBE_EVERY)] == [0] * (2 * PROBE_EVERY - 1) + [1]
    hit.update(1, 1)  # accepted: the next step batches one draft, and its time prices a row
    assert hit.best() > 1 and hit.next() == 1 and not hit.probing
    hit.update(1, 1, 1.05)
    assert hit.cost < 0.1 and hit.next() == 4 and not hit.probing


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(0.0, 5.0),
    b=st.floats(0.01, 5.0),
    rows=st.lists(st.integers(1, 40), min_size=2, max_size=30),
    n=st.integers(1, 16),
)
def test_the_shared_row_cost_is_a_rows_share_of_the_fitted_step(a, b, rows, n) -> None:
    """Steps of ``a + b R`` seconds: once two row counts are seen, a row costs
    ``b / (a / n + b)`` of an n-sequence step's plain share; before, the prior."""
    rc = SharedRowCost(prior=0.25)
    for r in rows[:1] * 3:
        rc.add(r, a + b * r)
    assert rc.cost(n) == 0.25  # one row count: no slope yet
    for r in rows:
        rc.add(r, a + b * r)
    if len(set(rows)) > 1:
        assert math.isclose(rc.cost(n), b / (a / n + b), rel_tol=1e-6, abs_tol=1e-9)
    rc.add(1, 100.0)  # a step slowed by another process pulls the line, never below 0
    assert 0.0 <= rc.cost(n) <= 1.0


@given(
    target=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    drafts=st.lists(st.integers(0, 3), max_size=5),
    stop_after=st.integers(1, 8),
)
def test_choose_tokens_keeps_the_accepted_prefix(target, drafts, stop_after) -> None:
    """Greedy: the drafts equal to the target's tokens are accepted up to the first that is
    not, whose target token replaces it; all accepted, one more; a stop ends it at once."""
    drafts = drafts[: len(target) - 1]
    rows = [np.eye(4, dtype=np.float32)[t] for t in target]
    asked, emitted = [], []

    def row(i):
        asked.append(i)
        return rows[i]

    def emit(tok):
        emitted.append(tok)
        return len(emitted) >= stop_after

    accepted, kept, stop = choose_tokens(Sampler(SamplingParams()), row, drafts, emit)
    match = next((i for i, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
    n = min(match + 1, stop_after)  # tokens emitted: the matches, then the correction
    assert emitted == target[:n] and asked == list(range(n))
    assert accepted == min(match, n) and stop == (n >= stop_after)
    assert kept == accepted - (1 if stop and accepted == n else 0)


def test_speculate_options_fail_closed() -> None:
    assert not SpeculateOptions().enabled
    assert SpeculateOptions("draft:m@q2").draft_ref == "m@q2"
    for bad in ("maybe", "draft:", "draft:noversion"):
        with pytest.raises(ValueError, match="speculate"):
            SpeculateOptions(bad)
    with pytest.raises(ValueError, match="draft tokens"):
        SpeculateOptions("lookup", draft_tokens=0)


def _spec(drafter, k: int = 4, adaptive: bool = False) -> Speculator:
    return Speculator(drafter, DraftLength(k, adaptive))


@pytest.mark.parametrize("arch", ENGINE_ARCHES)
def test_greedy_tokens_are_those_without_drafts(tmp_path, arch) -> None:
    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt")
    with Store.open(tmp_path / "store") as st:
        mount(st, ckpt, "m@1")
    prompt = [3, 17, 5, 60, 1, 88, 3, 17, 5, 60, 1]
    with OpenedModel(str(tmp_path / "store"), "m@1", None) as om:
        eng = Engine(om.consumer)
        vocab = eng.cfg.vocab_size
        want, _ = generate_ids(eng, prompt, 20)
        kv_want = eng.position
        ref = prompt + want
        spec = _spec(Replay(ref, vocab))
        got, stats = generate_ids(eng, prompt, 20, speculate=spec)
        assert got == want, arch
        assert eng.position == kv_want  # rejected positions rolled back
        assert 0 < stats.accepted < stats.drafted
        assert len(stats.draft_steps) < len(want) - 1  # fewer forward passes than tokens
        got, stats = generate_ids(eng, prompt, 20, speculate=_spec(PromptLookup(), 3, True))
        assert got == want, arch
        assert eng.position == kv_want
        eng.close()


def test_a_length_dependent_rope_verifies_one_position_at_a_time(longrope_engine) -> None:
    eng = longrope_engine
    assert not eng.verifies_in_one_step
    with pytest.raises(ValueError, match="one position at a time"):
        eng.verify([1, 2])
    prompt = [7, 30, 2, 7, 30]  # the switch (10 positions) falls inside the generation
    want, _ = generate_ids(eng, prompt, 12)
    got, stats = generate_ids(eng, prompt, 12, speculate=_spec(Replay(prompt + want, 256)))
    assert got == want
    assert 0 < stats.accepted < stats.drafted


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    from czyx.inference.assets import bundled_model_dir

    root = tmp_path_factory.mktemp("spec")
    with Store.open(root / "store") as st:
        mount(st, bundled_model_dir(), "stdlib@1")
    with OpenedModel(str(root / "store"), "stdlib@1", None) as om:
        eng = Engine(om.consumer, threads=1)
        yield om, eng
        eng.close()


def test_a_draft_model_drafts_and_rolls_back(bundled) -> None:
    om, eng = bundled
    prompt = list(b"def parse(line):\n    return line.split(")
    want, _ = generate_ids(eng, prompt, 24)
    # The model drafting for itself: every greedy draft is accepted.
    drafter = ModelDrafter(Engine(om.consumer, threads=1), "self", eng.cfg.vocab_size)
    got, stats = generate_ids(eng, prompt, 24, speculate=_spec(drafter, 4))
    assert got == want and stats.accepted == stats.drafted > 0
    # Run again: the drafter's cache, holding the last generation, is cut back to the
    # prompt (the common prefix) and drafts the same tokens. (Rejected drafts are rolled
    # back on the target: test_greedy_tokens_are_those_without_drafts.)
    assert len(drafter._seen) > len(prompt)
    got, stats = generate_ids(eng, prompt, 24, speculate=_spec(drafter, 4))
    assert got == want and stats.accepted == stats.drafted > 0
    drafter.close()
    with pytest.raises(SpeculationError, match="vocabulary"):
        ModelDrafter(eng, "other", eng.cfg.vocab_size + 1)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability ~1e-4 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def test_sampled_tokens_keep_their_distribution(bundled) -> None:
    """Three sampled tokens (top-3 at temperature 1, so 27 outcomes), the second and third
    through one verification step of a fixed draft: the outcome counts over 1000 seeded
    runs fit the model's exact joint distribution (chi-square), and do not fit the
    distribution of a sampler that would always keep a possible draft."""
    _, eng = bundled
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = list(b"import os\nimport sys\nimport ")
    probe = Sampler(params)

    def dist(seq):
        eng.reset()
        return probe.probabilities(eng.prefill(seq))

    draft = int(np.argsort(dist(prompt))[-2])  # plausible at some positions, not at others
    exact, keep_all = {}, {}
    p1 = dist(prompt)
    for a in np.flatnonzero(p1):
        p2 = dist([*prompt, a])
        for b in np.flatnonzero(p2):
            p3 = dist([*prompt, a, b])
            for c in np.flatnonzero(p3):
                exact[(a, b, c)] = p1[a] * p2[b] * p3[c]
                # The wrong rule: a draft with p > 0 is always kept.
                q2 = np.eye(p2.size)[draft] if p2[draft] > 0 else p2
                keep_all[(a, b, c)] = p1[a] * q2[b] * p3[c]
    assert abs(sum(exact.values()) - 1.0) < 1e-9

    class Fixed:
        name = "fixed"

        def propose(self, history, k):
            return [draft] * min(k, 1)

        def close(self) -> None:
            pass

    n = 1000
    counts: dict = {}
    drafted = accepted = 0
    eng.reset()
    first = eng.prefill(prompt)  # the decode loop itself, after one prefill of the prompt
    base = eng.position
    for seed in range(n):
        spec = _spec(Fixed(), 1)
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=seed))
        out, _ = speculative_decode(eng, first, list(prompt), 3, sampler, set(), spec)
        eng.rollback(base)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        drafted += spec.drafted
        accepted += spec.accepted
    assert drafted == n and 0 < accepted < n  # every run verified one draft, some kept
    assert set(counts) <= set(exact)

    def chi2(expected):
        # Outcomes expected fewer than 5 times are pooled into one cell (the test's
        # chi-square approximation needs no smaller expected counts).
        big = [c for c, pr in expected.items() if n * pr >= 5]
        small = [c for c, pr in expected.items() if 0 < n * pr < 5]
        cells = [(sum(counts.get(c, 0) for c in g), n * sum(expected[c] for c in g))
                 for g in [[c] for c in big] + ([small] if small else [])]  # fmt: skip
        stat = sum((o - e) ** 2 / e for o, e in cells)
        return stat, len(cells) - 1

    stat, df = chi2(exact)
    assert stat < _chi2_critical(df), (stat, df)
    wrong, wdf = chi2({c: keep_all.get(c, 0.0) for c in exact})
    assert wrong > _chi2_critical(wdf) or any(
        counts.get(c, 0) and keep_all.get(c, 0.0) == 0 for c in exact
    )


def test_probes_are_verified_one_token_at_a_time(bundled, monkeypatch) -> None:
    """Drafts the length says do not pay (probes) are decoded one by one, each only after
    its predecessor was accepted, so a rejected probe costs a plain step; drafts that
    pay go through one batched step. The tokens are those without drafts either way."""
    _, eng = bundled
    prompt = list(b"def parse(line):\n    return line.split(")
    n = 3 * PROBE_EVERY
    want, _ = generate_ids(eng, prompt, n)
    steps = []
    verify = eng.verify
    monkeypatch.setattr(eng, "verify", lambda ids: steps.append(len(ids)) or verify(ids))
    for cost, probes in ((5.0, True), (0.01, False)):
        steps.clear()
        # measure=False: the length follows the acceptance and this fixed row cost.
        spec = Speculator(
            Replay(prompt + want, eng.cfg.vocab_size), DraftLength(4, cost=cost, measure=False)
        )
        got, stats = generate_ids(eng, prompt, n, speculate=spec)
        assert got == want
        drafting = [d for d, _ in spec.steps if d]
        assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
        if probes:  # a row dearer than the step: only probes, one draft each, no batch
            assert drafting == [1] * len(drafting) and steps == []
        else:  # every drafting step one batched verification of the pending token + drafts
            assert steps == [d + 1 for d in drafting]
        assert eng.position == len(prompt) + n - 1  # the last token left pending


def test_verify_rows_are_one_token_decodes(bundled) -> None:
    """Every row of a verification step is bit for bit the logits of decoding its token
    alone (the C path), also beside another sequence's chunk; the KV cut back by
    rollback is the KV of the kept tokens."""
    from czyx.inference.batch import decodes_in_c, forward_batch

    _, eng = bundled
    model = eng.model
    assert decodes_in_c(model)
    prompt = list(b"for i in range(")
    chunk = list(b"10):\n")
    eng.reset()
    eng.prefill(prompt)
    rows = eng.verify(chunk)
    assert rows.shape == (len(chunk), eng.cfg.vocab_size)
    eng.rollback(len(prompt) + 2)
    k_after = [k[:, : eng.position].copy() for k in eng.kv.k]
    eng.reset()
    eng.prefill(prompt)
    for j, t in enumerate(chunk):
        assert np.array_equal(eng.decode(t), rows[j])
        if j == 1:
            assert all(np.array_equal(a, k[:, : eng.position]) for a, k in zip(k_after, eng.kv.k))
    # Batched beside another sequence (a one-token chunk): the same rows.
    kv_a, kv_b = model.new_kv(), model.new_kv()
    forward_batch(model, [np.array(prompt)], [kv_a])
    forward_batch(model, [np.array([5, 6])], [kv_b])
    kv_c = model.new_kv()
    forward_batch(model, [np.array([5, 6])], [kv_c])
    last = forward_batch(model, [np.array([7])], [kv_c])[0]
    got = forward_batch(
        model, [np.array(chunk), np.array([7])], [kv_a, kv_b], all_logits=[True, False]
    )
    assert np.array_equal(got[0], rows) and np.array_equal(got[1], last)


def test_czyx_run_speculates_with_the_same_text(tmp_path, monkeypatch, capsys) -> None:
    import json

    import jsonschema

    from czyx.cli import main
    from czyx.inference.assets import bundled_model_dir
    from czyx.inference.xray import load_schema

    monkeypatch.setenv("CZYX_STORE", str(tmp_path / "store"))
    assert main(["mount", str(bundled_model_dir()), "--as", "s@1", "--no-progress"]) == 0
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"

    def run(*flags: str) -> tuple[str, str]:
        capsys.readouterr()
        assert main(["run", "s@1", "--prompt", prompt, "-n", "40", *flags]) == 0
        got = capsys.readouterr()
        return got.out, got.err

    want, _ = run()
    xray = tmp_path / "x.json"
    out, err = run("--speculate", "lookup", "--draft-tokens", "3", "--xray", str(xray))
    assert out == want and "speculation:" in err
    report = json.loads(xray.read_text())
    jsonschema.validate(report, load_schema())
    spec = report["run"]["speculation"]
    assert spec["drafted"] == sum(d for d, _ in spec["steps"]) > 0
    assert all(0 <= a <= d <= 3 for d, a in spec["steps"])
    out, _ = run("--speculate", "draft:s@1", "--draft-cache-mb", "2")  # itself as the draft
    assert out == want
    capsys.readouterr()
    assert main(["run", "s@1", "--prompt", prompt, "--speculate", "sometimes"]) != 0
    assert "speculate: 'sometimes' is not one of" in capsys.readouterr().err
    assert main(["run", "s@1", "--prompt", prompt, "--speculate", "lookup", "--ray", "x"]) != 0
    assert "--speculate: not with --ray" in capsys.readouterr().err
    assert main(["run", "s@1", "--prompt", prompt, "--speculate", "mtp"]) != 0
    err = capsys.readouterr().err.strip()  # the bundled model has no MTP layer: one line
    assert "num_nextn_predict_layers" in err and "\n" not in err


@pytest.mark.parametrize("c_decode", [True, False])
def test_served_drafts_ride_in_the_batch_and_change_no_token(bundled, c_decode) -> None:
    """The scheduler with prompt lookup as its default: eight requests at once give the
    tokens each gives without speculation (greedy), drafts verified in shared steps; a
    request may turn it off; a draft version is refused."""
    from czyx.inference.batch import BatchOptions, Scheduler

    _, eng = bundled
    prompts = [
        b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
        b"import os\nimport sys\nimport ",
        b"self.x = x\n        self.y = y\n        self.",
        b"for i in range(10):\n    for j in range(",
        b"if x:\n    pass\nif y:\n    pass\nif ",
        b"# Copyright",
        b"raise ValueError(",
        b"class A:\n    pass\n\n\nclass B:\n",
    ]
    n = 24 if c_decode else 12  # (the numpy step is slower: fewer tokens)
    base = BatchOptions(max_batch=8, prefill_chunk=8, step_tokens=64, c_decode=c_decode)
    spec = SpeculateOptions("lookup", draft_tokens=3, adaptive=False)
    plain = Scheduler(eng.model, base)
    try:
        want = [plain.submit(list(p), n).result(timeout=60)[0] for p in prompts]
    finally:
        plain.close()
    from dataclasses import replace

    sched = Scheduler(eng.model, replace(base, speculate=spec))
    try:
        handles = [sched.submit(list(p), n) for p in prompts]
        got = [h.result(timeout=120)[0] for h in handles]
        st = sched.stats()
        off = sched.submit(list(prompts[0]), n, speculate=SpeculateOptions()).result(60)[0]
        assert sched.stats().drafted == st.drafted  # that request drafted nothing
        with pytest.raises(ValueError, match="not served"):
            sched.submit(list(prompts[0]), 4, speculate=SpeculateOptions("draft:m@q2"))
    finally:
        sched.close()
    assert got == want and off == want[0]
    assert 0 < st.accepted < st.drafted
    assert st.active == 0 and st.kv_used == 0
    with pytest.raises(ValueError, match="not served"):
        BatchOptions(speculate=SpeculateOptions("draft:m@q2"))


def test_a_seeded_sampled_served_request_ignores_the_measured_row_cost(bundled) -> None:
    """Served drafts of a greedy request follow the row cost its steps measure (its tokens
    are the same at any length); a sampled request's follow its acceptance alone, so its
    seed gives the same tokens before and after the scheduler has measured rows."""
    from dataclasses import replace

    from czyx.inference.batch import BatchOptions, Scheduler

    _, eng = bundled
    base = BatchOptions(max_batch=4, prefill_chunk=16, step_tokens=64)
    sched = Scheduler(eng.model, replace(base, speculate=SpeculateOptions("lookup")))
    sampled = SamplingParams(temperature=0.3, seed=11)
    prompt = list(b"the set the set the set the set the set the set the ")  # drafts accepted
    try:
        first = sched.submit(prompt, 24, sampling=sampled).result(timeout=60)[0]
        greedy = [list(p) for p in (b"import os\nimport ", b"if x:\n    pass\nif ", b"# C")]
        for h in [sched.submit(p, 24) for p in greedy]:  # steps of 1 to 3 sequences
            h.result(timeout=60)
        fitted = sched._row_cost.cost(2)
        again = sched.submit(prompt, 24, sampling=sampled).result(timeout=60)[0]
    finally:
        sched.close()
    assert fitted != sched._row_cost.prior  # rows were priced by the greedy traffic
    assert again == first


def test_scoped_windowed_and_streamed_engines_speculate_unchanged(tmp_path) -> None:
    """A scoped portal's routing restriction (numpy verification with its mask), a trunk
    window and a partial expert cache: greedy tokens as without drafts."""
    from czyx.inference.assets import bundled_model_dir
    from czyx.portals.model import grant_model

    with Store.open(tmp_path / "s") as st:
        mount(st, bundled_model_dir(), "m@1")
        scoped = grant_model(st, "m@1", tenant="a", classes="0-7").token
    prompt = list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    for kw, token, lazy in (
        ({}, scoped, False),
        ({"trunk_window": 1}, None, True),
        ({"cache_fraction": 0.3}, None, False),
    ):
        with OpenedModel(str(tmp_path / "s"), "m@1", token, lazy_trunk=lazy) as om:
            eng = Engine(om.consumer, threads=1, **kw)
            assert (eng.route_restriction is not None) == (token is not None)
            want, _ = generate_ids(eng, prompt, 32)
            got, st = generate_ids(eng, prompt, 32, speculate=_spec(PromptLookup(), 4))
            assert got == want, kw
            assert st.drafted > st.accepted > 0
            eng.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba"])
def test_served_drafts_roll_back_a_hybrid_models_recurrent_state(tmp_path, arch) -> None:
    """Linear-attention layers keep a recurrent state, not a KV cache that can be cut:
    the scheduler's verify step snapshots it at every position it reaches, so a rejected
    draft returns the state to the accepted position and greedy tokens are unchanged."""
    from dataclasses import replace

    from czyx.inference.batch import BatchOptions, Scheduler

    ckpt = make_tiny_checkpoint(arch, tmp_path / "ckpt")
    with Store.open(tmp_path / "store") as st:
        mount(st, ckpt, "m@1")
    prompts = [[3, 17, 5, 60, 1, 88, 3, 17, 5, 60, 1], [7, 7, 30, 7, 7, 30, 7], [50, 4, 19]]
    base = BatchOptions(max_batch=4, prefill_chunk=8, step_tokens=64)
    spec = SpeculateOptions("lookup", draft_tokens=3, adaptive=False)
    with OpenedModel(str(tmp_path / "store"), "m@1", None) as om:
        eng = Engine(om.consumer)
        plain = Scheduler(eng.model, base)
        try:
            want = [plain.submit(p, 16).result(timeout=60)[0] for p in prompts]
        finally:
            plain.close()
        sched = Scheduler(eng.model, replace(base, speculate=spec))
        try:
            got = [h.result(timeout=120)[0] for h in [sched.submit(p, 16) for p in prompts]]
            st = sched.stats()
        finally:
            sched.close()
        eng.close()
    assert got == want, arch
    assert 0 < st.accepted < st.drafted  # drafts were rejected and rolled back
