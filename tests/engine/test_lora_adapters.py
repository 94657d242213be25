"""LoRA adapters in the engine (vLLM's enable_lora / LoRARequest), on tiny random models with random
PEFT adapters: the adapted model's tokens and log-probabilities equal transformers + PEFT's; requests
with different adapters (and none) share steps without changing each other; cached prefixes are
per adapter; speculation stays lossless (the drafts run without the adapter); max_loras holds
requests of one adapter too many back; bad adapters are refused before any work."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specserve import LLM, LoRARequest, SamplingParams

from lora_adapters import peft_logits, write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Hello there, my friend", "The capital of France is", "one two three one two three"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, peaked_llama_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "attn_mlp": write_peft_adapter(peaked_llama_dir, str(root / "a"), seed=1),
        # every projection, rsLoRA's scale and a rank pattern: PEFT's scaling rules
        "all": write_peft_adapter(peaked_llama_dir, str(root / "b"), seed=2, r=8,
                                  target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"),
                                  use_rslora=True, rank_pattern={"up_proj": 2}, alpha_pattern={"o_proj": 4.0}),
    }


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, 1 + sorted(adapters).index(name), adapters[name])


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_loras", 2)
    kw.setdefault("kv_cache_memory", 1 << 24)
    return LLM(model_dir, dtype="float32", max_model_len=256, enable_lora=True, **kw)


@pytest.fixture(scope="module")
def llm(peaked_llama_dir) -> LLM:
    return make_llm(peaked_llama_dir)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["attn_mlp", "all"])
def test_adapted_tokens_and_logprobs_equal_transformers_with_peft(llm, adapters, peaked_llama_dir, name):
    out = llm.generate(PROMPTS[0], GREEDY, lora_request=lora(adapters, name))[0]
    base = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.outputs[0].token_ids != base.outputs[0].token_ids     # the adapter matters
    ids = list(out.prompt_token_ids) + out.outputs[0].token_ids
    n = len(out.prompt_token_ids)
    ref = torch.log_softmax(peft_logits(peaked_llama_dir, adapters[name], ids)[n - 1 : -1], dim=-1)   # [12, V]
    assert out.outputs[0].token_ids == ref.argmax(-1).tolist()
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
    want = ref.gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_mixed_adapters_in_one_batch_equal_each_alone(llm, adapters):
    loras = [lora(adapters, "attn_mlp"), lora(adapters, "all"), None]
    together = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras))
    alone = [tokens(llm.generate(p, GREEDY, lora_request=lr))[0] for p, lr in zip(PROMPTS, loras)]
    assert together == alone
    assert len({tuple(t) for t in tokens(llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras))}) == 3


def test_cached_prefixes_are_per_adapter(peaked_llama_dir, adapters):
    """A prompt computed with an adapter leaves blocks the base model must not reuse, and back."""
    long_prompt = "You are a careful assistant. Answer briefly. " * 6 + "What is two plus two?"
    llm = make_llm(peaked_llama_dir)
    a = lora(adapters, "attn_mlp")
    with_adapter = tokens(llm.generate(long_prompt, GREEDY, lora_request=a))
    base_after = tokens(llm.generate(long_prompt, GREEDY))
    hits_before = llm.get_prefix_cache_stats()["hits"]
    assert tokens(llm.generate(long_prompt, GREEDY, lora_request=a)) == with_adapter
    assert llm.get_prefix_cache_stats()["hits"] > hits_before    # its own prefix is reused
    fresh = make_llm(peaked_llama_dir, enable_prefix_caching=False)
    assert base_after == tokens(fresh.generate(long_prompt, GREEDY))
    assert with_adapter == tokens(fresh.generate(long_prompt, GREEDY, lora_request=a))


@pytest.mark.parametrize("spec", ["ngram", "draft_model", "eagle"])
def test_speculation_with_an_adapter_equals_plain_with_it(peaked_llama_dir, peaked_draft_dir, peaked_eagle_dir,
                                                         adapters, spec):
    config = {"ngram": {"method": "ngram", "num_speculative_tokens": 3},
              "draft_model": {"method": "draft_model", "model": peaked_draft_dir, "num_speculative_tokens": 3},
              "eagle": {"method": "eagle", "model": peaked_eagle_dir, "num_speculative_tokens": 3}}[spec]
    loras = [lora(adapters, "attn_mlp"), None, lora(adapters, "all")]
    plain = make_llm(peaked_llama_dir)
    fast = make_llm(peaked_llama_dir, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=24)
    assert tokens(fast.generate(PROMPTS, params, lora_request=loras)) == \
        tokens(plain.generate(PROMPTS, params, lora_request=loras))
    assert fast.get_spec_decode_stats().num_draft_tokens > 0
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    assert tokens(fast.generate(PROMPTS, seeded, lora_request=loras)) == \
        tokens(plain.generate(PROMPTS, seeded, lora_request=loras))


def test_samples_and_beam_search_run_with_the_adapter(llm, adapters):
    from specserve import BeamSearchParams

    a = lora(adapters, "attn_mlp")
    alone = tokens(llm.generate(PROMPTS[1], GREEDY, lora_request=a))[0]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, n=2, max_tokens=12), lora_request=a)[0]
    assert [c.token_ids for c in out.outputs] == [alone, alone]
    beams = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=6), lora_request=a)[0]
    base_beams = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    prompt_len = len(out.prompt_token_ids)
    assert beams.sequences[0].tokens[prompt_len:] != base_beams.sequences[0].tokens[prompt_len:]


def test_max_loras_holds_a_third_adapter_back_until_one_finishes(peaked_llama_dir, adapters, tmp_path):
    third = LoRARequest("third", 3, write_peft_adapter(peaked_llama_dir, str(tmp_path / "c"), seed=3))
    llm = make_llm(peaked_llama_dir, max_loras=2, max_cpu_loras=3)
    eng = llm.engine
    for p, lr in zip(PROMPTS, [lora(adapters, "attn_mlp"), lora(adapters, "all"), third]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4), lora_request=lr)
    eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))   # base: not held back
    eng.step()
    assert sorted(r.lora_id for r in eng.scheduler.running) == [0, 1, 2]
    assert [r.lora_id for r in eng.scheduler.waiting] == [3]
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.list_loras() == {1, 2, 3}


def test_idle_adapters_beyond_max_cpu_loras_are_dropped(peaked_llama_dir, adapters, tmp_path):
    llm = make_llm(peaked_llama_dir, max_loras=1, max_cpu_loras=1)
    a, b = lora(adapters, "attn_mlp"), lora(adapters, "all")
    first = tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=a))
    llm.generate(PROMPTS[0], GREEDY, lora_request=b)
    assert llm.engine.list_loras() == {b.lora_int_id}
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=a)) == first   # loaded again, the same
    assert llm.engine.list_loras() == {a.lora_int_id}
    assert llm.engine.remove_lora(a.lora_int_id) and llm.engine.list_loras() == set()
    assert not llm.engine.remove_lora(a.lora_int_id)


def test_bad_adapters_are_refused_before_any_work(llm, peaked_llama_dir, tiny_llama_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match="not enabled"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=64, kv_cache_memory=1 << 22).generate(
            "hi", GREEDY, lora_request=lora(adapters, "attn_mlp"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_lora(lora(adapters, "all"))      # id 1
    with pytest.raises(ValueError, match="already loaded"):
        llm.generate("hi", GREEDY, lora_request=[LoRARequest("y", 1, adapters["attn_mlp"])])
    dora = tmp_path / "dora"
    shutil.copytree(adapters["attn_mlp"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("dora", 7, str(dora)))
    big = write_peft_adapter(peaked_llama_dir, str(tmp_path / "big"), seed=4, r=32)
    with pytest.raises(ValueError, match="max_lora_rank 16"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("big", 8, big))
    assert os.path.isdir(adapters["attn_mlp"])
    # the engine still serves
    assert tokens(llm.generate(PROMPTS[0], GREEDY))[0]


def test_preempted_adapter_requests_come_back_with_their_adapter(peaked_llama_dir, adapters):
    """A pool too small for the batch: requests of two adapters and of none are preempted and
    computed again (from cached blocks of their own adapter); greedy and seeded outputs equal a
    roomy engine's."""
    prompts = [("You are a careful assistant. " * 3) + q for q in PROMPTS] * 2
    loras = [lora(adapters, "attn_mlp"), lora(adapters, "all"), None] * 2
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)] * 3
    want = tokens(make_llm(peaked_llama_dir).generate(prompts, params, lora_request=loras))
    roomy_block = make_llm(peaked_llama_dir).engine.runner.bytes_per_block
    small = make_llm(peaked_llama_dir, kv_cache_memory=16 * roomy_block, max_loras=3)
    outs = small.generate(prompts, params, lora_request=loras)
    assert tokens(outs) == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_an_adapter_in_use_is_not_removed(llm, adapters):
    a = lora(adapters, "attn_mlp")
    llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), lora_request=a)
    with pytest.raises(ValueError, match="in use"):
        llm.engine.remove_lora(a.lora_int_id)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.remove_lora(a.lora_int_id)


def test_a_mix_of_adapters_at_scales_is_their_weighted_sum(peaked_llama_dir, adapters):
    """LoRAMix (llama.cpp's per-request list): 0.5 x one adapter - 0.3 x another runs as the model
    whose weights gained 0.5 B1 A1 - 0.3 B2 A2 (transformers, merged); scale-0 parts are dropped and a
    lone part at scale 1 is that adapter itself."""
    from transformers import AutoModelForCausalLM

    from specserve.lora.peft_adapter import load_peft_adapter
    from specserve.lora.request import LoRAMix

    a, b = lora(adapters, "attn_mlp"), lora(adapters, "all")
    llm = make_llm(peaked_llama_dir, max_loras=3, max_cpu_loras=4)
    out = llm.generate(PROMPTS[0], GREEDY, lora_request=LoRAMix(((a, 0.5), (b, -0.3), (a, 0))))[0]
    hf = AutoModelForCausalLM.from_pretrained(peaked_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for request, scale in ((a, 0.5), (b, -0.3)):
            for (layer, proj), (lo_a, lo_b) in load_peft_adapter(request.lora_path, hf.config, 16).modules.items():
                block = hf.model.layers[layer]
                module = getattr(block.self_attn if hasattr(block.self_attn, proj) else block.mlp, proj)
                module.weight += scale * lo_b @ lo_a
        ids = list(out.prompt_token_ids) + out.outputs[0].token_ids
        n = len(out.prompt_token_ids)
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, n - 1 : -1].float(), dim=-1)
    assert out.outputs[0].token_ids == ref.argmax(-1).tolist()
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0],
                               atol=2e-4, rtol=0)
    alone = tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=a))
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=LoRAMix(((a, 1.0), (b, 0.0))))) == alone
    assert tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=LoRAMix(()))) == \
        tokens(llm.generate(PROMPTS[0], GREEDY))
    with pytest.raises(ValueError, match="finite"):
        LoRAMix(((a, float("nan")),))


def test_dynamic_k_starts_an_adapters_requests_from_that_adapters_acceptance(peaked_llama_dir, peaked_draft_dir,
                                                                             adapters):
    """With adapters in use, dynamic_k's prior for a new request is its adapter's acceptance (once
    that adapter has drafted enough), not the engine-wide mix; the outputs stay plain's."""
    from specserve.engine.drafting import MIN_ADAPTER_DRAFTS

    spec = {"method": "draft_model", "model": peaked_draft_dir, "num_speculative_tokens": 3, "dynamic_k": True}
    llm = make_llm(peaked_llama_dir, speculative_config=spec)
    a = lora(adapters, "all")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    got = tokens(llm.generate(PROMPTS * 2, params, lora_request=[a, None, None] * 2))
    assert got == tokens(make_llm(peaked_llama_dir).generate(PROMPTS * 2, params, lora_request=[a, None, None] * 2))
    drafting = llm.engine.drafting
    by = drafting.stats_by_adapter
    assert set(by) == {0, a.lora_int_id}
    assert by[0].num_draft_tokens + by[a.lora_int_id].num_draft_tokens == llm.get_spec_decode_stats().num_draft_tokens
    engine_wide = drafting.k_policy.prior(drafting.engine_stats.accepted_per_position,
                                          drafting.engine_stats.drafted_per_position)
    for lora_id, stats in by.items():
        want = (drafting.k_policy.prior(stats.accepted_per_position, stats.drafted_per_position)
                if stats.num_draft_tokens >= MIN_ADAPTER_DRAFTS else engine_wide)
        assert drafting.prior_for(lora_id) == want
    assert drafting.prior_for(99) == engine_wide
