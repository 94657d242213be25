"""The draft-length policy with made-up costs: k = 0 when verification is expensive and
acceptance low, long drafts in the opposite case, per-request trimming, probes, the cost
line's fit; and the engine with ``dynamic_k`` on the tiny model (greedy output unchanged,
the chosen lengths in the stats)."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.drafting import calibration_rows
from specserve.spec_decode.k_policy import EXTRAPOLATED_ROW_SHARE, DraftCost, DraftLengthPolicy, RowCost

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def policy_with_costs(fixed: float, per_row: float, k: int = 6, draft: float = 0.0) -> DraftLengthPolicy:
    p = DraftLengthPolicy(k)
    for rows in (1, 2, 4, 8, 16):
        p.record_forward(rows, fixed + per_row * rows)
    p.draft.first = p.draft.later = draft
    return p


def test_row_costs_are_measured_interpolated_and_extended():
    cost = RowCost(weight=0.5)
    cost.add(1, 0.010)
    assert not cost.known()
    cost.add(5, 0.014)
    cost.add(5, 0.018)                                # a moving average: 0.016
    assert cost.known()
    assert cost(5) == pytest.approx(0.016)
    assert cost(3) == pytest.approx(0.013)            # between 1 and 5
    assert cost(9) == pytest.approx(0.016 + 4 * 0.75 * 0.016 / 5)   # beyond: 0.75 of an average row,
    steep = RowCost()                                                 # or the last two's slope if more
    steep.add(1, 0.010)
    steep.add(5, 0.030)
    assert steep(9) == pytest.approx(0.030 + 4 * 0.005)


def test_far_beyond_the_measured_counts_rows_are_not_free():
    """4 and 5 rows cost alike (one fused kernel call); carried out to a batch of 32 that flat
    slope would make drafts look free: each row costs at least 0.75 of an average one."""
    cost = RowCost()
    for rows, seconds in {1: 0.014, 4: 0.025, 5: 0.025}.items():
        cost.calibrate(rows, seconds)
    assert cost(32) == pytest.approx(0.025 + 27 * 0.75 * 0.025 / 5)
    cost.add(32, 0.094)                               # then measured: interpolated below it
    assert cost(20) == pytest.approx(0.025 + (0.094 - 0.025) * 15 / 27)


def test_timings_of_one_calibrated_count_rescale_them_all():
    """A count the policy stopped choosing does not keep a figure of the past: a slower
    machine (or a longer context) measured at 1 row slows 2-5 rows alike."""
    cost = RowCost(weight=0.5, shape_weight=0.0)
    for rows, seconds in {1: 0.010, 2: 0.013, 5: 0.018}.items():
        cost.calibrate(rows, seconds)
    cost.add(1, 0.030)                                   # three times slower: scale 1 -> 2
    assert [cost(r) for r in (1, 2, 5)] == pytest.approx([0.020, 0.026, 0.036])
    cost.add(8, 0.050)                                   # beyond the calibrated counts: its own figure
    assert cost(8) == pytest.approx(0.050) and cost(6) == pytest.approx(0.036 + (0.050 - 0.036) / 3)


def test_a_calibrated_count_timed_high_at_start_up_comes_down_once_used():
    """A start-up timing of 3 rows that came out 20% dear (a noisy machine) keeps 2-draft steps
    from being chosen; the steps that do use 3 rows bring its figure to what they measure,
    while 1 and 2 rows keep theirs."""
    cost = RowCost()
    for rows, seconds in {1: 0.080, 2: 0.095, 3: 0.125, 4: 0.115}.items():
        cost.calibrate(rows, seconds)
    for _ in range(200):
        cost.add(1, 0.080)
        cost.add(2, 0.095)
        cost.add(3, 0.104)
    assert [cost(r) for r in (1, 2, 3)] == pytest.approx([0.080, 0.095, 0.104], rel=0.01)
    # never timed again: 4 rows moves with the common scale only (pulled a little by 3's early
    # timings, which read below its shape until that shape came down), and stays above 3 rows
    assert cost(3) < cost(4) == pytest.approx(0.115, rel=0.06)


def test_more_rows_never_look_cheaper_than_fewer():
    cost = RowCost()
    for rows, seconds in {1: 0.020, 2: 0.015, 3: 0.030, 5: 0.025}.items():   # noisy measurements
        cost.add(rows, seconds)
    assert [cost(r) for r in (1, 2, 3, 4, 5)] == [0.020, 0.020, 0.030, 0.030, 0.030]


def test_a_flat_stretch_of_the_cost_is_used():
    """2 to 5 rows cost alike (a fused kernel path): drafting 4 beats drafting 1."""
    p = DraftLengthPolicy(6)
    for rows, ms in {1: 12, 2: 15, 3: 18, 4: 17, 5: 17, 6: 20, 7: 25}.items():
        p.record_forward(rows, ms / 1000)
    assert p.choose([[0.6, 0.45, 0.35, 0.3, 0.05, 0.01]], [6], [False]) == [4]


def test_expensive_rows_and_poor_acceptance_mean_no_drafts():
    # Each verified row costs as much as the whole fixed part (a big batch on a CPU).
    p = policy_with_costs(fixed=0.010, per_row=0.010)
    rates = [[0.2, 0.05, 0.01, 0.0, 0.0, 0.0]] * 4
    assert p.choose(rates, [6] * 4, [False] * 4) == [0, 0, 0, 0]


def test_cheap_rows_and_good_acceptance_mean_long_drafts():
    # Batch 1 on a memory-bound CPU: one more row costs 2% of a step.
    p = policy_with_costs(fixed=0.020, per_row=0.0004)
    rates = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]]
    assert p.choose(rates, [6], [False]) == [6]


def test_the_draft_models_cost_shortens_drafts():
    cheap_rows = dict(fixed=0.020, per_row=0.0004)
    rates = [[0.7, 0.5, 0.35, 0.25, 0.15, 0.1]]
    free = policy_with_costs(**cheap_rows).choose(rates, [6], [False])[0]
    costly = policy_with_costs(**cheap_rows, draft=0.006).choose(rates, [6], [False])[0]
    assert free > costly >= 1


def test_each_request_is_trimmed_to_what_its_own_acceptance_pays_for():
    p = policy_with_costs(fixed=0.020, per_row=0.002)
    good, poor = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7], [0.3, 0.02, 0.01, 0.0, 0.0, 0.0]
    k_good, k_poor = p.choose([good, poor], [6, 6], [False, False])
    assert k_good > 2 and k_poor <= 1


def test_limits_and_probes():
    p = policy_with_costs(fixed=0.010, per_row=0.010)
    rates = [[0.1] * 6, [0.9] * 6]
    assert p.choose(rates, [6, 2], [True, False])[0] == 6      # a probe drafts its limit
    assert all(k <= 2 for k in p.choose([[1.0] * 6], [2], [False]))


def test_acceptance_blends_the_request_with_the_prior_and_never_rises_with_depth():
    p = DraftLengthPolicy(4, prior_weight=4.0)
    rates = p.acceptance(accepted=[10, 2], drafted=[10, 10], prior=[0.5, 0.5])
    assert rates[0] == pytest.approx((10 + 2) / 14) and rates[1] == pytest.approx((2 + 2) / 14)
    assert rates[2] <= rates[1] and rates[3] <= rates[2]       # never drafted: extrapolated downwards
    assert p.acceptance([], [], [])[0] == 0.5                   # nothing known yet


def test_a_proposals_cost_is_its_first_forward_then_one_per_later_draft():
    cost = DraftCost(weight=0.5)
    cost.calibrate(first=0.030, later=0.020, per_catch_up_row=0.008)
    assert [cost(k) for k in (0, 1, 4)] == pytest.approx([0.0, 0.030, 0.090])
    assert cost(4, catch_up_rows=50) == pytest.approx(0.090 + 50 * 0.008)
    cost.record(4, 0.135)                       # steady, 1.5x the figure: one scale moves both
    assert cost.scale == pytest.approx(1.25) and cost(1) == pytest.approx(0.0375)
    cost.record(4, cost(4) + 60 * 0.010, catch_up_rows=60)   # a probe's catch-up: 10 ms a row
    assert cost.scale == pytest.approx(1.25) and cost.per_catch_up_row == pytest.approx(0.009)


def test_a_proposer_timed_only_online_starts_from_its_first_steady_proposal():
    cost = DraftCost()
    cost.record(3, 0.5, catch_up_rows=40)       # nothing to tell the catch-up from the drafts yet
    assert cost(3) == 0.0
    cost.record(3, 0.030)
    assert cost(3) == pytest.approx(0.030) and cost(1) == pytest.approx(0.010)


def test_the_engine_wide_prior_does_not_read_a_few_drafts_as_certain():
    assert DraftLengthPolicy.prior([1, 0], [1, 1]) == pytest.approx([2 / 3, 1 / 3])
    assert DraftLengthPolicy.prior([900], [1000]) == pytest.approx([901 / 1002])


def costly_catch_up_policy() -> DraftLengthPolicy:
    """A step of 55 ms; drafts pay a little at high acceptance (a CPU with int8 activations):
    at perfect acceptance a 4-draft step emits 5 tokens for 55 + 90 + 100 ms, 49 ms a token.
    Catching up costs 8 ms a row."""
    p = DraftLengthPolicy(4)
    for rows, ms in {1: 55, 2: 76, 3: 96, 4: 120, 5: 145}.items():
        p.calibrate_forward(rows, ms / 1000)
    p.draft.calibrate(first=0.030, later=0.023, per_catch_up_row=0.008)
    return p


def test_a_catch_up_counts_as_longer_only_past_what_one_verification_emits():
    p = DraftLengthPolicy(4)
    assert [p.extra_catch_up(n) for n in (1, 2, 5, 6, 75)] == [0, 0, 0, 1, 70]


def test_a_probe_runs_only_where_the_tokens_left_can_repay_its_catch_up():
    p, prior = costly_catch_up_policy(), [0.95, 0.9, 0.85, 0.8]
    # 70 rows to catch up (0.56 s) and 0.19 s of drafts and rows: 48 tokens at <= 6 ms saved do not repay it
    assert not p.probe_pays([], [], prior, remaining_tokens=48, catch_up_rows=70)
    assert p.probe_pays([], [], prior, remaining_tokens=1000, catch_up_rows=70)
    assert p.probe_pays([], [], prior, remaining_tokens=200, catch_up_rows=2)
    assert not p.probe_pays([], [], prior, remaining_tokens=200, catch_up_rows=200)


def test_no_probe_where_even_accepting_all_its_drafts_would_not_make_drafting_pay():
    p = costly_catch_up_policy()
    # the request's own acceptance, 20 of 40 at each position: one more all-accepted probe leaves it poor
    poor = dict(accepted=[20, 10, 5, 2], drafted=[40, 20, 10, 5], prior=[0.5, 0.5, 0.5, 0.5])
    assert not p.probe_pays(**poor, remaining_tokens=10**6, catch_up_rows=0)
    good = dict(accepted=[38, 35, 30, 25], drafted=[40, 38, 35, 30], prior=[0.9, 0.9, 0.85, 0.8])
    assert p.probe_pays(**good, remaining_tokens=10**6, catch_up_rows=0)
    # rows so dear that no acceptance pays: never a probe
    dear = policy_with_costs(fixed=0.010, per_row=0.010, k=4, draft=0.010)
    assert not dear.probe_pays([], [], [], remaining_tokens=10**6, catch_up_rows=0)


def test_before_any_acceptance_is_measured_a_probe_is_judged_at_perfect_acceptance():
    p = costly_catch_up_policy()
    assert p.probe_pays([], [], [], remaining_tokens=1000, catch_up_rows=70)
    assert not p.probe_pays([], [], [], remaining_tokens=48, catch_up_rows=70)
    assert DraftLengthPolicy(4).probe_pays([], [], [], remaining_tokens=1, catch_up_rows=10**6)   # no costs yet


def test_probes_back_off():
    p = DraftLengthPolicy(4)
    assert [n for n in range(200) if p.is_probe_step(n)] == [16, 32, 64, 128]


def test_calibration_times_the_few_row_counts_and_every_other_one_beyond():
    assert calibration_rows(1) == [1, 2]
    assert calibration_rows(4) == [1, 2, 3, 4, 5]
    assert calibration_rows(8) == [1, 2, 3, 4, 5, 7, 9]
    assert calibration_rows(9) == [1, 2, 3, 4, 5, 7, 9, 10]      # k + 1 always


def test_calibrated_counts_are_what_the_engine_timed(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8, "dynamic_k": True})
    assert sorted(llm.engine.k_policy.forward.shape) == calibration_rows(8)


def test_without_a_cost_line_every_request_drafts_its_limit():
    assert DraftLengthPolicy(4).choose([[0.0] * 4], [3], [False]) == [3]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_dynamic_k_keeps_greedy_output_and_reports_the_lengths(tiny_llama_dir, tiny_draft_dir, method):
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = tiny_draft_dir
    kw = dict(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    prompts = ["one two three one two three one two", "a b c a b c a b", "the cat sat on the mat the cat"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kw, speculative_config={**spec, "dynamic_k": True})
    assert llm.engine.k_policy.forward.known()                 # calibrated at start-up
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    stats = llm.get_spec_decode_stats()
    assert sum(stats.steps_by_draft_length) == stats.num_steps and len(stats.steps_by_draft_length) <= 5
    assert sum(llm.engine.k_policy.steps_by_k) > 0


def test_seeded_requests_follow_the_policy_and_keep_their_tokens(tiny_llama_dir, tiny_draft_dir):
    """A seeded request's tokens do not depend on its draft lengths (its random numbers
    are keyed by output index), so the policy picks its k as it does for any other request."""
    kw = dict(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    spec = {"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    fixed = LLM(**kw, speculative_config=spec).generate("x y z", params, use_tqdm=False)[0].outputs[0].token_ids
    dynamic = LLM(**kw, speculative_config={**spec, "dynamic_k": True})
    assert dynamic.generate("x y z", params, use_tqdm=False)[0].outputs[0].token_ids == fixed
    assert sum(dynamic.engine.k_policy.steps_by_k) > 0       # the policy chose its draft lengths


@pytest.mark.default_dynamic_k
def test_dynamic_k_is_on_by_default_for_free_proposers_only():
    assert SpeculativeConfig(method="ngram").dynamic_k is True
    assert SpeculativeConfig(method="suffix").dynamic_k is True
    assert SpeculativeConfig(method="draft_model", model="/some/draft").dynamic_k is False
    assert SpeculativeConfig(method="eagle").dynamic_k is False
    assert SpeculativeConfig(method="ngram", dynamic_k=False).dynamic_k is False     # the user's choice wins
    assert SpeculativeConfig(method="draft_model", model="/d", dynamic_k=True).dynamic_k is True
    with pytest.raises(ValueError, match="dynamic_k must be True, False or None"):
        SpeculativeConfig(method="ngram", dynamic_k="yes")


@pytest.mark.default_dynamic_k
def test_a_default_ngram_engine_chooses_k_and_keeps_greedy_output(tiny_llama_dir):
    kw = dict(model=tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    prompts = ["one two three one two three one two", "a b c a b c a b"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert llm.engine.k_policy is not None and llm.engine.k_policy.max_k == 4
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert sum(llm.engine.k_policy.steps_by_k) > 0


def test_rows_past_a_batch_never_read_cheaper_than_the_floor_share_of_its_average_row():
    """A rarely chosen count measured low once (36 rows at batch 32) must not make draft rows
    look nearly free; counts inside the calibrated shape keep their own cheap rows."""
    cost = RowCost()
    for rows in range(1, 6):
        cost.calibrate(rows, 0.010 + 0.002 * rows)
    cost.add(32, 0.080)
    cost.add(36, 0.082)                      # a lucky step: 0.5 ms a row past 32
    average_row = 0.080 / 32
    assert cost(33) == pytest.approx(0.080 + EXTRAPOLATED_ROW_SHARE * average_row)
    assert cost(36) == pytest.approx(0.080 + 4 * EXTRAPOLATED_ROW_SHARE * average_row)
    assert cost(3) == pytest.approx(0.016)   # the calibrated shape is untouched
