"""SamplingParams validation and the batched sampler, against transformers' logits processors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from minigpt.sampling import (
    Sampler,
    SamplerOutput,
    SamplingParams,
    argmax,
    gumbel_argmax,
    gumbel_noise,
    prompt_logprobs,
    row_keys,
)

lp = pytest.importorskip("transformers.generation.logits_process")

V = 1000
EOS = 999


@dataclass
class Row:
    """Stands in for the engine's Sequence."""

    params: SamplingParams
    seed: int = 0
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)


def random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf(processor, logits: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    """A transformers processor applied to one row of logits."""
    ids = torch.tensor([input_ids or [0]])
    return processor(ids, logits[None].clone())[0]


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """The same ids filtered to -inf and the same values elsewhere."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)], rtol=0, atol=0)


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_the_public_contract():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.ignore_eos) == (64, 0.0, 0, 1.0, None, False)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert (p.logprobs, p.prompt_logprobs, p.n, p.min_tokens) == (None, None, 1, 0)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias is None and p.allowed_token_ids is None
    assert p.greedy and not SamplingParams(temperature=0.5).greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[50256, 0]).stop_token_ids == (50256, 0)
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, logprobs=0, min_tokens=64, seed=-5)
    assert isinstance(p.temperature, float) and isinstance(p.repetition_penalty, float)
    assert p.logprobs == 0 and p.min_tokens == 64 and p.seed == -5
    bias = {5: 1, 7: -100.0}
    p = SamplingParams(logit_bias=bias, allowed_token_ids=[9, 3])
    assert p.logit_bias == {5: 1.0, 7: -100.0} and isinstance(p.logit_bias[5], float)
    assert p.allowed_token_ids == (9, 3)
    bias[5] = 50.0  # the caller's dict is not the params'
    assert p.logit_bias[5] == 1.0
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", None),
        ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
        ("temperature", True),
        ("top_k", -1), ("top_k", 1.5), ("top_k", True),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
        ("min_p", -0.01), ("min_p", 1.5),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3.0),
        ("seed", 1.0), ("seed", "0"), ("seed", True), ("seed", 2**63), ("seed", -(2**63) - 1),
        ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5), ("stop", {"a"}),
        ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
        ("ignore_eos", 1), ("ignore_eos", None),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("prompt_logprobs", 100), ("prompt_logprobs", 1.0),
        ("n", 0), ("n", False),
        ("min_tokens", -1), ("min_tokens", 65), ("min_tokens", 1.0),
        ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {True: 1.0}),
        ("logit_bias", {1: math.inf}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: "2"}), ("logit_bias", [1]),
        ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.0]),
        ("allowed_token_ids", 5), ("allowed_token_ids", {1}),
    ],
)
def test_invalid_values_name_the_field(field_name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field_name} must be .*got {re_escape(value)}"):
        SamplingParams(**{field_name: value})


def re_escape(value) -> str:
    import re

    return re.escape(repr(value))


def test_min_tokens_is_checked_against_max_tokens():
    SamplingParams(max_tokens=5, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=5, min_tokens=6)


# ---------------------------------------------------------------- each transform against transformers


def processed(params: list[SamplingParams], logits: torch.Tensor, rows: list[Row] | None = None) -> torch.Tensor:
    rows = rows or [Row(p) for p in params]
    return Sampler(logits.shape[1]).process(logits, rows)


def test_temperature_matches_transformers():
    temps = [0.3, 0.7, 1.0, 1.5, 2.0]
    logits = random_logits(len(temps))
    ours = processed([SamplingParams(temperature=t) for t in temps], logits)
    for i, t in enumerate(temps):
        assert torch.equal(ours[i], hf(lp.TemperatureLogitsWarper(float(t)), logits[i]))


def test_top_k_matches_transformers_including_ties():
    ks = [1, 5, 50, 0, V, V + 7]
    logits = random_logits(len(ks))
    logits[0, :3] = 50.0  # a three-way tie at the top: top_k=1 keeps all three, as transformers does
    logits[1, [10, 20]] = logits[1].topk(5).values[-1]  # ties at the k-th value are kept
    ours = processed([SamplingParams(temperature=1.0, top_k=k) for k in ks], logits)
    assert torch.isfinite(ours[0]).sum() == 3
    for i, k in enumerate(ks):
        expected = logits[i] if k == 0 else hf(lp.TopKLogitsWarper(k), logits[i])
        assert_same_logits(ours[i], expected)


def test_top_p_matches_transformers():
    ps = [0.05, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0]
    logits = random_logits(len(ps), scale=2.0)
    logits[0, 7] = 50.0  # one dominant token: top-p keeps just it
    ours = processed([SamplingParams(temperature=1.0, top_p=p) for p in ps], logits)
    assert torch.isfinite(ours[0]).sum() == 1
    for i, p in enumerate(ps):
        expected = logits[i] if p == 1.0 else hf(lp.TopPLogitsWarper(p), logits[i])
        assert_same_logits(ours[i], expected)
        assert 0 < torch.isfinite(ours[i]).sum() <= V


def test_top_p_on_peaked_logits_matches_transformers():
    """LM-like rows where most ids are far below the top: the pruned sort must not change the result."""
    logits = random_logits(6, scale=6.0) - torch.arange(V) * 0.02
    ps = [0.5, 0.8, 0.9, 0.95, 0.99, 0.9999]
    ours = processed([SamplingParams(temperature=1.0, top_p=p) for p in ps], logits)
    for i, p in enumerate(ps):
        assert_same_logits(ours[i], hf(lp.TopPLogitsWarper(p), logits[i]))


def test_min_p_matches_transformers_after_temperature():
    cases = [(0.5, 0.0), (1.0, 0.05), (0.7, 0.1), (1.3, 0.3), (1.0, 1.0)]
    logits = random_logits(len(cases))
    ours = processed([SamplingParams(temperature=t, min_p=m) for t, m in cases], logits)
    for i, (t, m) in enumerate(cases):
        expected = hf(lp.MinPLogitsWarper(m), hf(lp.TemperatureLogitsWarper(t), logits[i]))
        assert_same_logits(ours[i], expected)


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    penalties = [1.0, 1.2, 2.0, 0.8]
    logits = random_logits(len(penalties))
    rows = [
        Row(SamplingParams(repetition_penalty=r), prompt_token_ids=[5, 6, 7, 5, V + 3], output_token_ids=[9, 6, 11 * i])
        for i, r in enumerate(penalties)
    ]
    ours = processed([], logits, rows)
    for i, (r, row) in enumerate(zip(penalties, rows, strict=True)):
        ids = row.prompt_token_ids + row.output_token_ids
        expected = logits[i] if r == 1.0 else hf(lp.RepetitionPenaltyLogitsProcessor(r), logits[i], ids)
        assert torch.equal(ours[i], expected)


def test_presence_and_frequency_penalties_follow_openai():
    logits = random_logits(2)
    out_ids = [4, 4, 4, 9, V + 1]  # an id past the vocabulary (a padded embedding's) counts for nothing
    rows = [Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), output_token_ids=out_ids),
            Row(SamplingParams(presence_penalty=-1.0), prompt_token_ids=[4, 9], output_token_ids=[])]
    ours = processed([], logits, rows)
    expected = logits[0].clone()
    expected[4] -= 0.5 + 0.25 * 3
    expected[9] -= 0.5 + 0.25 * 1
    torch.testing.assert_close(ours[0], expected)
    assert torch.equal(ours[1], logits[1])  # prompt ids do not count


def test_full_chain_matches_transformers_order():
    """repetition penalty -> temperature -> top-k -> top-p -> min-p, as transformers' generate builds it."""
    logits = random_logits(3, seed=3)
    configs = [dict(repetition_penalty=1.3, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
               dict(repetition_penalty=1.1, temperature=1.4, top_k=200, top_p=0.6, min_p=0.0),
               dict(repetition_penalty=0.9, temperature=0.5, top_k=0, top_p=0.97, min_p=0.2)]
    rows = [Row(SamplingParams(**c), prompt_token_ids=list(range(0, 300, 7)), output_token_ids=[1, 2, 700])
            for c in configs]
    ours = processed([], logits, rows)
    for i, (c, row) in enumerate(zip(configs, rows, strict=True)):
        chain = lp.LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(c["repetition_penalty"]),
                                        lp.TemperatureLogitsWarper(c["temperature"])])
        if c["top_k"]:
            chain.append(lp.TopKLogitsWarper(c["top_k"]))
        chain += [lp.TopPLogitsWarper(c["top_p"]), lp.MinPLogitsWarper(c["min_p"])]
        ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
        assert_same_logits(ours[i], chain(ids, logits[i][None].clone())[0])


def test_logit_bias_matches_transformers_sequence_bias():
    logits = random_logits(3)
    biases = [{5: -100.0, 17: 2.5, 999: 0.25}, {}, {0: 100.0, V + 3: 7.0}]  # ids past the vocab are dropped
    ours = processed([SamplingParams(logit_bias=b) for b in biases], logits)
    for i, b in enumerate(biases):
        kept = {(t,): v for t, v in b.items() if t < V}
        assert torch.equal(ours[i], hf(lp.SequenceBiasLogitsProcessor(kept), logits[i]) if kept else logits[i])


def test_allowed_token_ids_match_transformers_prefix_constraint():
    logits = random_logits(3)
    allowed = [[3, 500, 7], None, [V - 1, V + 5]]
    ours = processed([SamplingParams(allowed_token_ids=a) for a in allowed], logits)
    assert torch.equal(ours[1], logits[1])
    for i in (0, 2):
        ids = [t for t in allowed[i] if t < V]
        assert_same_logits(ours[i], hf(lp.PrefixConstrainedLogitsProcessor(lambda *_, ids=ids: ids, 1), logits[i]))
        assert torch.isfinite(ours[i]).sum() == len(ids)


def test_bias_and_allowed_ids_come_first_as_in_transformers_generate():
    """logit bias (transformers' sequence_bias, first in generate's list) -> allowed ids -> repetition penalty
    -> temperature -> top-k: the bias acts on the raw logits, before the penalty scales them."""
    logits = random_logits(1, seed=4)
    bias, allowed = {3: 4.0, 6: -1.5, 40: 2.0}, list(range(0, 600, 3))
    row = Row(SamplingParams(logit_bias=bias, allowed_token_ids=allowed, repetition_penalty=1.7, temperature=0.8,
                             top_k=30), prompt_token_ids=[3, 6, 9, 12], output_token_ids=[40, 41])
    chain = lp.LogitsProcessorList([lp.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                                    lp.PrefixConstrainedLogitsProcessor(lambda *_: allowed, 1),
                                    lp.RepetitionPenaltyLogitsProcessor(1.7), lp.TemperatureLogitsWarper(0.8),
                                    lp.TopKLogitsWarper(30)])
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    assert_same_logits(processed([], logits, [row])[0], chain(ids, logits.clone())[0])


def test_process_leaves_the_callers_logits_alone():
    logits = random_logits(6)
    before = logits.clone()
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(repetition_penalty=2.0),
              SamplingParams(), SamplingParams(temperature=0.5, top_k=3, min_p=0.1)]
    params += [SamplingParams(logit_bias={1: 5.0}), SamplingParams(temperature=1.0, allowed_token_ids=[2, 3])]
    processed(params, logits)
    Sampler(V)(logits, [Row(p) for p in params])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- greedy, vocab limit, min_tokens


def test_greedy_is_argmax_on_fast_and_slow_paths():
    logits = random_logits(5)
    sampler = Sampler(V)
    fast = sampler(logits, [Row(SamplingParams()) for _ in range(5)])
    assert fast.token_ids == logits.argmax(-1).tolist() and fast.logprobs is None
    slow = sampler(logits, [Row(SamplingParams(logprobs=2)) for _ in range(5)])  # logprobs leave the fast path
    assert slow.token_ids == fast.token_ids
    mixed = sampler(logits, [Row(SamplingParams(temperature=1.0 if i % 2 else 0.0), seed=i) for i in range(5)])
    assert mixed.token_ids[::2] == fast.token_ids[::2]


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 5e-324])
def test_tiny_temperatures_are_greedy(temperature):
    """Dividing float32 logits by these overflows: they must not sample garbage."""
    logits = random_logits(5)
    params = SamplingParams(temperature=temperature, seed=0)
    assert params.greedy
    out = Sampler(V)(logits, [Row(params, seed=i) for i in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 2, 3, 31, 255, 256, 257, 1000, 1024, 4097, 50257])
def test_argmax_is_torchs_argmax_in_blocks_and_one_row_alone(vocab):
    torch.manual_seed(vocab)
    x = torch.randn(7, vocab)
    x[1] = x[1].round()  # many ties: the first maximum wins
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, -1] = 1e9  # the maximum in a short last block
    x[5] = 0.0
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[:0]), x[:0].argmax(-1))
    for row in x.split(1):  # one row goes through `max`
        assert torch.equal(argmax(row), row.argmax(-1))


def test_greedy_takes_the_argmax_of_penalised_logits():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 8] = 5.0, 4.0
    row = Row(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[3])
    assert Sampler(V)(logits, [row]).token_ids == [8]


def test_ids_past_vocab_limit_are_never_picked():
    logits = random_logits(4, vocab=V + 24)
    logits[:, V:] = 100.0
    sampler = Sampler(V)
    rows = [Row(SamplingParams()), Row(SamplingParams(temperature=2.0), seed=1),
            Row(SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2), seed=2),
            Row(SamplingParams(logprobs=5))]
    for step in range(20):
        for row in rows:
            row.output_token_ids = [V + 5] * step  # out-of-vocab history must not break penalties
        out = sampler(logits, rows)
        assert all(t < V for t in out.token_ids)
        assert all(i < V for i in out.logprobs[3].top)
    assert sampler.process(logits, rows).shape == (4, V)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, EOS], logits[:, 42], logits[:, 7] = 9.0, 8.0, 1.0
    sampler = Sampler(V, eos_token_ids=(EOS,))
    params = SamplingParams(min_tokens=3, stop_token_ids=[42, V + 100])
    early = [Row(params, output_token_ids=[1, 2]), Row(params, output_token_ids=[1, 2, 3]), Row(SamplingParams())]
    assert sampler(logits, early).token_ids == [7, EOS, EOS]
    sampled = [Row(SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[42]), seed=s) for s in range(50)]
    drawn = sampler(logits[:1].expand(50, V), sampled).token_ids
    assert EOS not in drawn and 42 not in drawn


def test_greedy_rows_honour_logit_bias_and_allowed_ids():
    """Rows with a bias or an allowed set leave the greedy fast path; the rows beside them are unchanged."""
    logits = random_logits(5)
    top2 = logits.topk(2).indices.tolist()
    rows = [Row(SamplingParams(logit_bias={top2[0][0]: -100.0})), Row(SamplingParams(logit_bias={42: 100.0})),
            Row(SamplingParams(allowed_token_ids=[7, 8, 9])), Row(SamplingParams()),
            Row(SamplingParams(logit_bias={top2[4][1]: 100.0}, allowed_token_ids=[top2[4][0], top2[4][1]]))]
    out = Sampler(V)(logits, rows)
    assert out.token_ids == [top2[0][1], 42, 7 + int(logits[2, 7:10].argmax()), int(logits[3].argmax()), top2[4][1]]
    assert out.logprobs is None


def test_allowed_ids_restrict_sampled_tokens_across_seeds():
    allowed = [3, 77, 500, 998]
    logits = random_logits(1, scale=1.0).expand(300, V)
    rows = [Row(SamplingParams(temperature=1.5, allowed_token_ids=allowed, top_p=0.99), seed=s) for s in range(300)]
    drawn = Sampler(V)(logits, rows).token_ids
    assert set(drawn) == set(allowed)  # all four are drawn, nothing else


def test_logprobs_stay_raw_under_bias_and_allowed_ids():
    logits = random_logits(1)
    raw = logits[0].log_softmax(-1)
    params = SamplingParams(logprobs=3, logit_bias={11: 100.0}, allowed_token_ids=[11, 12])
    out = Sampler(V)(logits, [Row(params)])
    assert out.token_ids == [11]
    assert out.logprobs[0].logprob == pytest.approx(raw[11].item(), abs=1e-6)
    assert list(out.logprobs[0].top) == raw.topk(3).indices.tolist()


# ---------------------------------------------------------------- seeded sampling


def test_seeded_row_is_independent_of_batch_and_position():
    """The same request alone and at every position of a batch of 9 draws the same tokens, step after step."""
    steps = 12
    step_logits = [random_logits(1, seed=100 + s, scale=1.0)[0] for s in range(steps)]
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=300, min_p=0.01, repetition_penalty=1.1,
                            logit_bias={5: 2.0, 6: -3.0, 100: 1.5})
    others = [SamplingParams(), SamplingParams(temperature=2.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.3, logprobs=3), SamplingParams(repetition_penalty=1.5),
              SamplingParams(temperature=1.0, min_p=0.2, presence_penalty=1.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3], logit_bias={2: 1.0})]
    sampler = Sampler(V, eos_token_ids=(EOS,))

    def run(position: int | None) -> list[int]:
        me = Row(target, seed=1234, prompt_token_ids=[5, 6])
        rows = [Row(p, seed=99 + j) for j, p in enumerate(others)]
        if position is not None:
            rows.insert(position, me)
        else:
            rows = [me]
        for s in range(steps):
            noise = random_logits(len(rows), seed=s)  # whatever the other rows see
            logits = torch.stack([step_logits[s] if r is me else noise[j] for j, r in enumerate(rows)])
            for r, t in zip(rows, sampler(logits, rows).token_ids, strict=True):
                r.output_token_ids.append(t)
        return me.output_token_ids

    alone = run(None)
    for position in (0, 3, 8):
        assert run(position) == alone
    assert len(set(alone)) > 1


def test_recompute_after_preemption_redraws_the_same_token():
    """A row's draw depends only on (seed, number of output tokens), not on how many calls came before."""
    logits = random_logits(1, scale=0.5)
    sampler = Sampler(V)
    params = SamplingParams(temperature=1.0)
    first = sampler(logits, [Row(params, seed=7, output_token_ids=[3, 4, 5])]).token_ids
    sampler(logits, [Row(params, seed=7)])  # unrelated calls in between
    assert sampler(logits, [Row(params, seed=7, output_token_ids=[9, 9, 9])]).token_ids == first


def test_different_seeds_and_steps_give_different_samples():
    logits = torch.zeros(64, V)  # uniform: any coupling between seeds would show as repeats
    sampler = Sampler(V)
    by_seed = sampler(logits, [Row(SamplingParams(temperature=1.0), seed=s) for s in range(64)]).token_ids
    by_step = sampler(logits, [Row(SamplingParams(temperature=1.0), seed=0, output_token_ids=[0] * s)
                               for s in range(64)]).token_ids
    assert len(set(by_seed)) > 55 and len(set(by_step)) > 55
    assert by_seed != by_step


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, pooling the cells expected to see < 5 draws."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    stat, dof = chi_square(torch.bincount(samples, minlength=probs.numel()).double(), probs.double())
    assert stat < dof + 5 * math.sqrt(2 * dof), (stat, dof)  # ~5 sigma: fails only on real bias


@pytest.mark.parametrize("vocab", [7, 600])  # one partial block; several blocks with a partial tail
def test_draws_follow_softmax_across_seeds_and_across_steps(vocab):
    n = 20_000
    logits = random_logits(1, vocab=vocab, seed=5, scale=1.5)
    probs = logits[0].softmax(-1)
    across_seeds = gumbel_argmax(logits.expand(n, vocab), list(range(n)), [0] * n)
    across_steps = gumbel_argmax(logits.expand(n, vocab), [12345] * n, list(range(n)))
    assert_matches(across_seeds, probs)
    assert_matches(across_steps, probs)


def test_filtered_draws_follow_transformers_distribution():
    n, vocab = 20_000, 300
    logits = random_logits(1, vocab=vocab, seed=8, scale=2.0)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    chain = lp.LogitsProcessorList([lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(40),
                                    lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.02)])
    probs = chain(torch.zeros(1, 1, dtype=torch.long), logits.clone())[0].softmax(-1)
    out = Sampler(vocab)(logits.expand(n, vocab), [Row(params, seed=s) for s in range(n)])
    samples = torch.tensor(out.token_ids)
    assert bool((probs[samples] > 0).all())
    assert_matches(samples, probs)


def test_noise_is_uniform_and_uncorrelated():
    ids = torch.arange(4096).expand(256, 4096)
    keys = row_keys(range(256), [3] * 256)
    u = torch.exp(-torch.exp(-gumbel_noise(keys, ids)))  # back to the uniform
    assert (u > 0).all() and (u < 1).all()
    flat = u.flatten().sort().values
    ks = (flat - torch.arange(1, flat.numel() + 1, dtype=torch.float64) / flat.numel()).abs().max()
    assert ks < 1.63 / math.sqrt(flat.numel()) * 1.5  # Kolmogorov-Smirnov, well past the 1% level
    centred = u - 0.5
    for a, b in [(centred[:, 1:], centred[:, :-1]),  # neighbouring ids
                 (centred[1:], centred[:-1])]:      # neighbouring seeds
        corr = (a * b).mean() / (centred**2).mean()
        assert abs(corr) < 5 / math.sqrt(a.numel())
    next_step = torch.exp(-torch.exp(-gumbel_noise(row_keys(range(256), [4] * 256), ids))) - 0.5
    assert abs((next_step * centred).mean() / (centred**2).mean()) < 5 / math.sqrt(centred.numel())


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_distribution():
    logits = random_logits(4, vocab=V + 10)
    rows = [Row(SamplingParams(logprobs=5)), Row(SamplingParams(temperature=0.3, top_k=2, logprobs=20), seed=3),
            Row(SamplingParams(temperature=1.0), seed=4), Row(SamplingParams(logprobs=0, repetition_penalty=3.0))]
    out = Sampler(V)(logits, rows)
    assert isinstance(out, SamplerOutput) and out.logprobs[2] is None
    raw = logits[:, :V].log_softmax(-1)  # before temperature, filters and penalties
    for i, k in [(0, 5), (1, 20), (3, 0)]:
        entry = out.logprobs[i]
        assert entry.logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert len(entry.top) == k
        values, ids = raw[i].topk(k)
        assert list(entry.top) == ids.tolist()
        assert list(entry.top.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[0].top[out.token_ids[0]] == out.logprobs[0].logprob  # greedy: the top entry


def test_logprobs_from_half_precision_logits():
    logits = random_logits(2).bfloat16()
    out = Sampler(V)(logits, [Row(SamplingParams(logprobs=1)), Row(SamplingParams(logprobs=1))])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    ref = logits.float().log_softmax(-1)
    assert out.logprobs[1].logprob == pytest.approx(ref[1].max().item(), abs=1e-5)


def test_prompt_logprobs_score_each_next_token():
    prompt = torch.tensor([5, 17, 3, 999, 42])
    logits = random_logits(len(prompt), vocab=V + 3)
    scored = prompt_logprobs(logits[:-1], prompt[1:], k=3, vocab_limit=V)
    raw = logits[:, :V].log_softmax(-1)
    assert len(scored) == len(prompt) - 1
    for t, entry in enumerate(scored):
        assert entry.logprob == pytest.approx(raw[t, prompt[t + 1]].item(), abs=1e-6)
        assert list(entry.top) == raw[t].topk(3).indices.tolist()
    assert sum(e.logprob for e in scored) < 0
    assert prompt_logprobs(logits[:2], [1, 2], k=0)[0].top == {}
    with pytest.raises(ValueError, match="target_ids"):
        prompt_logprobs(logits, prompt[1:], k=1)
    with pytest.raises(ValueError, match="k must be"):
        prompt_logprobs(logits[:-1], prompt[1:], k=21)


def test_bad_sampler_input_is_rejected():
    with pytest.raises(ValueError, match="vocab_limit"):
        Sampler(0)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(V)(random_logits(2), [Row(SamplingParams())])
